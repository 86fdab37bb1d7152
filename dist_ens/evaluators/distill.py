"""After the last step: the ensemble distilled into a student (config.distill; the
objective in dist_ens.ensembles.distill, the students in dist_ens.ensembles.students),
its test metrics and inference cost under 'distill' in final_metrics.json.

The teacher is every included (not frozen) member's logits on the whole training split,
computed once on the mesh and held on the host ([K, N, C] floats); the student trains on
one device on batches of that split drawn from (seed, its own stream), without the
run's augmentation. It is saved to workdir/student.npz (dist_ens.io.student_file) and
scored from its log-probabilities on the test split with the run's own metric
definitions (the task's scorer, as one member); with config.eval.ood_dataset, its OOD
AUROC/AUPR by its predictive entropy go under 'distill'.'ood'. Its cost is counted as
parameters and XLA's cost analysis of one training-mode forward pass per example (what
dist_ens.parallel.strategy.forward_flops measures), against the K members'.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dist_ens import data
from dist_ens.core.model import init_shapes
from dist_ens.ensembles import distill, students
from dist_ens.errors import ConfigError
from dist_ens.eval import evaluate
from dist_ens.io import run_files, student_file
from dist_ens.parallel import mesh as mesh_lib, strategy
from dist_ens.evaluators import posthoc
from dist_ens.training.loop import Call, PeriodicAction
from dist_ens.evaluators.evaluator import EvalRun

# Examples per forward pass when the inference cost is counted (divided out again).
_COST_BATCH = 64


class Distill(PeriodicAction):
  """See the module doc."""

  def __init__(self, spec: distill.DistillSpec):
    super().__init__(0, at_end=True)
    self.spec = spec

  def run(self, call: Call) -> None:
    session = call.session
    included = posthoc.included(call)
    if not included.any():  # Every member went non-finite: the run says so.
      logging.info('distillation skipped: no member is in the ensemble.')
      return
    seed, parts = session.spec.seed, session.parts
    net = students.make_student(self.spec.student, parts.model, parts.num_outputs,
                                int(included.sum()))
    train = session.run_data.dataset.train
    with session.off_clock():
      teacher = _train_logits(call)[included]
      params, state, losses = distill.train_student(
          net, self.spec, students.student_key(seed), seed,
          lambda idx: np.asarray(train.read(idx)[0]), teacher)
      if run_files.is_writer():
        student_file.write(session.workdir, params, state, self._meta(call, net))
      rows, ood_split = session.spec.eval.batch_size, session.run_data.ood
      log_probs = _log_probs(net, params, state, session.run_data.dataset.test.x, rows)
      ood = None if ood_split is None else _log_probs(net, params, state, ood_split.x, rows)
    session.results['distill'] = self._results(call, net, params, losses, log_probs, included)
    out = session.results['distill']
    if ood is not None:  # By its entropy: one network has no mutual information.
      scored = session.evaluator.scorer.ood(log_probs[None], ood[None],
                                            session.run_data.dataset.test.y)
      out['ood'] = {'dataset': session.spec.eval.ood_dataset,
                    **{k: v for k, v in scored['ensemble'].items() if k.endswith('_entropy')}}
    if session.writes_final_events:
      session.write({'step': call.step, 'split': 'test_distill',
                     'ensemble': {k: out[k] for k in _METRICS if k in out}})
    logging.info('distilled into a %r student (%d head(s), %d steps, T %g): it keeps %.3f of '
                 "the ensemble's NLL gain over the mean member at %.3g of its FLOPs:\n%s",
                 self.spec.student, net.num_heads, self.spec.steps, self.spec.temperature,
                 _number(out['nll_gain_kept']), _number(out['cost']['flops_ratio']),
                 _table(call, out))

  def _meta(self, call: Call, net: students.StudentNet) -> dict[str, Any]:
    session = call.session
    return {'format': student_file.__doc__.splitlines()[0], 'kind': net.kind,
            'num_heads': net.num_heads, 'step': call.step,
            'temperature': self.spec.temperature, 'input_shape': list(session.parts.input_shape),
            'input_dtype': np.dtype(session.parts.input_dtype).name,
            'num_outputs': session.parts.num_outputs}

  def _results(self, call: Call, net: students.StudentNet, params: Any, losses: np.ndarray,
               log_probs: np.ndarray, included: np.ndarray) -> dict[str, Any]:
    session = call.session
    test_y = session.run_data.dataset.test.y
    scored = session.evaluator.scorer.metrics(log_probs[None], test_y)['members']
    metrics = {k: float(np.asarray(v)[0]) for k, v in scored.items()
               if np.ndim(v) == 1 and len(v) == 1}
    member_nll = float(np.mean(np.asarray(session.results['members']['nll'])[included]))
    ensemble_nll = float(session.results['ensemble']['nll'])
    gain = member_nll - ensemble_nll
    tail = max(1, len(losses) // 10)
    return {'student': self.spec.student, 'heads': net.num_heads,
            'members_distilled': int(included.sum()), 'steps': self.spec.steps,
            'temperature': self.spec.temperature, 'learning_rate': self.spec.learning_rate,
            'batch_size': min(self.spec.batch_size, session.run_data.dataset.train.num_examples),
            'loss_first': float(losses[0]), 'loss_last': float(np.mean(losses[-tail:])),
            'nll_member_mean': member_nll, 'nll_ensemble': ensemble_nll,
            'nll_gain_kept': float((member_nll - metrics['nll']) / gain) if gain > 0 else None,
            **metrics, 'cost': _cost(call, net, params, included),
            'file': student_file.FILE}


_METRICS = ('accuracy', 'nll', 'ece', 'brier', 'adaptive_ece')


def _number(value: float | None) -> float:
  """A result for the log line: None (no gain to keep, no FLOP count) as NaN."""
  return float('nan') if value is None else value


def _table(call: Call, out: dict[str, Any]) -> str:
  session = call.session
  members = {k: float(np.nanmean(v)) for k, v in session.results['members'].items()
             if k in _METRICS}
  rows = {'member mean': {'ensemble': members},
          'ensemble': {'ensemble': session.results['ensemble']},
          f"student ({out['student']})": {'ensemble': out}}
  return posthoc.ensembles_table(rows, session.parts.task)


def _train_logits(call: Call) -> np.ndarray:
  """[M, N, C] every member's logits on the whole training split, on the host."""
  session = call.session
  mesh, train = session.parts.mesh, session.run_data.dataset.train
  step = evaluate.make_outputs_step(session.parts.predict_model, mesh)
  d = mesh.shape[mesh_lib.DATA]
  rows = -(-min(session.spec.eval.batch_size, train.num_examples) // d) * d
  variables, sharding, outs = (call.state.params, call.state.model_state), \
      mesh_lib.batch_sharding(mesh), []
  for start, valid in evaluate.padded_chunks(train.num_examples, rows):
    x = evaluate.pad_rows(np.asarray(train.read(np.arange(start, start + valid))[0]), rows)
    outs.append((step(variables, data.to_global(x, sharding), np.uint32(start)), valid))
  return np.concatenate([np.asarray(o)[:, :valid] for o, valid in outs], axis=1)


def _log_probs(net: students.StudentNet, params: Any, state: Any, x: np.ndarray,
               batch_size: int) -> np.ndarray:
  """[N, C] the student's log-probabilities on x, in equal-shaped padded batches."""
  rows = min(batch_size, len(x))
  forward = jax.jit(net.log_probs)
  out = [np.asarray(forward(params, state, jnp.asarray(evaluate.pad_rows(
      x[start:start + valid], rows))))[:valid]
         for start, valid in evaluate.padded_chunks(len(x), rows)]
  return np.concatenate(out)


def _cost(call: Call, net: students.StudentNet, params: Any, included: np.ndarray
          ) -> dict[str, Any]:
  """Parameters and forward FLOPs per example of the student and of the included members
  (each stack's members at their own architecture's cost)."""
  parts = call.session.parts
  count = lambda tree: int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(tree)))
  flops = lambda model: strategy.forward_flops(model, parts.input_shape, _COST_BATCH,
                                               parts.input_dtype)
  sample = jax.ShapeDtypeStruct((1, *parts.input_shape), parts.input_dtype)
  ensemble_params, ensemble_flops = 0, 0
  for stack in parts.stacks:
    members = int(included[stack.first_member:stack.first_member + stack.num_members].sum())
    if members:
      ensemble_params += members * count(
          init_shapes(stack.model, sample)[0])
      member_flops = flops(stack.model)
      ensemble_flops = (None if ensemble_flops is None or member_flops is None
                        else ensemble_flops + members * member_flops)
  student_flops = flops(net.as_model())
  return {'by': 'parameters; XLA cost-analysis FLOPs of one forward pass per example',
          'student_params': count(params), 'ensemble_params': ensemble_params,
          'params_ratio': count(params) / ensemble_params,
          'student_flops': None if student_flops is None else student_flops / _COST_BATCH,
          'ensemble_flops': None if ensemble_flops is None else ensemble_flops / _COST_BATCH,
          'flops_ratio': (student_flops / ensemble_flops
                          if student_flops and ensemble_flops else None)}


def distill_actions(spec: distill.DistillSpec | None, task: Any,
                    method: Any) -> list[PeriodicAction]:
  """[Distill] when a student is asked for (config.distill, its fields checked by
  dist_ens.config.specs.distill_spec), after refusing in one line what cannot work:
  another task than classification, a method whose members share leaves or predict with
  other weights."""
  if spec is None:
    return []
  field = f'config.distill.student={spec.student!r}'
  if task.name != 'classification':
    raise ConfigError(f"{field} distils a classifier's predictive (soft targets over classes); "
                      f"config.task={task.name!r} is not classification: set "
                      "distill.student=''.")
  if (method.shares or method.collects or method.outputs_per_output != 1
      or method.wrap_loss is not None or method.wrap_model is not None):
    raise ConfigError(f'{field} distils independently trained members of the run\'s model; '
                      f'config.ensemble.method={method.name!r} (or ensemble.own) shares leaves '
                      "or predicts with other weights: use method='deep' with own='all', or "
                      "distill.student=''.")
  return [Distill(spec)]


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """[Distill] with distill.student (distill_actions)."""
  return distill_actions(run.spec.distill, run.task, run.method)
