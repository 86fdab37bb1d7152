"""Temperature scaling as a post-hoc step: the task's recalibration fitted on the
validation split (config.eval.temperature_scaling), test metrics before and after
(dist_ens.evaluators.posthoc says what the steps share)."""

from absl import logging

from dist_ens.evaluators import posthoc
from dist_ens.evaluators.evaluator import EvalRun
from dist_ens.io import tables
from dist_ens.training.loop import Call, PeriodicAction


class TemperatureScale(posthoc.Posthoc):
  """The task's recalibration (Task.calibrate: classification's temperature scaling, a
  temperature per member and one for the ensemble), fitted on the validation split; test
  metrics before and after, under 'temperature_scaling'."""

  def run(self, call: Call) -> None:
    session = call.session
    val_y, test_y = session.run_data.validation.y, session.run_data.dataset.test.y
    out = session.parts.task.calibrate(
        session.evaluator.scorer, self.cache.get(call, 'validation'), val_y,
        self.cache.get(call, 'test'), test_y, posthoc.included(call))
    session.results['temperature_scaling'] = out
    if session.writes_final_events:
      session.write({'step': call.step, 'split': 'test_temperature_scaled', **out['after']})
    logging.info('temperature scaling fitted on validation: ensemble T %.3f, member T %s; '
                 'test metrics:\n%s', out['ensemble_temperature'],
                 tables.spread_text(out['member_temperatures']),
                 posthoc.before_after_table(out['before'], out['after'], session.parts.task))


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """TemperatureScale where config.eval.temperature_scaling."""
  return [TemperatureScale(run.outputs)] if run.spec.eval.temperature_scaling else []
