"""Regression metrics (dist_ens/eval/regression.py) against independent numpy computations.

The references below use float64 numpy and math.erf only: explicit densities, numerical
integration and grid searches, never the closed forms or the code under test.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dist_ens.eval import regression as reg

_erf = np.vectorize(math.erf)


def _pdf(y, mu, var):
  return np.exp(-0.5 * (y - mu) ** 2 / var) / np.sqrt(2 * np.pi * var)


def _cdf(y, mu, var):
  return 0.5 * (1 + _erf((y - mu) / np.sqrt(2 * var)))


def _inputs(m=4, b=6, d=None, seed=0):
  """Members' means and variances [M, B(, D)] and targets, float32 (references use them as f64)."""
  rng = np.random.default_rng(seed)
  shape = (m, b) if d is None else (m, b, d)
  means = rng.normal(0.0, 1.5, shape).astype(np.float32)
  variances = rng.uniform(0.2, 2.0, shape).astype(np.float32)
  y = rng.normal(0.0, 2.0, shape[1:]).astype(np.float32)
  return means, variances, y


def _f64(*arrays):
  return [np.asarray(a, np.float64) for a in arrays]


def test_gaussian_nll_matches_the_log_of_the_density():
  means, variances, y = _f64(*_inputs(m=1))
  expected = -np.log(_pdf(y, means[0], variances[0]))
  np.testing.assert_allclose(reg.gaussian_nll(means[0], variances[0], y), expected, atol=1e-6)


def test_mixture_nll_matches_explicit_mixture_density():
  means, variances, y = _inputs()
  m64, v64, y64 = _f64(means, variances, y)
  expected = -np.log(np.mean(_pdf(y64, m64, v64), axis=0))
  got = jax.jit(reg.mixture_nll)(means, variances, y)
  assert got.dtype == jnp.float32 and got.shape == (6,)
  np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)


def test_mixture_nll_of_vector_targets_uses_the_joint_density():
  means, variances, y = _inputs(d=3)
  m64, v64, y64 = _f64(means, variances, y)
  expected = -np.log(np.mean(np.prod(_pdf(y64, m64, v64), axis=-1), axis=0))
  np.testing.assert_allclose(reg.mixture_nll(means, variances, y), expected, atol=1e-6, rtol=0)


def test_excluded_members_drop_out_even_when_nan():
  means, variances, y = _inputs(m=4)
  mask = np.array([True, False, True, False])
  broken_means, broken_vars = means.copy(), variances.copy()
  broken_means[1], broken_vars[3] = np.nan, np.inf  # frozen members' garbage
  kept = (means[mask], variances[mask])
  for fn in map(jax.jit, (reg.mixture_nll, reg.mixture_crps, reg.mixture_cdf)):  # one compile
    np.testing.assert_allclose(fn(broken_means, broken_vars, y, mask), fn(*kept, y), rtol=1e-6)
  moments = jax.jit(reg.mixture_moments)
  for a, b in zip(moments(broken_means, broken_vars, mask), moments(*kept)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  interval = jax.jit(reg.mixture_central_interval, static_argnums=2)
  lo, hi = interval(broken_means, broken_vars, 0.9, mask)
  lo_kept, hi_kept = interval(*kept, 0.9)
  np.testing.assert_allclose(lo, lo_kept, rtol=1e-6)
  np.testing.assert_allclose(hi, hi_kept, rtol=1e-6)
  # No member left: NaN, not a number that looks like a result.
  assert np.isnan(reg.mixture_nll(means, variances, y, np.zeros(4, bool))).all()
  # Masking changes the answer: the excluded members counted before.
  assert np.abs(reg.mixture_nll(means, variances, y, mask) - reg.mixture_nll(means, variances, y)
                ).max() > 1e-2


def test_mixture_moments_match_the_mixture_variance():
  means, variances, _ = _inputs(m=5, b=7)
  m64, v64 = _f64(means, variances)
  got = reg.mixture_moments(means, variances)
  np.testing.assert_allclose(got.mean, m64.mean(0), atol=1e-6)
  np.testing.assert_allclose(got.aleatoric, v64.mean(0), atol=1e-6)
  np.testing.assert_allclose(got.epistemic, m64.var(0), atol=1e-5)
  # Total against the mixture's second moment E[X^2] - E[X]^2, a different formula.
  np.testing.assert_allclose(got.total, (v64 + m64 ** 2).mean(0) - m64.mean(0) ** 2, atol=1e-5)


def _simpson(values, h):
  return h / 3 * (values[0] + 4 * values[1:-1:2].sum() + 2 * values[2:-1:2].sum() + values[-1])


def _crps_by_integration(mu, var, y, points=20_001):
  """integral (F(z) - 1[z >= y])^2 dz by Simpson's rule, split at y (the step), over
  12 standard deviations beyond every member (the tails left out are below 1e-30)."""
  s = np.sqrt(var)
  a, b = min((mu - 12 * s).min(), y) - 1, max((mu + 12 * s).max(), y) + 1
  left, right = np.linspace(a, y, points), np.linspace(y, b, points)
  mixture_cdf = lambda z: _cdf(z[:, None], mu[None, :], var[None, :]).mean(axis=1)
  return (_simpson(mixture_cdf(left) ** 2, left[1] - left[0]) +
          _simpson((1 - mixture_cdf(right)) ** 2, right[1] - right[0]))


def test_crps_matches_numerical_integration():
  means, variances, y = _inputs(m=3, b=4)
  m64, v64, y64 = _f64(means, variances, y)
  mixture = [_crps_by_integration(m64[:, i], v64[:, i], y64[i]) for i in range(4)]
  single = [_crps_by_integration(m64[:1, i], v64[:1, i], y64[i]) for i in range(4)]
  # Simpson's error at this step is ~1e-12 (it agrees with 400,001 trapezoid points to 1e-11);
  # float32 evaluation leaves ~1e-7.
  mixture_crps = jax.jit(reg.mixture_crps)
  np.testing.assert_allclose(mixture_crps(means, variances, y), mixture, atol=1e-6)
  np.testing.assert_allclose(mixture_crps(means[:1], variances[:1], y), single, atol=1e-6)
  np.testing.assert_allclose(jax.jit(reg.gaussian_crps)(means[0], variances[0], y), single,
                             atol=1e-6)


def test_mixture_cdf_matches_the_mean_of_member_cdfs():
  means, variances, y = _inputs()
  m64, v64, y64 = _f64(means, variances, y)
  np.testing.assert_allclose(reg.mixture_cdf(means, variances, y),
                             _cdf(y64, m64, v64).mean(0), atol=1e-6)


def _first_reaching(cdf, grid, p, stride=100):
  """The index of the first point of `grid` where the increasing `cdf` reaches `p`:
  found on every stride-th point, then on the points of the one stride that holds it
  (the same index as on the whole grid, with 1/stride of math.erf's calls)."""
  coarse = int(np.argmax(cdf(grid[::stride]) >= p))  # its point reaches p, the one before not
  start = max(coarse - 1, 0) * stride
  return start + int(np.argmax(cdf(grid[start:coarse * stride + 1]) >= p))


def test_mixture_intervals_match_a_grid_search():
  """Every level's interval from the one bisection evaluation runs (a sequence of levels),
  each against a grid search of the reference CDF; one level alone gives the same ends."""
  means, variances, _ = _inputs(m=3, b=5)
  m64, v64 = _f64(means, variances)
  interval = jax.jit(reg.mixture_central_interval, static_argnums=2)
  every_lo, every_hi = interval(means, variances, reg.INTERVAL_LEVELS)
  assert every_lo.shape == every_hi.shape == (len(reg.INTERVAL_LEVELS), 5)
  step = 1e-4
  grid = np.arange(-20, 20, step)
  for level, lo, hi in zip(reg.INTERVAL_LEVELS, every_lo, every_hi):
    for i in range(5):
      cdf = lambda x, i=i: _cdf(x[:, None], m64[None, :, i], v64[None, :, i]).mean(1)
      # The first grid point whose CDF reaches the probability; the quantile lies within a step.
      grid_lo = grid[_first_reaching(cdf, grid, (1 - level) / 2)]
      grid_hi = grid[_first_reaching(cdf, grid, (1 + level) / 2)]
      eps = 1e-5  # float32 rounding of ends near 3 (a few ulps; the compiled code's order)
      assert grid_lo - step - eps <= lo[i] <= grid_lo + eps, level
      assert grid_hi - step - eps <= hi[i] <= grid_hi + eps, level
    # Sharper: the reference CDF at the returned ends is the wanted probability.
    np.testing.assert_allclose(_cdf(np.asarray(lo, np.float64), m64, v64).mean(0),
                               (1 - level) / 2, atol=1e-6)
    np.testing.assert_allclose(_cdf(np.asarray(hi, np.float64), m64, v64).mean(0),
                               (1 + level) / 2, atol=1e-6)
  lo, hi = reg.mixture_central_interval(means, variances, 0.9)
  np.testing.assert_allclose(np.stack([lo, hi]), [every_lo[1], every_hi[1]], rtol=0, atol=1e-6)


def test_gaussian_interval():
  lo, hi = reg.gaussian_central_interval(jnp.float32([1.0]), jnp.float32([4.0]), 0.95)
  np.testing.assert_allclose([lo[0], hi[0]], [1 - 2 * 1.959964, 1 + 2 * 1.959964], rtol=1e-6)
  every_lo, every_hi = reg.gaussian_central_interval(jnp.float32([1.0]), jnp.float32([4.0]),
                                                     (0.5, 0.95))
  np.testing.assert_allclose(every_hi[:, 0], [1 + 2 * 0.6744898, 1 + 2 * 1.959964], rtol=1e-6)
  np.testing.assert_array_equal([every_lo[1, 0], every_hi[1, 0]], [lo[0], hi[0]])


def _well_specified(n=20_000, m=3, seed=1):
  """Members' predictions and targets drawn from their uniform mixture."""
  rng = np.random.default_rng(seed)
  means = rng.normal(0.0, 2.0, (m, n)).astype(np.float32)
  variances = rng.uniform(0.3, 3.0, (m, n)).astype(np.float32)
  member = rng.integers(0, m, n)
  columns = np.arange(n)
  y = rng.normal(means[member, columns], np.sqrt(variances[member, columns])).astype(np.float32)
  return means, variances, y, member


@pytest.mark.parametrize('level', reg.INTERVAL_LEVELS)
def test_coverage_of_a_well_specified_model_is_nominal(level):
  means, variances, y, member = _well_specified()
  lo, hi = reg.mixture_central_interval(means, variances, level)
  coverage = np.mean((np.asarray(lo) <= y) & (y <= np.asarray(hi)))
  assert abs(coverage - level) < 0.02, (level, coverage)
  # One member's Gaussian, on the targets that member drew.
  mine = member == 0
  lo, hi = reg.gaussian_central_interval(means[0, mine], variances[0, mine], level)
  coverage = np.mean((np.asarray(lo) <= y[mine]) & (y[mine] <= np.asarray(hi)))
  assert abs(coverage - level) < 0.02, (level, coverage)


def test_pit_below_sums_over_batches():
  pit = np.random.default_rng(0).uniform(size=(10, 2)).astype(np.float32)
  whole = np.asarray(reg.pit_below(pit)).sum(0)
  parts = np.asarray(reg.pit_below(pit[:4])).sum(0) + np.asarray(reg.pit_below(pit[4:])).sum(0)
  np.testing.assert_allclose(whole, parts)
  levels = np.asarray(reg.CALIBRATION_LEVELS)
  np.testing.assert_allclose(whole / 10, np.mean(pit[:, :, None] <= levels, axis=(0, 1)))


def test_per_member_metrics_vmap_over_the_member_axis():
  means, variances, y = _inputs()
  per_member = jax.vmap(reg.gaussian_nll, in_axes=(0, 0, None))(means, variances, y)
  m64, v64, y64 = _f64(means, variances, y)
  np.testing.assert_allclose(per_member, -np.log(_pdf(y64, m64, v64)), atol=1e-6)
  assert per_member.shape == (4, 6)
