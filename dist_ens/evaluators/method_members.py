"""The members a method collects (snapshots, SWAG samples), evaluated as a post-hoc
step beside the trained members (dist_ens.evaluators.posthoc says what the steps share)."""

import numpy as np
from absl import logging

from dist_ens.core.state import member_flags
from dist_ens.ensembles import methods
from dist_ens.eval import evaluate
from dist_ens.evaluators import posthoc
from dist_ens.evaluators.evaluator import EvalRun
from dist_ens.training.loop import Call, PeriodicAction


class MethodEnsemble(posthoc.Posthoc):
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
      outputs = {name: evaluate.split_outputs(step, variables, posthoc.split_data(call, name),
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
                 posthoc.ensembles_table(
                     {'trained members': {'ensemble': session.results['ensemble']},
                      method.name: results}, session.parts.task))


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """MethodEnsemble where the run's method collects members (a BatchEnsemble's members
  are the trained members, evaluated as such)."""
  return [MethodEnsemble(run.outputs)] if run.method.collects else []
