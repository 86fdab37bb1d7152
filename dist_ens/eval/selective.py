"""Selective prediction on the host: risk-coverage curves, AURC, accuracy at a coverage.

A selective classifier answers only its most confident examples. For N examples
sorted by score, most confident first, the curve has one point per k = 1..N:
  coverage_k = k / N,   risk_k = (errors among the first k) / k,
and AURC = (1 / N) sum_k risk_k (Geifman et al., 2019: the area under the curve
with a point at each coverage k / N). Lower is better. Scores are "higher = more
confident": pass -entropy or -mutual information, not the uncertainties themselves
(eval/decisions.py ranks by the three scores of a split's ExampleStats).

Ties. Examples with equal scores cannot be ordered by the score, and any order we
picked (input order, a stable sort) would change the curve. So a group of tied
examples is taken in a random order, in expectation: at a k inside a group of g
examples with e errors, of which j are among the first k, the errors counted are
(errors before the group) + j * e / g. This is the mean of the curve over every
order of the ties, it does not depend on the input order, and without ties it is
the plain curve. accuracy_at_coverage and AURC follow from it.

Example:
  >>> confidence = member_probs.mean(0).max(-1)            # [M, N, C] -> [N]
  >>> correct = member_probs.mean(0).argmax(-1) == labels
  >>> aurc(confidence, correct)
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Coverage levels the issue asks for: accuracy on the 90 / 95 / 99 % most confident.
DEFAULT_COVERAGES = (0.90, 0.95, 0.99)


class RiskCoverage(NamedTuple):
  """A risk-coverage curve: point k (0-based) keeps the k + 1 most confident examples."""
  coverage: np.ndarray  # [N] (k + 1) / N
  risk: np.ndarray  # [N] expected error rate among them (ties: see the module docstring)
  threshold: np.ndarray  # [N] the score of the (k + 1)-th most confident example


def _checked(scores: np.ndarray, correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  scores = np.asarray(scores, np.float64)
  correct = np.asarray(correct, np.float64)
  if scores.ndim != 1 or scores.shape != correct.shape or not len(scores):
    raise ValueError(f'scores and correct must be non-empty [N] arrays of one length; got '
                     f'{scores.shape} and {correct.shape}.')
  if not np.all(np.isfinite(scores)):
    raise ValueError('scores must be finite (NaN has no place in a ranking).')
  return scores, correct


def risk_coverage(scores: np.ndarray, correct: np.ndarray) -> RiskCoverage:
  """The risk-coverage curve of answering the most confident examples first.

  Args:
    scores: [N] confidence, higher = more confident.
    correct: [N] 1 (or True) where the prediction is right, else 0; fractions in
      [0, 1] are accepted (the risk is then 1 - mean correctness).

  Returns:
    RiskCoverage with N points, ties averaged over their orders (module docstring).
  """
  scores, correct = _checked(scores, correct)
  n = len(scores)
  order = np.argsort(-scores, kind='stable')
  sorted_scores, errors = scores[order], 1.0 - correct[order]
  starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
  ends = np.r_[starts[1:], n]
  group = np.repeat(np.arange(len(starts)), ends - starts)  # each position's tie group
  cumulative = np.r_[0.0, np.cumsum(errors)]
  before = cumulative[starts][group]  # errors of the groups ahead of this one
  group_rate = ((cumulative[ends] - cumulative[starts]) / (ends - starts))[group]
  k = np.arange(1, n + 1)
  expected_errors = before + (k - starts[group]) * group_rate
  return RiskCoverage(k / n, expected_errors / k, sorted_scores)


def aurc(scores: np.ndarray, correct: np.ndarray) -> float:
  """Area under the risk-coverage curve: the mean of its N risks (lower is better)."""
  return float(np.mean(risk_coverage(scores, correct).risk))


def excess_aurc(scores: np.ndarray, correct: np.ndarray) -> float:
  """AURC minus that of the best ordering (every right answer first): 0 is a perfect ranking.

  Removes the part of AURC that only reflects the accuracy (Geifman et al.'s E-AURC).
  """
  _, correct = _checked(scores, correct)
  return aurc(scores, correct) - aurc(correct, correct)  # ranked by correctness itself


def accuracy_at_coverage(scores: np.ndarray, correct: np.ndarray,
                         coverage: float | Sequence[float]) -> float | np.ndarray:
  """Accuracy on the ceil(coverage * N) most confident examples (ties as in the curve).

  Args:
    scores: [N] confidence, higher = more confident.
    correct: [N] 1 where right, else 0.
    coverage: a fraction in (0, 1], or several.

  Returns:
    A float for one coverage, else an array of one per coverage.
  """
  curve = risk_coverage(scores, correct)
  n = len(curve.risk)
  fractions = np.atleast_1d(np.asarray(coverage, np.float64))
  if np.any((fractions <= 0) | (fractions > 1)):
    raise ValueError(f'coverage must be in (0, 1]; got {coverage}.')
  # The tolerance keeps 0.9 * 100 = 90.00000000000001 from asking for 91 examples.
  counts = [min(n, max(1, math.ceil(f * n - 1e-9))) for f in fractions]
  accuracy = 1.0 - curve.risk[np.asarray(counts) - 1]
  return float(accuracy[0]) if np.ndim(coverage) == 0 else accuracy
