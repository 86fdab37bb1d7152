"""Post-hoc evaluation actions, run once after the last step (see dist_ens.training.loop).

  McDropout          test metrics with K MC dropout samples per member
                     (config.eval.mc_samples; dist_ens.eval.evaluate)
  TemperatureScale   the task's recalibration fitted on the validation split
                     (config.eval.temperature_scaling; classification's Task.calibrate is
                     temperature scaling, dist_ens.tasks.temperature); test metrics before
                     and after
  MethodEnsemble     test metrics of the members config.ensemble.method predicts
                     with (snapshots, SWAG samples; dist_ens.ensembles.methods)
  GreedySelect       Caruana's greedy ensemble selection (with replacement or not) by
                     validation NLL, beside SelectTopK (config.select.method='greedy';
                     dist_ens.ensembles.selection)

Each puts its results in call.session.results (so in final_metrics.json), writes an event and
logs a table. `posthoc_actions(run_spec, task, method)` builds those the config asks for
(the 'posthoc' evaluator, dist_ens.evaluators.registry); from Python:

  dist_ens.train(config, workdir, actions=[posthoc.TemperatureScale(), posthoc.GreedySelect(8)])

They evaluate whole splits to every member's outputs on the host
(evaluate.split_outputs), computed once per split and shared by the actions built
together, and score them with the task's metrics (call.session.evaluator.scorer): nothing here
knows what the outputs mean.
"""

from typing import Any

import numpy as np
from absl import logging

from dist_ens.config.specs import RunSpec
from dist_ens.ensembles import methods, selection
from dist_ens.errors import ConfigError
from dist_ens.eval import evaluate
from dist_ens.io import tables
from dist_ens.tasks import Task, check_steps
from dist_ens.training.loop import Call, PeriodicAction
from dist_ens.evaluators.evaluator import EvalRun
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
      return self._predictions.predict(call, _split(call, split)).outputs
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
            _split(call, split), session.spec.eval.batch_size, session.parts.mesh)
    return self._cache[key]


def _split(call: Call, name: str):
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


def _prediction(results: dict[str, Any], task: Task) -> dict[str, float]:
  """The ensemble's metrics that describe one predictor (those members are ranked by)."""
  return {k: results['ensemble'][k] for k in task.select_metrics if k in results['ensemble']}


class _Posthoc(PeriodicAction):
  """An action that runs once after the last step on shared split log-probabilities."""
  needs_validation = True

  def __init__(self, cache: SplitOutputs | None = None):
    super().__init__(0, at_end=True)
    self.cache = cache or SplitOutputs()
    self._checked = False

  def on_step(self, call: Call) -> None:
    # Fail at the first step, not after training, when there is nothing to fit on.
    if not self._checked and self.needs_validation:
      _split(call, 'validation')
    self._checked = True


class McDropout(_Posthoc):
  """Test metrics with `samples` MC dropout samples per member, under 'mc_dropout'
  (and, with config.eval.ood_dataset, OOD AUROC/AUPR under 'mc_dropout.ood').

  The model must sample its dropout when called with train=False and an rng
  (dist_ens.core.model); one that ignores the rng gives the plain metrics, and a
  warning says so.
  """
  needs_validation = False

  def __init__(self, samples: int, cache: SplitOutputs | None = None):
    if samples < 1:
      raise ConfigError(f'config.eval.mc_samples={samples}: McDropout needs at least 1 sample.')
    super().__init__(cache)
    self.samples = samples

  def run(self, call: Call) -> None:
    session = call.session
    scorer, test = session.evaluator.scorer, session.run_data.dataset.test
    outputs = self.cache.get(call, 'test', self.samples)
    results = scorer.metrics(outputs, test.y, included(call))
    plain = scorer.metrics(self.cache.get(call, 'test'), test.y, included(call))
    if _same(results, plain):
      logging.warning('MC dropout with %d samples equals plain evaluation: the model has no '
                      'dropout, or ignores rng when train=False (see docs/ensemble_methods.md).',
                      self.samples)
    session.results['mc_dropout'] = {'samples': self.samples, **results}
    if session.run_data.ood is not None:  # OOD AUROC/AUPR by the MC predictions' uncertainty.
      session.results['mc_dropout']['ood'] = {
          'dataset': session.spec.eval.ood_dataset,
          **scorer.ood(outputs, self.cache.get(call, 'ood', self.samples), test.y,
                       included(call))}
    if session.writes_final_events:
      session.write({'step': call.step, 'split': 'test_mc_dropout', **results})
    logging.info('MC dropout (%d samples per member) test metrics:\n%s', self.samples,
                 before_after_table(plain, results, session.parts.task,
                                    ('plain', f'MC dropout x{self.samples}')))


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
  """Whether two evaluations' ensemble metrics agree to rounding."""
  keys = [k for k, v in a['ensemble'].items() if isinstance(v, float)]
  return all(np.isclose(a['ensemble'][k], b['ensemble'][k], rtol=1e-5, atol=1e-6) for k in keys)


class MethodEnsemble(_Posthoc):
  """Test metrics (and OOD AUROC/AUPR) of the members config.ensemble.method predicts
  with (snapshots, SWAG samples; dist_ens.ensembles.methods), under the method's name,
  beside the trained members' own."""
  needs_validation = False

  def run(self, call: Call) -> None:
    session = call.session
    method, scorer, mesh = session.parts.method, session.evaluator.scorer, session.parts.mesh
    test = session.run_data.dataset.test
    members = methods.predictive_members(method, call.state, session.spec.seed, mesh)
    step = evaluate.make_outputs_step(session.parts.predict_model, mesh)
    variables, included = (members.params, members.model_state), ~np.asarray(
        member_flags(session.fetch(members.frozen)), bool)
    with session.off_clock():
      outputs = {name: evaluate.split_outputs(step, variables, _split(call, name),
                                              session.spec.eval.batch_size, session.parts.mesh)
                 for name in ('test', 'ood') if name == 'test' or session.run_data.ood is not None}
    results = scorer.metrics(outputs['test'], test.y, included)
    session.results[method.name] = {'members_per_member': method.per_member,
                                    'predicting_members': int(included.sum()), **results}
    if 'ood' in outputs:
      session.results[method.name]['ood'] = {
          'dataset': session.spec.eval.ood_dataset,
          **scorer.ood(outputs['test'], outputs['ood'], test.y, included)}
    if session.writes_final_events:
      session.write({'step': call.step, 'split': f'test_{method.name}', **results})
    logging.info('%s: %d predicting members (%d per trained member), test metrics:\n%s',
                 method.name, included.sum(), method.per_member,
                 ensembles_table({'trained members': {'ensemble': session.results['ensemble']},
                                  method.name: results}, session.parts.task))


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


class TemperatureScale(_Posthoc):
  """The task's recalibration (Task.calibrate: classification's temperature scaling, a
  temperature per member and one for the ensemble), fitted on the validation split; test
  metrics before and after, under 'temperature_scaling'."""

  def run(self, call: Call) -> None:
    session = call.session
    val_y, test_y = session.run_data.validation.y, session.run_data.dataset.test.y
    out = session.parts.task.calibrate(session.evaluator.scorer, self.cache.get(call, 'validation'),
                                       val_y, self.cache.get(call, 'test'), test_y, included(call))
    session.results['temperature_scaling'] = out
    if session.writes_final_events:
      session.write({'step': call.step, 'split': 'test_temperature_scaled', **out['after']})
    logging.info('temperature scaling fitted on validation: ensemble T %.3f, member T %s; '
                 'test metrics:\n%s', out['ensemble_temperature'],
                 tables.spread_text(out['member_temperatures']),
                 before_after_table(out['before'], out['after'], session.parts.task))


class GreedySelect(_Posthoc):
  """Caruana's greedy ensemble selection by validation NLL, with replacement (or, with
  `replacement=False`, of distinct members), of up to `size` picks (0: num_members); its
  test metrics under 'greedy'."""

  def __init__(self, size: int = 0, cache: SplitOutputs | None = None, *,
               replacement: bool = True):
    if size < 0:
      raise ConfigError(f'config.select.greedy_size={size} must be >= 0 (0: num_members).')
    super().__init__(cache)
    self.size, self.replacement = size, replacement

  def run(self, call: Call) -> None:
    session = call.session
    task, scorer = session.parts.task, session.evaluator.scorer
    size = self.size or session.spec.num_members
    val, test = self.cache.get(call, 'validation'), self.cache.get(call, 'test')
    val_y, test_y = session.run_data.validation.y, session.run_data.dataset.test.y
    candidates = included(call)
    log_likelihood = np.asarray(task.log_likelihood(val, val_y), np.float64)  # [M, N]
    chosen = selection.greedy_select(log_likelihood, size, candidates=candidates,
                                     replacement=self.replacement)
    greedy = scorer.metrics(test[chosen.picks], test_y)
    every = scorer.metrics(test, test_y, candidates)
    pooled = np.logaddexp.reduce(log_likelihood[candidates], axis=0) - np.log(candidates.sum())
    session.results['greedy'] = {
        'by': 'validation nll', 'max_size': size, 'replacement': self.replacement,
        'picks': chosen.picks,
        'members': sorted(set(chosen.picks)), 'counts': chosen.counts.tolist(),
        'validation_nll': chosen.nll, 'validation_nll_by_size': chosen.nll_by_size,
        'validation_nll_all_members': float(-pooled.mean()),
        'ensemble': _prediction(greedy, task)}
    if session.writes_final_events:
      session.write({'step': call.step, 'split': 'test_greedy',
                     'ensemble': _prediction(greedy, task)})
    rows = {'all members': every, 'greedy': greedy}
    if 'selected' in session.results:
      rows[f"top-{session.results['selected']['top_k']}"] = session.results['selected']
    logging.info('greedy selection%s (picks %s, validation NLL %.4f; all members %.4f):\n%s',
                 '' if self.replacement else ' without replacement',
                 _picks_text(chosen.picks), chosen.nll,
                 session.results['greedy']['validation_nll_all_members'],
                 ensembles_table(rows, task))


def _picks_text(picks: list[int]) -> str:
  """Greedy selection's picks for the log: the list, or for many picks (a pool of hundreds
  of members) how many of how many distinct members, and the first (final_metrics.json
  keeps them all)."""
  if len(picks) <= tables.MAX_ROWS:
    return str(picks)
  return f'{len(picks):,} of {len(set(picks)):,} distinct members: {tables.short_list(picks)}'


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


def posthoc_actions(spec: RunSpec, task: Task, method: Any,
                    cache: SplitOutputs | None = None) -> list[PeriodicAction]:
  """The post-hoc actions the run asks for (config.eval.mc_samples,
  config.eval.temperature_scaling, config.select.method='greedy', and the members
  `method` collects), sharing their split outputs (`cache`, or their own)."""
  check(spec, task, method)
  cache, out = cache or SplitOutputs(), []
  # Snapshots and SWAG samples predict beside the trained members; a BatchEnsemble's
  # members are the trained members (evaluated as such).
  if method.collects:
    out.append(MethodEnsemble(cache))
  if spec.eval.mc_samples:
    out.append(McDropout(spec.eval.mc_samples, cache))
  if spec.eval.temperature_scaling:
    out.append(TemperatureScale(cache))
  if spec.select.method == 'greedy':
    out.append(GreedySelect(spec.select.greedy_size, cache,
                            replacement=spec.select.greedy_replacement))
  return out


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """The post-hoc steps the run asks for (posthoc_actions), sharing run.outputs."""
  return posthoc_actions(run.spec, run.task, run.method, run.outputs)
