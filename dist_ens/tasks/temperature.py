"""Temperature scaling, classification's recalibration after training (Task.calibrate;
config.eval.temperature_scaling): a temperature per member and one for the ensemble (on
its pooled probabilities), fitted on validation (Guo et al. 2017; Ashukha et al. 2020);
test metrics before and after. dist_ens.eval.calibration fits and applies them."""

from typing import Any

import numpy as np

from dist_ens.eval import calibration

# Ensemble metrics of a single predictor (the scaled ensemble); disagreement, mutual
# information etc. describe members and are left out.
PREDICTION_METRICS = ('accuracy', 'nll', 'brier', 'ece', 'adaptive_ece', 'entropy')


def prediction(results: dict[str, Any]) -> dict[str, float]:
  """The ensemble metrics of `results` that describe one predictor."""
  return {k: results['ensemble'][k] for k in PREDICTION_METRICS if k in results['ensemble']}


def _nll(log_probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """Mean NLL over the examples axis of [..., N, C] normalised log-probabilities."""
  index = np.broadcast_to(labels[:, None], log_probs.shape[:-1] + (1,))
  return -np.take_along_axis(log_probs, index, axis=-1)[..., 0].mean(axis=-1)


def temperature_scaling(scorer: Any, val: np.ndarray, val_y: np.ndarray, test: np.ndarray,
                        test_y: np.ndarray, included: np.ndarray) -> dict[str, Any]:
  """Fits member and ensemble temperatures on validation; test metrics before and after.

  Args:
    scorer: the run's dist_ens.eval.evaluate.Scorer (classification's metrics).
    val, test: [M, N, C] members' logits (or log-probabilities) on validation and test.
    val_y, test_y: their labels.
    included: [M] bool, members in the ensemble (frozen ones are not).

  Returns:
    {'member_temperatures': [M], 'ensemble_temperature', 'validation_nll': {...},
     'before': {'members', 'ensemble'}, 'after': {'members', 'ensemble'},
     'pooled_scaled_members': the ensemble of the scaled members}, JSON-able.
  """
  val, test = calibration.normalised(val), calibration.normalised(test)
  member_t = np.asarray(calibration.fit_member_temperatures(val, val_y))
  pooled_val = calibration.pooled_log_probs(val, included)
  ensemble_t = float(calibration.fit_temperature(pooled_val, val_y))
  before = scorer.metrics(test, test_y, included)
  scaled_members = scorer.metrics(calibration.scale(test, member_t), test_y, included)
  scaled_pool = calibration.scale(calibration.pooled_log_probs(test, included)[None], ensemble_t)
  scaled_ensemble = scorer.metrics(scaled_pool, test_y)
  val_nll = {
      'members_before': _nll(val, val_y).tolist(),
      'members_after': _nll(calibration.scale(val, member_t), val_y).tolist(),
      'ensemble_before': float(_nll(pooled_val, val_y)),
      'ensemble_after': float(_nll(calibration.scale(pooled_val, ensemble_t), val_y))}
  return {'fit_on': 'validation', 'member_temperatures': member_t.tolist(),
          'ensemble_temperature': ensemble_t, 'validation_nll': val_nll,
          'before': {'members': before['members'], 'ensemble': prediction(before)},
          'after': {'members': scaled_members['members'], 'ensemble': prediction(scaled_ensemble)},
          'pooled_scaled_members': prediction(scaled_members)}
