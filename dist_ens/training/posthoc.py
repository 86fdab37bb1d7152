"""Post-hoc evaluation actions, run once after the last step (see dist_ens.training.loop).

  McDropout          test metrics with K MC dropout samples per member
                     (config.eval.mc_samples; dist_ens.eval.evaluate)
  TemperatureScale   a temperature per member and one for the ensemble, fitted on
                     the validation split; test metrics before and after
                     (config.eval.temperature_scaling; dist_ens.eval.calibration)
  MethodEnsemble     test metrics of the members config.ensemble.method predicts
                     with (snapshots, SWAG samples; dist_ens.ensembles.methods)
  GreedySelect       Caruana's greedy ensemble selection with replacement by
                     validation NLL, beside SelectTopK (config.select.method='greedy';
                     dist_ens.ensembles.selection)

Each puts its results in ctx.results (so in final_metrics.json), writes an event and
logs a table. `posthoc_actions(config)` builds those the config asks for; from Python:

  dist_ens.train(config, workdir, actions=[posthoc.TemperatureScale(), posthoc.GreedySelect(8)])

They evaluate whole splits to every member's log-probabilities on the host
(evaluate.split_log_probs), computed once per split and shared by the actions built
together.
"""

from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from dist_ens.ensembles import methods, selection
from dist_ens.errors import ConfigError
from dist_ens.eval import calibration, evaluate
from dist_ens.training.loop import Context, PeriodicAction

# Ensemble metrics of a single predictor (the scaled ensemble, a weighted selection);
# disagreement, mutual information etc. describe members and are left out.
_PREDICTION_METRICS = ('accuracy', 'nll', 'brier', 'ece', 'adaptive_ece', 'entropy')


class SplitLogProbs:
  """Every member's log-probabilities [M, N, C] on a split, computed once per step."""

  def __init__(self):
    self._steps: dict[int, Any] = {}
    self._cache: dict[tuple[str, int, int], np.ndarray] = {}

  def get(self, ctx: Context, split: str, mc_samples: int = 0) -> np.ndarray:
    """split: 'validation', 'test' or 'ood'."""
    key = (split, mc_samples, ctx.step)
    if key not in self._cache:
      if mc_samples not in self._steps:
        self._steps[mc_samples] = evaluate.make_log_probs_step(
            ctx.parts.predict_model, ctx.parts.mesh, mc_samples=mc_samples, seed=ctx.config.seed)
      members = ctx.evaluator.view(ctx.state)
      with ctx.off_clock():
        self._cache[key] = evaluate.split_log_probs(
            self._steps[mc_samples], (members.params, members.model_state),
            _split(ctx, split), ctx.config.eval.batch_size, ctx.parts.mesh)
    return self._cache[key]


def _split(ctx: Context, name: str):
  if name == 'test':
    return ctx.run_data.dataset.test
  if name == 'ood':
    return ctx.run_data.ood
  if ctx.run_data.validation is None:
    raise ConfigError('post-hoc calibration and greedy selection fit on the validation split, '
                      'but config.data.validation_size=0; set it > 0 (e.g. 1000).')
  return ctx.run_data.validation


def _included(ctx: Context) -> np.ndarray:
  """[M] bool: the members in the ensemble (not frozen)."""
  return ~np.asarray(ctx.fetch(ctx.state.frozen), bool)


def _prediction(results: dict[str, Any]) -> dict[str, float]:
  return {k: results['ensemble'][k] for k in _PREDICTION_METRICS if k in results['ensemble']}


class _Posthoc(PeriodicAction):
  """An action that runs once after the last step on shared split log-probabilities."""
  needs_validation = True

  def __init__(self, cache: SplitLogProbs | None = None):
    super().__init__(0, at_end=True)
    self.cache = cache or SplitLogProbs()
    self._checked = False

  def on_step(self, ctx: Context) -> None:
    # Fail at the first step, not after training, when there is nothing to fit on.
    if not self._checked and self.needs_validation:
      _split(ctx, 'validation')
    self._checked = True


class McDropout(_Posthoc):
  """Test metrics with `samples` MC dropout samples per member, under 'mc_dropout'
  (and, with config.eval.ood_dataset, OOD AUROC/AUPR under 'mc_dropout.ood').

  The model must sample its dropout when called with train=False and an rng
  (dist_ens.core.model); one that ignores the rng gives the plain metrics, and a
  warning says so.
  """
  needs_validation = False

  def __init__(self, samples: int, cache: SplitLogProbs | None = None):
    if samples < 1:
      raise ConfigError(f'config.eval.mc_samples={samples}: McDropout needs at least 1 sample.')
    super().__init__(cache)
    self.samples = samples

  def run(self, ctx: Context) -> None:
    log_probs = self.cache.get(ctx, 'test', self.samples)
    results = evaluate.metrics_from_log_probs(log_probs, ctx.run_data.dataset.test.y,
                                              _included(ctx))
    plain = self.cache.get(ctx, 'test')
    if np.allclose(log_probs, plain, rtol=1e-5, atol=1e-6):
      logging.warning('MC dropout with %d samples equals plain evaluation: the model has no '
                      'dropout, or ignores rng when train=False (see docs/ensemble_methods.md).',
                      self.samples)
    ctx.results['mc_dropout'] = {'samples': self.samples, **results}
    if ctx.run_data.ood is not None:  # OOD AUROC/AUPR by the MC predictions' uncertainty.
      ctx.results['mc_dropout']['ood'] = {
          'dataset': ctx.config.eval.ood_dataset,
          **evaluate.ood_from_log_probs(log_probs, self.cache.get(ctx, 'ood', self.samples),
                                        _included(ctx))}
    if ctx.writes_final_events:
      ctx.write({'step': ctx.step, 'split': 'test_mc_dropout', **results})
    logging.info('MC dropout (%d samples per member) test metrics:\n%s', self.samples,
                 before_after_table(evaluate.metrics_from_log_probs(
                     plain, ctx.run_data.dataset.test.y, _included(ctx)), results,
                     ('plain', f'MC dropout x{self.samples}')))


class MethodEnsemble(_Posthoc):
  """Test metrics (and OOD AUROC/AUPR) of the members config.ensemble.method predicts
  with (snapshots, SWAG samples; dist_ens.ensembles.methods), under the method's name,
  beside the trained members' own."""
  needs_validation = False

  def run(self, ctx: Context) -> None:
    method = ctx.parts.method
    members = methods.predictive_members(method, ctx.state, ctx.config.seed, ctx.parts.mesh)
    step = evaluate.make_log_probs_step(ctx.parts.predict_model, ctx.parts.mesh)
    variables, included = (members.params, members.model_state), ~np.asarray(
        ctx.fetch(members.frozen), bool)
    with ctx.off_clock():
      log_probs = {name: evaluate.split_log_probs(step, variables, _split(ctx, name),
                                                  ctx.config.eval.batch_size, ctx.parts.mesh)
                   for name in ('test', 'ood') if name == 'test' or ctx.run_data.ood is not None}
    results = evaluate.metrics_from_log_probs(log_probs['test'], ctx.run_data.dataset.test.y,
                                              included)
    ctx.results[method.name] = {'members_per_member': method.per_member,
                                'predicting_members': int(included.sum()), **results}
    if 'ood' in log_probs:
      ctx.results[method.name]['ood'] = {
          'dataset': ctx.config.eval.ood_dataset,
          **evaluate.ood_from_log_probs(log_probs['test'], log_probs['ood'], included)}
    if ctx.writes_final_events:
      ctx.write({'step': ctx.step, 'split': f'test_{method.name}', **results})
    logging.info('%s: %d predicting members (%d per trained member), test metrics:\n%s',
                 method.name, included.sum(), method.per_member,
                 ensembles_table({'trained members': {'ensemble': ctx.results['ensemble']},
                                  method.name: results}))


def before_after_table(before: dict[str, Any], after: dict[str, Any],
                       names: tuple[str, str] = ('before', 'after')) -> str:
  """Member-mean and ensemble metrics of two evaluations as a Markdown table."""
  columns = [k for k in _PREDICTION_METRICS if k in before['ensemble'] and k in after['ensemble']]
  lines = ['| | ' + ' | '.join(columns) + ' |', '|---|' + '---|' * len(columns)]
  for scope in ('members', 'ensemble'):
    for name, res in zip(names, (before, after)):
      if scope not in res:
        continue
      values = [float(np.nanmean(res[scope][k])) for k in columns]
      label = f'{name} member mean' if scope == 'members' else f'{name} ensemble'
      lines.append(f'| {label} | ' + ' | '.join(f'{v:.4f}' for v in values) + ' |')
  return '\n'.join(lines)


def _nll(log_probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """Mean NLL over the examples axis of [..., N, C] normalised log-probabilities."""
  index = np.broadcast_to(labels[:, None], log_probs.shape[:-1] + (1,))
  return -np.take_along_axis(log_probs, index, axis=-1)[..., 0].mean(axis=-1)


def temperature_scaling(val: np.ndarray, val_y: np.ndarray, test: np.ndarray, test_y: np.ndarray,
                        included: np.ndarray) -> dict[str, Any]:
  """Fits member and ensemble temperatures on validation; test metrics before and after.

  Args:
    val, test: [M, N, C] members' log-probabilities on the validation and test splits.
    val_y, test_y: their labels.
    included: [M] bool, members in the ensemble (frozen ones are not).

  Returns:
    {'member_temperatures': [M], 'ensemble_temperature', 'validation_nll': {...},
     'before': {'members', 'ensemble'}, 'after': {'members', 'ensemble'},
     'pooled_scaled_members': the ensemble of the scaled members}, JSON-able.
  """
  member_t = np.asarray(calibration.fit_member_temperatures(val, val_y))
  pooled_val = calibration.pooled_log_probs(val, included)
  ensemble_t = float(calibration.fit_temperature(pooled_val, val_y))
  before = evaluate.metrics_from_log_probs(test, test_y, included)
  scaled_members = evaluate.metrics_from_log_probs(calibration.scale(test, member_t), test_y,
                                                   included)
  scaled_pool = calibration.scale(calibration.pooled_log_probs(test, included)[None], ensemble_t)
  scaled_ensemble = evaluate.metrics_from_log_probs(scaled_pool, test_y)
  val_nll = {
      'members_before': _nll(val, val_y).tolist(),
      'members_after': _nll(calibration.scale(val, member_t), val_y).tolist(),
      'ensemble_before': float(_nll(pooled_val, val_y)),
      'ensemble_after': float(_nll(calibration.scale(pooled_val, ensemble_t), val_y))}
  return {'fit_on': 'validation', 'member_temperatures': member_t.tolist(),
          'ensemble_temperature': ensemble_t, 'validation_nll': val_nll,
          'before': {'members': before['members'], 'ensemble': _prediction(before)},
          'after': {'members': scaled_members['members'], 'ensemble': _prediction(scaled_ensemble)},
          'pooled_scaled_members': _prediction(scaled_members)}


class TemperatureScale(_Posthoc):
  """A temperature per member and one for the ensemble (on the pooled probabilities),
  fitted on the validation split; test metrics before and after, under
  'temperature_scaling' (see temperature_scaling)."""

  def run(self, ctx: Context) -> None:
    val_y, test_y = ctx.run_data.validation.y, ctx.run_data.dataset.test.y
    out = temperature_scaling(self.cache.get(ctx, 'validation'), val_y,
                              self.cache.get(ctx, 'test'), test_y, _included(ctx))
    ctx.results['temperature_scaling'] = out
    if ctx.writes_final_events:
      ctx.write({'step': ctx.step, 'split': 'test_temperature_scaled', **out['after']})
    logging.info('temperature scaling fitted on validation: ensemble T %.3f, member T %s; '
                 'test metrics:\n%s', out['ensemble_temperature'],
                 np.round(out['member_temperatures'], 3).tolist(),
                 before_after_table(out['before'], out['after']))


class GreedySelect(_Posthoc):
  """Caruana's greedy ensemble selection by validation NLL, with replacement, of up to
  `size` picks (0: num_members); its test metrics under 'greedy'."""

  def __init__(self, size: int = 0, cache: SplitLogProbs | None = None):
    if size < 0:
      raise ConfigError(f'config.select.greedy_size={size} must be >= 0 (0: num_members).')
    super().__init__(cache)
    self.size = size

  def run(self, ctx: Context) -> None:
    size = self.size or ctx.config.num_members
    val, test = self.cache.get(ctx, 'validation'), self.cache.get(ctx, 'test')
    val_y, test_y = ctx.run_data.validation.y, ctx.run_data.dataset.test.y
    included = _included(ctx)
    chosen = selection.greedy_select(val, val_y, size, candidates=included)
    greedy = evaluate.metrics_from_log_probs(test[chosen.picks], test_y)
    every = evaluate.metrics_from_log_probs(test, test_y, included)
    ctx.results['greedy'] = {
        'by': 'validation nll', 'max_size': size, 'picks': chosen.picks,
        'members': sorted(set(chosen.picks)), 'counts': chosen.counts.tolist(),
        'validation_nll': chosen.nll, 'validation_nll_by_size': chosen.nll_by_size,
        'validation_nll_all_members': float(_nll(calibration.pooled_log_probs(val, included),
                                                 val_y)),
        'ensemble': _prediction(greedy)}
    if ctx.writes_final_events:
      ctx.write({'step': ctx.step, 'split': 'test_greedy', 'ensemble': _prediction(greedy)})
    rows = {'all members': every, 'greedy': greedy}
    if 'selected' in ctx.results:
      rows[f"top-{ctx.results['selected']['top_k']}"] = ctx.results['selected']
    logging.info('greedy selection (picks %s, validation NLL %.4f; all members %.4f):\n%s',
                 chosen.picks, chosen.nll, ctx.results['greedy']['validation_nll_all_members'],
                 ensembles_table(rows))


def ensembles_table(rows: dict[str, dict[str, Any]]) -> str:
  """Test metrics of several ensembles ({name: {'ensemble': {...}}}) as a Markdown table."""
  columns = [k for k in _PREDICTION_METRICS if all(k in r['ensemble'] for r in rows.values())]
  lines = ['| ensemble | ' + ' | '.join(columns) + ' |', '|---|' + '---|' * len(columns)]
  for name, r in rows.items():
    lines.append(f'| {name} | ' + ' | '.join(f"{r['ensemble'][k]:.4f}" for k in columns) + ' |')
  return '\n'.join(lines)


SELECT_METHODS = ('top_k', 'greedy')


def posthoc_actions(config: ml_collections.ConfigDict) -> list[PeriodicAction]:
  """The post-hoc actions config asks for (config.eval.mc_samples,
  config.eval.temperature_scaling, config.select.method='greedy'), sharing their
  split log-probabilities."""
  cache, out = SplitLogProbs(), []
  # Snapshots and SWAG samples predict beside the trained members; a BatchEnsemble's
  # members are the trained members (evaluated as such).
  if config.ensemble.method in methods.COLLECTING:
    out.append(MethodEnsemble(cache))
  method = config.select.method
  if method not in SELECT_METHODS:
    raise ConfigError(f'config.select.method={method!r}; use one of {SELECT_METHODS}.')
  if config.eval.mc_samples:
    out.append(McDropout(config.eval.mc_samples, cache))
  if config.eval.temperature_scaling:
    out.append(TemperatureScale(cache))
  if method == 'greedy':
    out.append(GreedySelect(config.select.greedy_size, cache))
  return out
