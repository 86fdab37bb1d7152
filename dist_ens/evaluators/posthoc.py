"""What the post-hoc steps share: the split outputs they read (computed once per split
and step), the base of their actions (run once after the last step), their tables, and
the refusals, before training, of a step the run's task cannot do.

The steps, one file each beside this one (each with its evaluator, registered in
dist_ens/evaluators/registry.py):

  method_members.py  test metrics of the members config.ensemble.method predicts with
                     (snapshots, SWAG samples; dist_ens.ensembles.methods)
  mc_dropout.py      test metrics with K MC dropout samples per member
                     (config.eval.mc_samples; dist_ens.eval.evaluate)
  temperature.py     the task's recalibration fitted on the validation split
                     (config.eval.temperature_scaling; classification's Task.calibrate is
                     temperature scaling, dist_ens.tasks.temperature); test metrics before
                     and after
  greedy.py          Caruana's greedy ensemble selection (with replacement or not) by
                     validation NLL, beside SelectTopK (config.select.method='greedy';
                     dist_ens.ensembles.selection)

Each puts its results in call.session.results (so in final_metrics.json), writes an event and
logs a table. From Python:

  dist_ens.train(config, workdir, actions=[temperature.TemperatureScale(), greedy.GreedySelect(8)])

They evaluate whole splits to every member's outputs on the host
(evaluate.split_outputs), computed once per split and shared by the actions built
together, and score them with the task's metrics (call.session.evaluator.scorer): nothing here
knows what the outputs mean.
"""

from typing import Any

import numpy as np

from dist_ens.config.specs import RunSpec
from dist_ens.errors import ConfigError
from dist_ens.eval import evaluate
from dist_ens.tasks import Task, check_steps
from dist_ens.training.loop import Call, PeriodicAction
from dist_ens.evaluators.predictions import SplitPredictions
from dist_ens.core.state import member_flags


class SplitOutputs:
  """Every member's outputs [M, N, ...] on a split, computed once per step. Given the
  run's SplitPredictions, the plain outputs of the test and validation splits are the
  ones the final evaluations computed (one pass for all of them)."""

  def __init__(self, predictions: SplitPredictions | None = None):
    self._predictions = predictions
    self._steps: dict[int, Any] = {}
    self._cache: dict[tuple[str, int, int], np.ndarray] = {}

  def get(self, call: Call, split: str, mc_samples: int = 0) -> np.ndarray:
    """split: 'validation', 'test' or 'ood'."""
    session = call.session
    if self._predictions is not None and not mc_samples and split != 'ood':
      return self._predictions.predict(call, split_data(call, split)).outputs
    key = (split, mc_samples, call.step)
    if key not in self._cache:
      if mc_samples not in self._steps:
        self._steps[mc_samples] = evaluate.make_outputs_step(
            session.parts.predict_model, session.parts.mesh, mc_samples=mc_samples,
            combine=session.parts.task.combine, seed=session.spec.seed)
      members = session.evaluator.view(call.state)
      with session.off_clock():
        self._cache[key] = evaluate.split_outputs(
            self._steps[mc_samples], (members.params, members.model_state),
            split_data(call, split), session.spec.eval.batch_size, session.parts.mesh)
    return self._cache[key]


def split_data(call: Call, name: str):
  """The split a post-hoc step reads: 'test', 'ood' or 'validation' (refused in one line
  where the run holds none out)."""
  session = call.session
  if name == 'test':
    return session.run_data.dataset.test
  if name == 'ood':
    return session.run_data.ood
  if session.run_data.validation is None:
    raise ConfigError('post-hoc calibration and greedy selection fit on the validation split, '
                      'but config.data.validation_size=0; set it > 0 (e.g. 1000).')
  return session.run_data.validation


def included(call: Call) -> np.ndarray:
  """[M] bool: the members in the ensemble (not frozen)."""
  return ~np.asarray(member_flags(call.session.fetch(call.state.frozen)), bool)


def stack_ensembles(call: Call, outputs: np.ndarray) -> dict[str, Any]:
  """Where the run joins several stacks (core/stacks.py), each stack's name -> its member
  ids and the test metrics of the ensemble of its non-frozen members' `outputs` ([M, N,
  ...] in id order; None where every one is frozen); {} for one stack."""
  session = call.session
  if not session.parts.places.joined:
    return {}
  members, test_y = included(call), session.run_data.dataset.test.y
  out = {}
  for stack, place in zip(session.parts.stacks, session.parts.places):
    ids = place.ids
    out[stack.stack.name] = {'members': list(range(ids.start, ids.stop)), 'ensemble': (
        session.evaluator.scorer.metrics(outputs[ids], test_y, members[ids])['ensemble']
        if members[ids].any() else None)}
  return out


class Posthoc(PeriodicAction):
  """An action that runs once after the last step on shared split log-probabilities."""
  needs_validation = True

  def __init__(self, cache: SplitOutputs | None = None):
    super().__init__(0, at_end=True)
    self.cache = cache or SplitOutputs()
    self._checked = False

  def on_step(self, call: Call) -> None:
    # Fail at the first step, not after training, when there is nothing to fit on.
    if not self._checked and self.needs_validation:
      split_data(call, 'validation')
    self._checked = True


def before_after_table(before: dict[str, Any], after: dict[str, Any], task: Task,
                       names: tuple[str, str] = ('before', 'after')) -> str:
  """Member-mean and ensemble metrics of two evaluations as a Markdown table."""
  columns = [k for k in task.select_metrics if k in before['ensemble'] and k in after['ensemble']]
  lines = ['| | ' + ' | '.join(columns) + ' |', '|---|' + '---|' * len(columns)]
  for scope in ('members', 'ensemble'):
    for name, res in zip(names, (before, after)):
      if scope not in res:
        continue
      values = [float(np.nanmean(res[scope][k])) for k in columns]
      label = f'{name} member mean' if scope == 'members' else f'{name} ensemble'
      lines.append(f'| {label} | ' + ' | '.join(f'{v:.4f}' for v in values) + ' |')
  return '\n'.join(lines)



def ensembles_table(rows: dict[str, dict[str, Any]], task: Task) -> str:
  """Test metrics of several ensembles ({name: {'ensemble': {...}}}) as a Markdown table."""
  columns = [k for k in task.select_metrics if all(k in r['ensemble'] for r in rows.values())]
  lines = ['| ensemble | ' + ' | '.join(columns) + ' |', '|---|' + '---|' * len(columns)]
  for name, r in rows.items():
    lines.append(f'| {name} | ' + ' | '.join(f"{r['ensemble'][k]:.4f}" for k in columns) + ' |')
  return '\n'.join(lines)



SELECT_METHODS = ('top_k', 'greedy')


def check(spec: RunSpec, task: Task, method: Any = None) -> None:
  """One line, before training, for a post-hoc step the config asks for and `task`
  cannot do (tasks.check_steps; with `method`, its collected members too), or an unknown
  select.method."""
  select = spec.select.method
  if select not in SELECT_METHODS:
    raise ConfigError(f'config.select.method={select!r}; use one of {SELECT_METHODS}.')
  check_steps(task, {'eval.temperature_scaling': spec.eval.temperature_scaling,
                     "select.method='greedy'": select == 'greedy',
                     'eval.mc_samples': spec.eval.mc_samples > 0,
                     'eval.metrics': bool(spec.eval.metrics),
                     'ensemble.method': method is not None and method.collects})
