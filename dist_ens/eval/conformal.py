"""Split conformal prediction after training, calibrated on the validation split (host).

Calibrate on n held-out examples that training never saw, then the sets (or
intervals) cover the label of a new exchangeable example with probability at least
1 - alpha, whatever the model (Vovk et al.; Lei et al., 2018). The calibration
threshold is the finite-sample quantile of the n calibration scores:
  q = the ceil((n + 1)(1 - alpha))-th smallest score   (the ceil((n+1)(1-alpha))/n
      empirical quantile), and q = inf when that rank exceeds n (too few
      calibration examples for this alpha: every set is every class).

Classification: APS, Adaptive Prediction Sets (Romano, Sesia and Candes, 2020), with
RAPS's regulariser (Angelopoulos et al., 2021) available as `lam`, `k_reg`. APS is
the default because its only parameter is alpha and its sets adapt to each
example's difficulty (they are the smallest prefix of the classes sorted by
probability whose mass reaches the threshold); RAPS shrinks the sets of
overconfident-tail models, but its lam and k_reg must be tuned on a further split.
A class's score is the probability mass of the classes ranked above it plus u times
its own (plus lam * max(0, rank - k_reg), rank 1-based), sorting by probability with
ties to the lower class index.
  randomized=True  u ~ U(0, 1) per example: coverage 1 - alpha up to 1 / (n + 1),
                   the smallest sets; sets can be empty. Deterministic given `seed`;
                   use different seeds for the calibration and the test examples.
  randomized=False u = 1: coverage at least 1 - alpha (conservative), larger sets,
                   no randomness at all.

Regression: conformalised absolute residuals |y - mean(x)|, by default plain
(intervals mean +- q, one width for all); pass the ensemble's predicted std to
normalise them, |y - mean| / std, for intervals mean +- q * std that are wider where
the ensemble is unsure (Lei et al., 2018, section 5.2).

Example:
  >>> q = aps_threshold(probs_val, labels_val, alpha=0.1, seed=0)
  >>> sets = aps_sets(probs_test, q, seed=1)                  # [N, C] bool
  >>> coverage, size = set_coverage_and_size(sets, labels_test)
"""

import math

import numpy as np


def conformal_quantile(scores: np.ndarray, alpha: float) -> float:
  """The ceil((n + 1)(1 - alpha))-th smallest of n scores, or inf if that exceeds n.

  Args:
    scores: [n] calibration scores (higher = worse fit).
    alpha: the miscoverage level in (0, 1).
  """
  scores = np.asarray(scores, np.float64).reshape(-1)
  if not 0 < alpha < 1:
    raise ValueError(f'alpha must be in (0, 1); got {alpha}.')
  if not len(scores) or not np.all(np.isfinite(scores)):
    raise ValueError('conformal calibration needs a non-empty set of finite scores.')
  # The epsilon keeps (n + 1)(1 - alpha) = 900.0000000001 from asking for rank 901.
  rank = math.ceil((len(scores) + 1) * (1 - alpha) - 1e-9)
  return math.inf if rank > len(scores) else float(np.sort(scores)[rank - 1])


def _class_scores(probs: np.ndarray, randomized: bool, seed: int, lam: float,
                  k_reg: int) -> np.ndarray:
  """[N, C] the APS / RAPS score each class would have if it were the label."""
  probs = np.asarray(probs, np.float64)
  if probs.ndim != 2:
    raise ValueError(f'probs must be [N, C]; got shape {probs.shape}.')
  n, c = probs.shape
  order = np.argsort(-probs, axis=1, kind='stable')  # ties: the lower class first
  ranked = np.take_along_axis(probs, order, axis=1)
  above = np.cumsum(ranked, axis=1) - ranked  # mass of the classes ranked higher
  u = np.random.default_rng(seed).random((n, 1)) if randomized else np.ones((n, 1))
  penalty = lam * np.maximum(0, np.arange(1, c + 1) - k_reg)
  scores = np.empty_like(probs)
  np.put_along_axis(scores, order, above + u * ranked + penalty, axis=1)
  return scores


def aps_scores(probs: np.ndarray, labels: np.ndarray, randomized: bool = True, seed: int = 0,
               lam: float = 0.0, k_reg: int = 0) -> np.ndarray:
  """[N] APS (RAPS if lam > 0) conformity scores of the true labels (module docstring)."""
  scores = _class_scores(probs, randomized, seed, lam, k_reg)
  return np.take_along_axis(scores, np.asarray(labels).reshape(-1, 1), axis=1)[:, 0]


def aps_threshold(probs_cal: np.ndarray, labels_cal: np.ndarray, alpha: float,
                  randomized: bool = True, seed: int = 0, lam: float = 0.0,
                  k_reg: int = 0) -> float:
  """The APS threshold calibrated on held-out examples.

  Args:
    probs_cal: [n, C] predicted probabilities of the calibration (validation) split.
    labels_cal: [n] its integer labels.
    alpha: target miscoverage: sets should hold the label 1 - alpha of the time.
    randomized: u ~ U(0, 1) (exact coverage) or u = 1 (conservative).
    seed: the seed of u (ignored when not randomized).
    lam, k_reg: RAPS's regulariser (lam = 0: plain APS).

  Returns:
    q, to be passed to aps_sets with the same randomized, lam and k_reg.
  """
  return conformal_quantile(aps_scores(probs_cal, labels_cal, randomized, seed, lam, k_reg),
                            alpha)


def aps_sets(probs: np.ndarray, threshold: float, randomized: bool = True, seed: int = 1,
             lam: float = 0.0, k_reg: int = 0) -> np.ndarray:
  """[N, C] bool prediction sets: the classes whose score is at most the threshold.

  Use the calibration's randomized, lam and k_reg, and a seed other than its seed.
  """
  return _class_scores(probs, randomized, seed, lam, k_reg) <= threshold


def set_coverage_and_size(sets: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
  """(fraction of examples whose set holds the label, mean set size) of [N, C] sets."""
  sets = np.asarray(sets, bool)
  hit = np.take_along_axis(sets, np.asarray(labels).reshape(-1, 1), axis=1)[:, 0]
  return float(hit.mean()), float(sets.sum(axis=1).mean())


def residual_interval(mean_cal: np.ndarray, y_cal: np.ndarray, alpha: float,
                      std_cal: np.ndarray | None = None) -> float:
  """q of conformalised absolute residuals, plain or normalised by the predicted std.

  Args:
    mean_cal: [n] predicted means on the calibration split.
    y_cal: [n] its targets.
    alpha: target miscoverage.
    std_cal: [n] predicted standard deviations (> 0), or None for plain residuals.

  Returns:
    q: intervals are mean +- q (plain) or mean +- q * std (normalised);
    see `residual_bounds`.
  """
  residual = np.abs(np.asarray(y_cal, np.float64) - np.asarray(mean_cal, np.float64))
  if std_cal is not None:
    std_cal = np.asarray(std_cal, np.float64)
    if np.any(std_cal <= 0):
      raise ValueError('std_cal must be positive to normalise the residuals.')
    residual = residual / std_cal
  return conformal_quantile(residual, alpha)


def residual_bounds(mean: np.ndarray, q: float, std: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
  """(lower, upper) = mean -+ q, or mean -+ q * std when q was calibrated normalised."""
  half = q if std is None else q * np.asarray(std, np.float64)
  mean = np.asarray(mean, np.float64)
  return mean - half, mean + half


def interval_coverage_and_width(lower: np.ndarray, upper: np.ndarray,
                                y: np.ndarray) -> tuple[float, float]:
  """(fraction of targets in [lower, upper], mean width upper - lower)."""
  y = np.asarray(y, np.float64)
  inside = (np.asarray(lower) <= y) & (y <= np.asarray(upper))
  return float(inside.mean()), float(np.mean(np.asarray(upper) - np.asarray(lower)))
