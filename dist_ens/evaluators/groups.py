"""After the last step, each member group's own ensemble (config.ensemble.groups): the
test metrics of the ensemble of one group's non-frozen members, from the same pass over
the test split as the whole ensemble's (SplitPredictions), written to final_metrics.json
under 'groups'; `ensembles` gives the same of any outputs (the Laplace predictives')."""

from typing import Any

import numpy as np
from absl import logging

from dist_ens.training.loop import Call, PeriodicAction
from dist_ens.evaluators.evaluator import EvalRun
from dist_ens.evaluators.predictions import SplitPredictions
from dist_ens.core.state import member_flags


class GroupEnsembles(PeriodicAction):
  """results['groups'][name]: the group's member ids, model and optim overrides, method
and own (config.ensemble's, or the group's own), and ensemble metrics."""

  def __init__(self, predictions: SplitPredictions):
    super().__init__(0, at_end=True)
    self._predictions = predictions

  def run(self, call: Call) -> None:
    session = call.session
    outputs = self._predictions.predict(call, session.run_data.dataset.test).outputs
    out = ensembles(call, outputs)
    for spec, parts in zip(session.spec.groups, session.parts.stacks):
      ids, ensemble = spec.group.ids, out[spec.name]['ensemble']
      out[spec.name] = {'members': out[spec.name]['members'], 'model': spec.model,
                        'optim': spec.optim, 'method': parts.method.name,
                        'own': parts.method.own, 'ensemble': ensemble}
      if ensemble is not None:
        logging.info('group %s (members %d-%d): ensemble %s', spec.name, ids.start,
                     ids.stop - 1, ' '.join(f'{k} {ensemble[k]:.4f}' for k in
                                            ('accuracy', 'rmse', 'nll') if k in ensemble))
    session.results['groups'] = out
    if session.writes_final_events:
      session.write({'step': call.step, 'split': 'test_groups', 'groups': out})


def ensembles(call: Call, outputs: np.ndarray) -> dict[str, Any]:
  """Each member group's name -> its members and the test metrics of the ensemble of its
  non-frozen members' `outputs` ([M, N, ...] in id order); {} without groups."""
  session = call.session
  included = ~np.asarray(member_flags(session.fetch(call.state.frozen)), bool)
  out = {}
  for spec in session.spec.groups:
    ids = spec.group.ids
    out[spec.name] = {'members': list(range(ids.start, ids.stop)), 'ensemble': (
        session.evaluator.scorer.metrics(outputs[ids], session.run_data.dataset.test.y,
                                         included[ids])['ensemble']
        if included[ids].any() else None)}  # every member frozen: no ensemble
  return out


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """[GroupEnsembles] with member groups: each group's ensemble, from the same test pass."""
  return [GroupEnsembles(run.predictions)] if run.spec.groups else []
