"""Split conformal: coverage 1 - alpha over repeated splits, against brute-force references."""

import math

import numpy as np
import pytest

from dist_ens.eval import conformal

SPLITS = 200
N_CAL = N_TEST = 1000


def _softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _classification(seed=0, n=N_CAL + N_TEST, c=10):
  """A miscalibrated model: labels come from sharper, perturbed logits than its own."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(n, c)) * 2
  truth = _softmax(1.7 * logits + rng.normal(size=(n, c)))
  labels = (truth.cumsum(1) > rng.random((n, 1))).argmax(1)
  return _softmax(logits), labels


def _splits(n, seed):
  rng = np.random.default_rng(seed)
  for _ in range(SPLITS):
    perm = rng.permutation(n)
    yield perm[:N_CAL], perm[N_CAL:N_CAL + N_TEST]


@pytest.mark.parametrize('alpha,randomized,lam,k_reg', [
    (0.1, True, 0.0, 0), (0.1, False, 0.0, 0), (0.05, True, 0.01, 2), (0.2, True, 0.0, 0)])
def test_aps_coverage_is_one_minus_alpha_over_repeated_splits(alpha, randomized, lam, k_reg):
  probs, labels = _classification()
  coverages, sizes = [], []
  for i, (cal, test) in enumerate(_splits(len(labels), seed=1)):
    q = conformal.aps_threshold(probs[cal], labels[cal], alpha, randomized, 2 * i, lam, k_reg)
    sets = conformal.aps_sets(probs[test], q, randomized, 2 * i + 1, lam, k_reg)
    coverage, size = conformal.set_coverage_and_size(sets, labels[test])
    coverages.append(coverage)
    sizes.append(size)
  assert abs(np.mean(coverages) - (1 - alpha)) < 0.02, np.mean(coverages)
  # The guarantee is marginal over splits; each split of 1,000 stays near it too.
  assert np.all(np.abs(np.array(coverages) - (1 - alpha)) < 0.07)
  assert 1 < np.mean(sizes) < 10  # informative: neither singletons nor every class


def _brute_force_score(p, label, u):
  """APS score by its definition: the mass ranked above the label plus u times its own."""
  rank_above = [c for c in range(len(p)) if p[c] > p[label] or (p[c] == p[label] and c < label)]
  return sum(p[c] for c in rank_above) + u * p[label]


def test_threshold_and_sets_match_the_definition():
  probs, labels = _classification(seed=3, n=120, c=5)
  probs[0] = [0.4, 0.2, 0.2, 0.1, 0.1]  # ties resolve to the lower class index
  cal, test = np.arange(60), np.arange(60, 120)
  scores = [_brute_force_score(probs[i], labels[i], 1.0) for i in cal]
  expected = sorted(scores)[math.ceil(61 * 0.9) - 1]
  q = conformal.aps_threshold(probs[cal], labels[cal], 0.1, randomized=False)
  assert abs(q - expected) < 1e-12
  sets = conformal.aps_sets(probs[test], q, randomized=False)
  for row, i in enumerate(test):
    members = [c for c in range(5) if _brute_force_score(probs[i], c, 1.0) <= q + 1e-12]
    assert list(np.flatnonzero(sets[row])) == members
  # Randomized, with u drawn as documented (one uniform per example from the seed).
  u = np.random.default_rng(7).random(60)
  np.testing.assert_allclose(
      conformal.aps_scores(probs[cal], labels[cal], randomized=True, seed=7),
      [_brute_force_score(probs[i], labels[i], u[i]) for i in cal], atol=1e-12)


def test_randomized_sets_are_deterministic_given_the_seed():
  probs, _ = _classification(n=200)
  first = conformal.aps_sets(probs, 0.8, seed=5)
  np.testing.assert_array_equal(conformal.aps_sets(probs, 0.8, seed=5), first)
  assert not np.array_equal(conformal.aps_sets(probs, 0.8, seed=6), first)


def test_conformal_quantile_is_the_finite_sample_rank():
  scores = np.arange(1.0, 10.0)[::-1]  # 9 scores, 1..9
  assert conformal.conformal_quantile(scores, 0.1) == 9.0  # ceil(10 * 0.9) = 9
  assert conformal.conformal_quantile(scores, 0.5) == 5.0  # ceil(10 * 0.5) = 5
  assert conformal.conformal_quantile(scores, 0.05) == math.inf  # rank 10 > 9
  with pytest.raises(ValueError, match='alpha'):
    conformal.conformal_quantile(scores, 1.0)


def _regression(seed=0, n=N_CAL + N_TEST):
  """Heteroscedastic targets; a biased mean and a std that is right only up to a factor."""
  rng = np.random.default_rng(seed)
  x = rng.uniform(-3, 3, n)
  noise_std = 0.1 + 0.5 * np.abs(x)
  y = np.sin(x) + noise_std * rng.standard_normal(n)
  return y, np.sin(x) + 0.1, 0.7 * noise_std


@pytest.mark.parametrize('method', ['residual', 'normalised'])
def test_interval_coverage_is_one_minus_alpha_over_repeated_splits(method):
  alpha = 0.1
  y, mean, std = _regression()
  coverages, widths = [], []
  for cal, test in _splits(len(y), seed=2):
    scale = (lambda idx: std[idx]) if method == 'normalised' else (lambda idx: None)
    q = conformal.residual_interval(mean[cal], y[cal], alpha, scale(cal))
    lower, upper = conformal.residual_bounds(mean[test], q, scale(test))
    coverage, width = conformal.interval_coverage_and_width(lower, upper, y[test])
    coverages.append(coverage)
    widths.append(width)
  assert abs(np.mean(coverages) - (1 - alpha)) < 0.02, np.mean(coverages)
  assert np.all(np.abs(np.array(coverages) - (1 - alpha)) < 0.07)


def test_residual_quantile_matches_a_sorted_list():
  y, mean, std = _regression(seed=4, n=50)
  residuals = sorted(abs(a - b) for a, b in zip(y, mean))
  assert conformal.residual_interval(mean, y, 0.2) == residuals[math.ceil(51 * 0.8) - 1]
  normalised = sorted(abs(a - b) / s for a, b, s in zip(y, mean, std))
  assert conformal.residual_interval(mean, y, 0.2, std) == normalised[math.ceil(51 * 0.8) - 1]
  lower, upper = conformal.residual_bounds(mean, 2.0, std)
  np.testing.assert_allclose(upper - lower, 4.0 * std)
