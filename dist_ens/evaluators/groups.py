"""After the last step, each member group's own ensemble (config.ensemble.groups): the
test metrics of the ensemble of one group's non-frozen members, from the same pass over
the test split as the whole ensemble's (SplitPredictions), written to final_metrics.json
under 'groups' (posthoc.stack_ensembles, which gives the same of any outputs: the
Laplace predictives')."""

from absl import logging

from dist_ens.training.loop import Call, PeriodicAction
from dist_ens.evaluators import posthoc
from dist_ens.evaluators.evaluator import EvalRun
from dist_ens.evaluators.predictions import SplitPredictions


class GroupEnsembles(PeriodicAction):
  """results['groups'][name]: the group's member ids, model and optim overrides, method
and own (config.ensemble's, or the group's own), and ensemble metrics."""

  def __init__(self, predictions: SplitPredictions):
    super().__init__(0, at_end=True)
    self._predictions = predictions

  def run(self, call: Call) -> None:
    session = call.session
    outputs = self._predictions.predict(call, session.run_data.dataset.test).outputs
    out = posthoc.stack_ensembles(call, outputs)
    for stack, place in zip(session.parts.stacks, session.parts.places):
      name, ensemble = stack.stack.name, out[stack.stack.name]['ensemble']
      out[name] = {'members': out[name]['members'], **stack.stack.overrides,
                   'method': stack.method.name, 'own': stack.method.own, 'ensemble': ensemble}
      if ensemble is not None:
        logging.info('group %s (members %d-%d): ensemble %s', name, place.first,
                     place.first + place.count - 1, ' '.join(
                         f'{k} {ensemble[k]:.4f}' for k in ('accuracy', 'rmse', 'nll')
                         if k in ensemble))
    session.results['groups'] = out
    if session.writes_final_events:
      session.write({'step': call.step, 'split': 'test_groups', 'groups': out})


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """[GroupEnsembles] with member groups: each group's ensemble, from the same test pass."""
  return [GroupEnsembles(run.predictions)] if run.session.parts.places.joined else []
