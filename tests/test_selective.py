"""Selective prediction: curves and AURC against plain loops, ties against every order."""

import itertools

import numpy as np
import pytest

from dist_ens.eval import selective


def _naive_curve(order, correct):
  """Risks of answering examples in `order`: a loop over k, nothing shared with the module."""
  risks, errors = [], 0
  for k, i in enumerate(order, start=1):
    errors += 1 - int(correct[i])
    risks.append(errors / k)
  return np.array(risks)


def _data(n, seed):
  rng = np.random.default_rng(seed)
  scores = rng.random(n)
  correct = rng.random(n) < 0.3 + 0.6 * scores  # confident examples are right more often
  return scores, correct


def test_curve_and_aurc_equal_a_loop_without_ties():
  scores, correct = _data(500, 0)
  order = sorted(range(len(scores)), key=lambda i: -scores[i])
  reference = _naive_curve(order, correct)
  curve = selective.risk_coverage(scores, correct)
  np.testing.assert_allclose(curve.risk, reference, atol=1e-6)
  np.testing.assert_allclose(curve.coverage, np.arange(1, 501) / 500, atol=1e-12)
  np.testing.assert_allclose(curve.threshold, sorted(scores, reverse=True))
  assert abs(selective.aurc(scores, correct) - sum(reference) / len(reference)) < 1e-6


def test_ties_average_the_curve_over_every_order_of_the_tied_examples():
  scores = np.array([0.2, 0.9, 0.5, 0.9, 0.5, 0.2, 0.9, 0.1])
  correct = np.array([1, 0, 1, 1, 0, 0, 1, 1])
  groups = [[i for i in range(8) if scores[i] == s] for s in sorted(set(scores), reverse=True)]
  curves = [_naive_curve([i for part in parts for i in part], correct)
            for parts in itertools.product(*[itertools.permutations(g) for g in groups])]
  assert len(curves) == 6 * 2 * 2 * 1  # 3 at 0.9, 2 at 0.5, 2 at 0.2, 1 at 0.1
  reference = np.mean(curves, axis=0)
  np.testing.assert_allclose(selective.risk_coverage(scores, correct).risk, reference, atol=1e-12)
  assert abs(selective.aurc(scores, correct) - reference.mean()) < 1e-12
  # Hence independent of the input order.
  perm = np.random.default_rng(0).permutation(8)
  np.testing.assert_allclose(selective.risk_coverage(scores[perm], correct[perm]).risk,
                             reference, atol=1e-12)


def test_accuracy_at_coverage_is_the_accuracy_of_the_most_confident():
  scores, correct = _data(200, 1)
  order = np.argsort(-scores)
  for coverage, count in [(0.9, 180), (0.95, 190), (0.99, 198), (1.0, 200), (0.001, 1)]:
    expected = correct[order[:count]].mean()
    assert abs(selective.accuracy_at_coverage(scores, correct, coverage) - expected) < 1e-12
  several = selective.accuracy_at_coverage(scores, correct, [0.9, 0.95])
  np.testing.assert_allclose(several, [correct[order[:180]].mean(), correct[order[:190]].mean()])
  with pytest.raises(ValueError, match='coverage'):
    selective.accuracy_at_coverage(scores, correct, 0.0)


def test_excess_aurc_is_zero_for_a_perfect_ranking():
  correct = np.array([1, 1, 0, 1, 0, 0])
  perfect = np.array([0.9, 0.8, 0.1, 0.7, 0.2, 0.3])
  assert abs(selective.excess_aurc(perfect, correct)) < 1e-12
  reversed_ = -perfect
  assert selective.excess_aurc(reversed_, correct) > 0.3
  # AURC of the best ordering: risks 0, 0, 0, 1/4, 2/5, 3/6.
  assert abs(selective.aurc(perfect, correct) - (1 / 4 + 2 / 5 + 3 / 6) / 6) < 1e-12


def test_rejects_bad_inputs():
  with pytest.raises(ValueError, match='finite'):
    selective.aurc(np.array([0.1, np.nan]), np.array([1, 0]))
  with pytest.raises(ValueError, match='one length'):
    selective.aurc(np.array([0.1, 0.2]), np.array([1]))
