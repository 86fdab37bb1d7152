"""After the last step: selective prediction, conformal sets and the shift evaluation.

  EvaluateDecisions   on the clean test split: AURC per score and accuracy at 90/95/99 %
                      coverage (classification; 'aurc', 'selective'); with a validation
                      split, conformal sets / intervals at eval.conformal_alpha
                      ('conformal'); with eval.shift, all of it and the task's metrics
                      per corruption and severity (corrupted on device, or prepared
                      TFDS configs), their means and, with eval.shift_baseline, mCE
                      ('shift').

One compiled program serves the validation, test and every corrupted test split
(dist_ens.eval.shift.make_predict_step); the host work is dist_ens.eval.decisions.
"""

from typing import Any

import numpy as np
from absl import logging

from dist_ens.data import Split, corruptions, tfds_corrupted
from dist_ens.eval import decisions, mce, shift_spec
from dist_ens.training.loop import Call, PeriodicAction
from dist_ens.evaluators.evaluator import EvalRun
from dist_ens.evaluators.predictions import SplitPredictions
from dist_ens.core.state import member_flags


def _seed(seed: int, tag: int) -> int:
  """An independent seed for APS's randomisation on one split (tag: which split)."""
  return int(np.random.SeedSequence([seed, tag]).generate_state(1)[0])


class EvaluateDecisions(PeriodicAction):
  """See the module docstring; results under 'aurc', 'selective', 'conformal', 'shift'."""

  def __init__(self, predictions: SplitPredictions | None = None):
    """`predictions` is shared with the final evaluations (metrics.Evaluate, Validate):
    the clean test and validation splits are then predicted once for all of them."""
    super().__init__(0, at_end=True)
    self._predictions = predictions or SplitPredictions()

  def run(self, call: Call) -> None:
    session = call.session
    spec, run_data = session.spec, session.run_data
    sets = shift_spec.shift_sets(spec.eval.shift, run_data.dataset.test.x.shape[1:], spec.data)
    if not sets and run_data.validation is None and session.parts.task.predict is not None:
      return  # a regression run without shift or validation: nothing to report
    mask = ~np.asarray(member_flags(session.fetch(session.evaluator.view(call.state).frozen)), bool)
    if not mask.any():
      return  # every member diverged: no ensemble to decide with (the trainer says so)
    fit, test = None, run_data.dataset.test
    with session.off_clock():
      if run_data.validation is not None and session.parts.task.conformal:
        val = self._predictions.predict(call, run_data.validation)
        fit = decisions.fit_conformal(val.outputs, run_data.validation.y, mask,
                                      spec.eval.conformal_alpha, _seed(spec.seed, 0),
                                      session.parts.task.predict)
      clean = self._results(call, test, (0, 0), fit, mask, tag=1)
      shifted = {(s.corruption, s.severity): self._results(
                     call, *self._shifted(call, s), fit, mask, tag=2 + i)
                 for i, s in enumerate(sets)}
    self._report(call, clean, fit, shifted, mask)

  def _shifted(self, call: Call, shifted: shift_spec.ShiftSet
               ) -> tuple[Split, tuple[int, int]]:
    """(split, (corruption id, severity)) to predict: the test split with a corruption
    applied on device, or a prepared TFDS config's test split as it is."""
    session = call.session
    if not shifted.tfds_config:
      ids = corruptions.corruption_id(shifted.corruption), shifted.severity
      return session.run_data.dataset.test, ids
    split = tfds_corrupted.load_test(shifted.tfds_config, session.spec.data)
    scale = session.run_data.scale
    if scale is not None:  # the inputs in the units the task standardised its own to
      split = Split(((split.x - scale.x_mean) / scale.x_std).astype(np.float32), split.y)
    return split, (0, 0)

  def _results(self, call: Call, split: Split, shift: tuple[int, int],
               fit: decisions.ConformalFit | None, mask: np.ndarray, tag: int) -> dict[str, Any]:
    """The task's metrics of `split` under shift = (corruption id, severity), its
    selective prediction (classification) and conformal coverage (when fitted)."""
    session = call.session
    out = self._predictions.predict(call, split, *shift)
    found = {'members': out.metrics['members'], 'ensemble': out.metrics['ensemble']}
    if (chosen := decisions.selective_report(out.examples)) is not None:
      found['selective'] = chosen
    if fit is not None:
      scale = session.run_data.scale
      found['conformal'] = decisions.conformal_report(
          fit, out.outputs, split.y, mask, _seed(session.spec.seed, tag),
          session.parts.task.predict, 1.0 if scale is None else scale.y_std)
    return found

  def _report(self, call: Call, clean: dict[str, Any], fit: decisions.ConformalFit | None,
              shifted: dict[tuple[str, int], dict[str, Any]], mask: np.ndarray) -> None:
    """Puts the results in call.session.results (final_metrics.json), writes an event, logs."""
    session = call.session
    if 'selective' in clean:
      selective = clean['selective']
      session.results['aurc'] = selective['aurc']
      session.results['selective'] = {k: v for k, v in selective.items() if k != 'aurc'}
      logging.info('selective prediction: AURC %s; accuracy at 90/95/99%% coverage by '
                   'confidence %s', _rounded(selective['aurc']),
                   _rounded(selective['accuracy_at_coverage']['confidence']))
    if fit is not None:
      session.results['conformal'] = {**fit._asdict(), **clean['conformal']}
      logging.info('conformal (%s, alpha %g, calibrated on %d validation examples): test %s',
                   fit.method, fit.alpha, fit.calibration_size, _rounded(clean['conformal']))
    if not shifted:
      return
    summary = {'spec': session.spec.eval.shift, 'seed': session.spec.seed,
               **decisions.shift_summary(shifted)}
    frame = self._predictions.frame
    if frame is not None:  # corrupted on device, in this range
      summary['value_range'] = list(frame.value_range)
    baseline = mce.load_baseline(session.spec.eval.shift_baseline, list(shifted))
    if baseline is not None:
      summary.update(mce.mce_report(baseline, shifted, clean, mask))
    session.results['shift'] = summary
    mean = summary['mean']
    if session.writes_final_events:
      session.write({'step': call.step, 'split': 'test_shift', 'ensemble': _flat(mean['ensemble']),
                     'members': _flat(mean['members'])})
    means = {k: summary[k] for k in decisions.SHIFT_MEANS if k in summary}
    means.update({f'mCE_{k}': v for k, v in summary.get('mCE', {}).items() if k != 'members'})
    logging.info('shift (%d corruption x severity pairs): %s; clean ensemble accuracy %.4f',
                 summary['pairs'], _rounded(means), clean['ensemble'].get('accuracy', float('nan')))


def _flat(metrics: dict[str, Any]) -> dict[str, Any]:
  """The entries of a metrics dict that are numbers or lists of numbers (for events)."""
  return {k: v for k, v in metrics.items() if not isinstance(v, dict)}


def _rounded(values: dict[str, float]) -> dict[str, float]:
  return {k: round(v, 4) for k, v in values.items()}


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """[EvaluateDecisions]: selective prediction, conformal sets and eval.shift."""
  return [EvaluateDecisions(run.predictions)]
