"""The ensemble of the k best members by a validation metric (config.select.top_k with
select.method='top_k'), scored on the test split after the last step by the program that
predicts the test split (evaluators/predictions.py), with the chosen members' mask."""

import numpy as np
from absl import logging

from dist_ens.core.state import member_flags
from dist_ens.evaluators.evaluator import EvalRun
from dist_ens.evaluators.predictions import SplitPredictions
from dist_ens.io import tables
from dist_ens.training.loop import Call, PeriodicAction


class SelectTopK(PeriodicAction):
  """After the last step: the test metrics of the ensemble of the k best members, ranked
  by config.select.metric on validation (needs Validate to run first)."""

  def __init__(self, predictions: SplitPredictions):
    super().__init__(0, at_end=True)
    self._predictions = predictions

  def run(self, call: Call) -> None:
    session = call.session
    k, metric = session.spec.select.top_k, session.spec.select.metric
    frozen = set(np.flatnonzero(member_flags(session.fetch(call.state.frozen))).tolist())
    rows = tables.member_rows({**session.results, 'frozen_members': sorted(frozen),
                               'num_members': session.spec.num_members}, session.parts.hparams,
                              session.results.get('validation'), metric,
                              session.parts.task.select_metrics[metric])
    chosen = sorted(r['member'] for r in rows[:k] if not r['frozen'])
    mask = np.zeros(session.spec.num_members, bool)
    mask[chosen] = True
    selected = self._predictions.evaluator(call).predict(
        call.state, session.run_data.dataset.test, member_mask=mask).metrics
    session.results['selected'] = {'top_k': k, 'by': f'validation {metric}', 'members': chosen,
                                   'ensemble': selected['ensemble']}
    ens = selected['ensemble']
    shown = ' '.join(f'{name} {ens[name]:.4f}' for name in session.parts.task.select_metrics
                     if name in ens)  # the task's own: accuracy for classes, rmse for values
    logging.info('ensemble of the %d best members %s by validation %s: test %s', k, chosen,
                 metric, shown)


def select_top_k(run: EvalRun) -> list[PeriodicAction]:
  """[SelectTopK] with select.top_k > 0 and select.method='top_k'."""
  select = run.spec.select
  return [SelectTopK(run.predictions)] if select.top_k and select.method == 'top_k' else []
