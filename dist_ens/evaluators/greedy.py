"""Greedy ensemble selection as a post-hoc step: Caruana's, by validation NLL, with
replacement or not (config.select.method='greedy'; dist_ens.ensembles.selection), its
test metrics beside all members' and top-k's (dist_ens.evaluators.posthoc says what the
steps share)."""

from typing import Any

import numpy as np
from absl import logging

from dist_ens.ensembles import selection
from dist_ens.errors import ConfigError
from dist_ens.evaluators import posthoc
from dist_ens.evaluators.evaluator import EvalRun
from dist_ens.io import tables
from dist_ens.tasks import Task
from dist_ens.training.loop import Call, PeriodicAction


class GreedySelect(posthoc.Posthoc):
  """Caruana's greedy ensemble selection by validation NLL, with replacement (or, with
  `replacement=False`, of distinct members), of up to `size` picks (0: num_members); its
  test metrics under 'greedy'."""

  def __init__(self, size: int = 0, cache: posthoc.SplitOutputs | None = None, *,
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
    candidates = posthoc.included(call)
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
                 posthoc.ensembles_table(rows, task))


def _picks_text(picks: list[int]) -> str:
  """Greedy selection's picks for the log: the list, or for many picks (a pool of hundreds
  of members) how many of how many distinct members, and the first (final_metrics.json
  keeps them all)."""
  if len(picks) <= tables.MAX_ROWS:
    return str(picks)
  return f'{len(picks):,} of {len(set(picks)):,} distinct members: {tables.short_list(picks)}'


def _prediction(results: dict[str, Any], task: Task) -> dict[str, float]:
  """The ensemble's metrics that describe one predictor (those members are ranked by)."""
  return {k: results['ensemble'][k] for k in task.select_metrics if k in results['ensemble']}


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """GreedySelect where config.select.method='greedy'."""
  select = run.spec.select
  if select.method != 'greedy':
    return []
  return [GreedySelect(select.greedy_size, run.outputs, replacement=select.greedy_replacement)]
