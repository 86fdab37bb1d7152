"""After the last step: a last-layer Laplace approximation of every member
(config.eval.laplace; the math in dist_ens.eval.laplace), test metrics of the members'
Laplace predictives and of their mixture, under 'laplace' in final_metrics.json.

Every member's fit is one program over the member axis: its output layer's features on
the training split (each example's gradient of its first logit in the output kernel,
which is the layer's input when the layer is linear, checked), the Gauss-Newton sums,
their eigenbasis, the prior precision (validation log-likelihood by the probit
predictive over dist_ens.eval.laplace.PRIOR_GRID, else the marginal likelihood) and the
predictive. The curvature uses each member's own training examples: the whole training
split, or with config.data.member_split its split's part (a bootstrap resample is not
singled out: every member counts the whole split). Each stack (core/stacks.py:
several where member groups have their own architectures) is fitted on its own (_Stack:
its model, head and members), one file entry per stack, and the metrics join every
stack's members in id order.

The fit is saved to workdir/laplace.npz (dist_ens.evaluators.laplace_file) and the test split is
scored by dist_ens.eval.laplace_predictive from the arrays that file gives back, which
is what Ensemble.load(workdir).predict(x, laplace=True) computes. With weight draws
(eval.laplace_samples > 0) and eval.joint_tau > 0, the draws' dyadic joint log-loss
(dist_ens.eval.joint, the batches of the 'joint' section) goes under 'laplace'.'joint'.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dist_ens.config.specs import EvalSpec
from dist_ens.errors import ConfigError
from dist_ens.eval import evaluate, joint, laplace, laplace_predictive
from dist_ens.evaluators import laplace_file
from dist_ens.models.heads import head_paths
from dist_ens.parallel.sharding_rules import path_str
from dist_ens.evaluators import posthoc
from dist_ens.training.loop import Call, PeriodicAction
from dist_ens.evaluators.evaluator import EvalRun

# Rows per feature batch: the full form's Jacobians are [rows, P, C] per member.
_ROWS = 128
# The curvature's sums, added batch by batch: one program, not an eager add per leaf.
_add_trees = jax.jit(functools.partial(jax.tree.map, jnp.add))
# The output layer must be linear in its kernel to this relative tolerance, by the
# precision the model computes in (config.precision).
_LINEAR_TOLERANCE = {'float32': 1e-3, 'bfloat16': 3e-2}


def head_leaves(params: Any, num_outputs: int) -> tuple[str, str]:
  """(kernel, bias) names of the output layer in one member's params shapes.

  Raises:
    ConfigError: no head of a [F, C] kernel and a [C] bias.
  """
  names = head_paths(params, num_outputs)
  shapes = {path_str(p): tuple(leaf.shape)
            for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  kernels = [n for n in names if len(shapes[n]) == 2 and shapes[n][1] == num_outputs]
  biases = [n for n in names if shapes[n] == (num_outputs,)]
  if len(names) != 2 or len(kernels) != 1 or len(biases) != 1:
    raise ConfigError(f'config.eval.laplace fits the output layer, a [features, {num_outputs}] '
                      f'kernel and a [{num_outputs}] bias; the model\'s head is '
                      f'{sorted(names) or "not found"} ({[shapes[n] for n in sorted(names)]}). '
                      "Set eval.laplace=''.")
  return kernels[0], biases[0]


class _Stack(NamedTuple):
  """Members one vmap fits: the whole ensemble, or one member group (its own model and
  head width)."""
  model: Any  # the stack's predicting model
  variables: tuple[Any, Any]  # (params, model_state), leaves [m, ...]
  rows: np.ndarray  # [m, N] bool: the training rows each member's curvature counts
  first: int  # the id of its first member
  names: tuple[str, str]  # its output layer's (kernel, bias)

  @property
  def feats(self) -> Any:
    """(params, model_state, x) -> every member's (logits, psi, head error)."""
    return jax.vmap(functools.partial(laplace_predictive.head_features, self.model,
                                      self.names[0]), in_axes=(0, 0, None))


def _stacks(call: Call) -> list[_Stack]:
  """The stacks the fit runs on, in id order (each has its own model and head)."""
  parts, state, rows = call.session.parts, call.state, _member_rows(call)

  def stack(model, params, model_state, first, num_outputs):
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
    count = jax.tree.leaves(params)[0].shape[0]
    return _Stack(model, (params, model_state), rows[first:first + count], first,
                  head_leaves(one, num_outputs))

  return [stack(one.predict_model, s.params, s.model_state, one.first_member, one.num_outputs)
          for one, s in zip(parts.stacks, parts.places.split(state))]


class Laplace(PeriodicAction):
  """The fit, its file (workdir/laplace.npz, evaluators/laplace_file.py) and its test metrics (see
  the module doc); with weight draws and `joint` = (tau, batches), their joint log-loss."""

  def __init__(self, kind: str, samples: int, joint_batches: tuple[int, int] | None = None):
    super().__init__(0, at_end=True)
    self.kind, self.samples, self.joint = kind, samples, joint_batches

  def run(self, call: Call) -> None:
    session = call.session
    if not posthoc.included(call).any():  # Every member went non-finite: the run says so.
      logging.info('Laplace skipped: no member is in the ensemble.')
      return
    stacks, data = _stacks(call), session.run_data
    with session.off_clock():
      fitted = [self._fit(call, stack) for stack in stacks]
      fits = [fit for fit, _, _, _ in fitted]
      laplace_file.write(session.workdir, fits)
      # What Ensemble.load builds from the file, so predict(laplace=True) gives these.
      arrays = [laplace_predictive.fitted_arrays(fit, session.spec.seed,
                                                 session.parts.num_outputs, session.parts.mesh)
                for fit in fits]
      plain, laplaced, draws = self._log_probs(call, stacks, arrays, data.dataset.test)
      ood = (None if data.ood is None else
             self._log_probs(call, stacks, arrays, data.ood)[1])
    deltas = np.concatenate([d for _, d, _, _ in fitted])
    self._report(call, plain, laplaced, deltas, fitted[0][2], min(c for *_, c in fitted))
    if self.samples and self.joint:
      session.results['laplace']['joint'] = self._joint(call, draws)
    if ood is not None:  # OOD AUROC/AUPR by the Laplace predictives' uncertainty.
      session.results['laplace']['ood'] = {
          'dataset': session.spec.eval.ood_dataset,
          **session.evaluator.scorer.ood(laplaced, ood, data.dataset.test.y,
                                         posthoc.included(call))}

  def _fit(self, call: Call, stack: _Stack
           ) -> tuple[laplace_predictive.LaplaceFit, np.ndarray, str, int]:
    """(the stack's fit, its [m] prior precisions in float64, how they were chosen, the
    training examples counted)."""
    curvature, error, count = self._curvature(call, stack)
    if error > _LINEAR_TOLERANCE.get(call.session.spec.precision, 1e-3):
      raise ConfigError(f'config.eval.laplace: the output layer {stack.names[0]} is not '
                        f'linear in its features (relative error {error:.2g}); set '
                        "eval.laplace=''.")
    post = jax.jit(jax.vmap(functools.partial(laplace.posterior, self.kind)))(curvature)
    deltas, by = self._prior(call, stack, post)
    fit = laplace_predictive.LaplaceFit(self.kind, self.samples, stack.names[0], call.step,
                                        np.asarray(deltas, np.float32), call.session.fetch(post),
                                        stack.first)
    return fit, deltas, by, count

  def _joint(self, call: Call, draws: np.ndarray) -> dict[str, Any]:
    """The joint log-loss of the weight draws' label log-likelihoods [M, S, N]: member m's
    is its draws' mixture, the ensemble's that of every included member's draws."""
    tau, num_batches = self.joint
    batches = joint.dyadic_batches(draws.shape[-1], tau, num_batches, call.session.spec.seed)
    members = [joint.joint_log_loss(d, batches).ensemble for d in draws]
    kept = draws[posthoc.included(call)].reshape(-1, draws.shape[-1])
    return {'tau': tau, 'kappa': joint.KAPPA, 'batches': num_batches, 'samples': self.samples,
            'members': members, 'ensemble': joint.joint_log_loss(kept, batches).ensemble}

  def _report(self, call, plain, laplaced, deltas, by, count) -> None:
    session = call.session
    included, test_y = posthoc.included(call), session.run_data.dataset.test.y
    before = session.evaluator.scorer.metrics(plain, test_y, included)
    after = session.evaluator.scorer.metrics(laplaced, test_y, included)
    predictive = f'mc:{self.samples}' if self.samples else 'probit'
    session.results['laplace'] = {'kind': self.kind, 'predictive': predictive,
                                  'prior_precision': [float(d) for d in deltas],
                                  'prior_precision_by': by, 'train_examples': count, **after}
    if stacks := posthoc.stack_ensembles(call, laplaced):  # each stack's, as 'groups' has
      session.results['laplace']['groups'] = stacks
    if session.writes_final_events:
      session.write({'step': call.step, 'split': 'test_laplace', **after})
    logging.info('Laplace (%s, %s predictive; prior precision by %s: %s) test metrics:\n%s',
                 self.kind, predictive, by, np.round(deltas, 4).tolist(),
                 posthoc.before_after_table(before, after, session.parts.task,
                                            ('plain', 'Laplace')))

  def _batches(self, call: Call, split: Any):
    """(x, y, mask, valid) of equal-shaped batches of `split`, padding masked."""
    rows = min(_ROWS, call.session.spec.eval.batch_size)
    for start, valid in evaluate.padded_chunks(split.num_examples, rows):
      x, y = (np.asarray(a) for a in split.read(np.arange(start, start + valid)))
      yield (evaluate.pad_rows(x, rows), evaluate.pad_rows(y, rows),
             (np.arange(rows) < valid).astype(np.float32), valid)

  def _curvature(self, call: Call, stack: _Stack) -> tuple[laplace.Curvature, float, int]:
    """Every member's Gauss-Newton sums over the training split, the largest relative
    error of the linear head, and the examples counted."""
    kind, variables, feats = self.kind, stack.variables, stack.feats

    @jax.jit  # The state goes in as arguments: a constant cannot span processes.
    def step(variables, x, mask):  # mask: [M, rows], each member's own rows
      logits, psi, error = feats(*variables, x)
      batch = jax.vmap(functools.partial(laplace.batch_curvature, kind))(
          psi, jax.nn.softmax(logits, -1), mask)
      return batch, error.max()

    train, pools = call.session.run_data.dataset.train, stack.rows
    total, worst, start = None, 0.0, 0
    for x, _, mask, valid in self._batches(call, train):
      rows = pools[:, start:start + len(mask)]
      rows = np.pad(rows, ((0, 0), (0, len(mask) - rows.shape[1]))) * mask
      batch, error = step(variables, x, rows.astype(np.float32))
      total = batch if total is None else _add_trees(total, batch)
      # fetch: one batch in flight
      worst, start = max(worst, float(call.session.fetch(error))), start + valid
    return total, worst, int(pools.sum(1).min())

  def _prior(self, call: Call, stack: _Stack, post: laplace.Posterior
             ) -> tuple[np.ndarray, str]:
    """[m] prior precisions from PRIOR_GRID and how they were chosen."""
    session = call.session
    grid, kind, names, feats = (jnp.asarray(laplace.PRIOR_GRID), self.kind, stack.names,
                                stack.feats)
    params, model_state = stack.variables
    if session.run_data.validation is None:
      norm2 = lambda p: sum(jnp.sum(jnp.square(laplace_predictive.leaf(p, n).astype(
          jnp.float32))) for n in names)
      evidence = jax.jit(jax.vmap(lambda q, p: laplace.log_marginal_likelihood(
          kind, q, norm2(p), grid)))(post, params)
      return np.asarray(laplace.PRIOR_GRID)[np.argmax(session.fetch(evidence), 1)], \
          'marginal likelihood'

    def member_scores(logits, psi, q, y, mask):  # [D] validation log-likelihoods
      def at(delta):
        cov = laplace.logit_covariance(kind, q, psi, delta)
        log_probs = laplace.predictive_log_probs(logits, cov, 0, None)
        return (mask * jnp.take_along_axis(log_probs, y[:, None], -1)[:, 0]).sum()
      return jax.vmap(at)(grid)

    @jax.jit
    def scores(params, model_state, post, x, y, mask):
      logits, psi, _ = feats(params, model_state, x)
      return jax.vmap(member_scores, in_axes=(0, 0, 0, None, None))(logits, psi, post, y, mask)

    total = sum(session.fetch(scores(params, model_state, post, x, y.astype(np.int32), mask))
                for x, y, mask, _ in self._batches(call, session.run_data.validation))
    return np.asarray(laplace.PRIOR_GRID)[np.argmax(total, 1)], 'validation nll'

  def _log_probs(self, call: Call, stacks: list[_Stack],
                 arrays: list[laplace_predictive.LaplaceArrays], split: Any
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[M, N, C] the members' plain log-probabilities and their Laplace predictive's, and
    [M, S, N] each weight draw's log-likelihood of the split's labels, in id order."""
    plain, laplaced, draws = [], [], []
    for stack, stack_arrays in zip(stacks, arrays):
      step = _predictive_step(self.kind, stack)
      outs = [(call.session.fetch(step(stack.variables, stack_arrays, x, y.astype(np.int32))),
               valid) for x, y, _, valid in self._batches(call, split)]
      plain.append(np.concatenate([a[:, :k] for (a, _, _), k in outs], 1))
      laplaced.append(np.concatenate([b[:, :k] for (_, b, _), k in outs], 1))
      draws.append(np.concatenate([d[..., :k] for (_, _, d), k in outs], -1))
    return np.concatenate(plain), np.concatenate(laplaced), np.concatenate(draws)


def _predictive_step(kind: str, stack: _Stack) -> Any:
  """jit((params, model_state), arrays, x, y) -> the stack's plain and Laplace
  log-probabilities [m, B, C] and its weight draws' label log-likelihoods [m, S, B]."""

  @jax.jit
  def step(variables, arrays, x, y):
    plain, laplaced, draws = laplace_predictive.members_predictive(
        stack.model, kind, stack.names[0], variables, arrays, x)
    return plain, laplaced, (draws * jax.nn.one_hot(y, draws.shape[-1])).sum(-1)

  return step


def _member_rows(call: Call) -> np.ndarray:
  """[M, N] bool: the training rows each member's curvature counts (its member_split
  part; every row without one)."""
  session = call.session
  m, n = session.spec.num_members, session.run_data.dataset.train.num_examples
  splits = session.run_data.member_splits
  if splits is None:
    return np.ones((m, n), bool)
  rows = np.zeros((m, n), bool)
  for member, pool in enumerate(splits.member_pools(m)):
    rows[member, pool] = True
  return rows


def laplace_actions(spec: EvalSpec, task: Any, method: Any) -> list[PeriodicAction]:
  """[Laplace] when config.eval.laplace (spec.laplace) is set, after refusing, in one line, what it
  cannot fit: a task without softmax outputs, a method whose members share leaves or
  predict with more than their trained weights."""
  kind = spec.laplace
  if not kind:
    return []
  if kind not in laplace.KINDS:
    raise ConfigError(f'config.eval.laplace={kind!r}; use one of {laplace.KINDS}, or \'\' (off).')
  samples = spec.laplace_samples
  if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
    raise ConfigError(f'config.eval.laplace_samples={samples!r} must be an int >= 0 (0: the '
                      'probit approximation; k: k logit draws per example).')
  if task.name != 'classification':
    raise ConfigError(f'config.eval.laplace={kind!r} is the softmax cross-entropy\'s Gauss-Newton '
                      f'and predictive; config.task={task.name!r} is not a classifier\'s: set '
                      "eval.laplace=''.")
  # wrap_loss: the members train on several outputs per example (MIMO's heads, an
  # epinet's index samples), not one output layer's; last_layer_laplace: the output layer
  # has its own posterior (SNGP's).
  if (method.shares or method.collects or method.outputs_per_output != 1
      or method.wrap_loss is not None or not method.last_layer_laplace):
    raise ConfigError(f'config.eval.laplace={kind!r} fits each independently trained '
                      f'member\'s output layer; config.ensemble.method={method.name!r} (or '
                      "ensemble.own) shares leaves or predicts with other weights: use "
                      "method='deep' with own='all', or eval.laplace=''.")
  tau = spec.joint_tau
  return [Laplace(kind, samples, (tau, spec.joint_batches) if tau else None)]


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """[Laplace] with eval.laplace (laplace_actions)."""
  return laplace_actions(run.spec.eval, run.task, run.method)
