"""What a run reports for decisions, on the host: selective prediction, conformal sets,
and the summary of a shift evaluation (cA, cNLL, cCE).

Selective prediction (classification): AURC and accuracy at 90/95/99 % coverage when
the ensemble answers its most confident examples first, ranked by three scores:
'confidence' (max_c p_bar), 'entropy' (low predictive entropy first) and
'mutual_information' (low mutual information first); see dist_ens.eval.selective.

Conformal prediction, calibrated on the validation split (dist_ens.eval.conformal):
  classification  APS (Romano et al., 2020), randomised: its one parameter is alpha,
                  its sets grow with each example's difficulty, and randomisation gives
                  coverage 1 - alpha up to 1 / (n + 1) with the smallest APS sets. RAPS
                  would need its lam and k_reg tuned on a further split. The ensemble's
                  probabilities p_bar are scored; the seeds of u derive from the run's.
  regression      residuals |y - mean| / std normalised by the ensemble's predictive
                  std, intervals mean +- q std: wider where the ensemble is unsure
                  (Lei et al., 2018). Widths are in the targets' units.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from dist_ens.eval import conformal, evaluate, selective
from dist_ens.eval.ranks import ExampleStats

# Scores of selective prediction, each "higher = answer first", from a split's stats.
_SCORES: dict[str, Callable[[ExampleStats], np.ndarray]] = {
    'confidence': lambda e: e.ensemble_confidence,
    'entropy': lambda e: -e.entropy,
    'mutual_information': lambda e: -e.mutual_information,
}
# The benchmarks' names of the means over corruptions and severities.
SHIFT_MEANS = {'cA': 'accuracy', 'cNLL': 'nll', 'cCE': 'ece'}


def selective_report(examples: Any,
                     coverages: Sequence[float] = selective.DEFAULT_COVERAGES
                     ) -> dict[str, Any] | None:
  """{'aurc': {score: AURC}, 'excess_aurc': {...}, 'accuracy_at_coverage': {score: {'90':
  ...}}} of a classification split's ExampleStats; None for another task's stats."""
  if not isinstance(examples, ExampleStats):
    return None
  correct = np.asarray(examples.ensemble_correct)
  out: dict[str, Any] = {'aurc': {}, 'excess_aurc': {}, 'accuracy_at_coverage': {}}
  for name, score_of in _SCORES.items():
    score = np.asarray(score_of(examples), np.float64)
    out['aurc'][name] = selective.aurc(score, correct)
    out['excess_aurc'][name] = selective.excess_aurc(score, correct)
    accuracy = selective.accuracy_at_coverage(score, correct, list(coverages))
    out['accuracy_at_coverage'][name] = {f'{100 * c:g}': float(a)
                                         for c, a in zip(coverages, accuracy)}
  return out


class ConformalFit(NamedTuple):
  """A conformal predictor calibrated on a validation split."""
  method: str  # 'aps' (classification) or 'normalized_residual' (regression)
  alpha: float
  threshold: float  # q (inf: too few calibration examples for this alpha)
  calibration_size: int
  seed: int  # the randomisation seed of APS's u on calibration; evaluation uses others


def ensemble_probs(outputs: np.ndarray, member_mask: np.ndarray) -> np.ndarray:
  """[N, C] the mean softmax of the included members' logits [M, N, C] (float64)."""
  logits = np.asarray(outputs, np.float64)[np.asarray(member_mask, bool)]
  logits = logits - logits.max(axis=-1, keepdims=True)
  probs = np.exp(logits)
  return (probs / probs.sum(axis=-1, keepdims=True)).mean(axis=0)


def _mean_std(predict: Callable[..., dict[str, Any]], outputs: np.ndarray,
              member_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  out = evaluate.compiled_once(predict)(np.asarray(outputs), np.asarray(member_mask, bool))
  return np.asarray(out['mean'], np.float64), np.sqrt(np.asarray(out['variance'], np.float64))


def fit_conformal(outputs: np.ndarray, y: np.ndarray, member_mask: np.ndarray, alpha: float,
                  seed: int, predict: Callable[..., dict[str, Any]] | None = None
                  ) -> ConformalFit:
  """Calibrates on the validation split's member outputs [M, n, ...] and targets.

  predict: None for classification (outputs are logits), else the task's predict
  (regression: the mixture's 'mean' and 'variance').
  """
  if predict is None:
    q = conformal.aps_threshold(ensemble_probs(outputs, member_mask), y, alpha, seed=seed)
    return ConformalFit('aps', alpha, q, len(y), seed)
  mean, std = _mean_std(predict, outputs, member_mask)
  q = conformal.residual_interval(mean, y, alpha, np.maximum(std, 1e-12))
  return ConformalFit('normalized_residual', alpha, q, len(y), seed)


def conformal_report(fit: ConformalFit, outputs: np.ndarray, y: np.ndarray,
                     member_mask: np.ndarray, seed: int,
                     predict: Callable[..., dict[str, Any]] | None = None,
                     y_scale: Any = 1.0) -> dict[str, float]:
  """{'coverage', 'mean_set_size'} (classification) or {'coverage', 'mean_width'} (in
  target units: widths times y_scale) of the fitted predictor on a split.

  seed: APS's u on this split; differ from the calibration's and between splits.
  """
  if fit.method == 'aps':
    sets = conformal.aps_sets(ensemble_probs(outputs, member_mask), fit.threshold, seed=seed)
    coverage, size = conformal.set_coverage_and_size(sets, y)
    return {'coverage': coverage, 'mean_set_size': size}
  mean, std = _mean_std(predict, outputs, member_mask)
  lower, upper = conformal.residual_bounds(mean, fit.threshold, np.maximum(std, 1e-12))
  coverage, _ = conformal.interval_coverage_and_width(lower, upper, y)
  width = (upper - lower) * np.asarray(y_scale, np.float64)
  return {'coverage': coverage, 'mean_width': float(np.mean(width))}


def _mean_of(values: list[Any]) -> Any:
  """Mean over corruptions of floats, or elementwise of lists (members); None if neither."""
  if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
    return float(np.mean(values))
  if all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
    try:
      return np.mean(np.asarray(values, np.float64), axis=0).tolist()
    except (TypeError, ValueError):
      return None
  return None


def _mean_tree(trees: list[dict[str, Any]]) -> dict[str, Any]:
  """The mean over `trees` (same keys) of every number / list of numbers, nested."""
  out = {}
  for key in trees[0]:
    values = [t.get(key) for t in trees]
    if all(isinstance(v, dict) for v in values):
      out[key] = _mean_tree(values)
    elif (mean := _mean_of(values)) is not None:
      out[key] = mean
  return out


def shift_summary(per_pair: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
  """final_metrics.json's 'shift': every (corruption, severity)'s results, their mean
  over all pairs ('mean'), and the benchmark's cA / cNLL / cCE (the ensemble's mean
  accuracy, NLL, ECE) where the task has them."""
  corruptions: dict[str, dict[str, Any]] = {}
  for (name, severity), result in per_pair.items():
    corruptions.setdefault(name, {})[str(severity)] = result
  mean = _mean_tree(list(per_pair.values()))
  out = {'pairs': len(per_pair), 'corruptions': corruptions, 'mean': mean}
  for short, metric in SHIFT_MEANS.items():
    if metric in mean.get('ensemble', {}):
      out[short] = mean['ensemble'][metric]
  return out
