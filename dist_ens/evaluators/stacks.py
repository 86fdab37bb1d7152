"""After the last step of a run of several stacks (member groups, docs/groups.md), each
stack's own ensemble: the test metrics of the ensemble of one stack's non-frozen members,
from the same pass over the test split as the whole ensemble's (SplitPredictions),
written to final_metrics.json under 'groups', as users name them
(posthoc.stack_ensembles, which gives the same of any outputs: the Laplace
predictives')."""

from absl import logging

from dist_ens.training.loop import Call, PeriodicAction
from dist_ens.evaluators import posthoc
from dist_ens.evaluators.evaluator import EvalRun
from dist_ens.evaluators.predictions import SplitPredictions


class StackEnsembles(PeriodicAction):
  """results['groups'][name]: the stack's member ids, model and optim overrides, method
and own (the run's, or the stack's own), and ensemble metrics."""

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
  """[StackEnsembles] where the run joins several stacks: each one's ensemble, from the
  same test pass."""
  return [StackEnsembles(run.predictions)] if run.session.parts.places.joined else []
