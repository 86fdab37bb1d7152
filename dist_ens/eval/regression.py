"""Regression metrics for Gaussian heads and their ensembles, per example, in float32.

Each member m predicts, per example and target dimension, a Gaussian N(mu_m, s2_m). The
ensemble is the UNIFORM mixture over the included members (member_mask [M] bool, None = all;
K of them): p(y) = (1/K) sum_m N(y; mu_m, s2_m). An excluded member's outputs are replaced
before use, so a frozen member's NaNs do not leak into the mixture; with no member included
the results are NaN.

Shapes: members' means and variances are [M, B] or [M, B, D], targets [B] or [B, D]. The
metric functions return one value per example, [B], so that a sharded evaluator can sum them
under its padding mask and divide by the count, like the classification metrics:
  nll, crps                  summed over the D target dimensions (the joint NLL of a diagonal
                             Gaussian; the sum of the marginal CRPS).
  pit_below                  [B, L]: the share of target dimensions whose PIT is <= level l.
`mixture_cdf`, the intervals and the moments are predictions, not metrics: they keep [B(, D)].

Reported values (tasks/regression_eval.py: means over n examples): RMSE; NLL; CRPS; coverage
and width at levels 50/90/95%; quantile calibration error from the summed pit_below.
Per member, apply the gaussian_* functions under jax.vmap over the member axis. Metrics in the
data's original units follow from the inverted mean and variance (data.uci.Standardizer).
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtr, ndtri

INTERVAL_LEVELS = (0.5, 0.9, 0.95)
# The probability levels of the quantile calibration error: 0.05, 0.10, ..., 0.95.
CALIBRATION_LEVELS = tuple(round(0.05 * i, 2) for i in range(1, 20))

_LOG_2PI = math.log(2 * math.pi)
# Bisection halves the bracket each step; 64 steps take any float32 bracket to adjacent floats.
_BISECTION_STEPS = 64


class MixtureMoments(NamedTuple):
  """The mixture's mean and its variance split by the law of total variance, [B(, D)]."""
  mean: jax.Array  # sum_m w_m mu_m
  aleatoric: jax.Array  # sum_m w_m s2_m: the noise the members themselves predict
  epistemic: jax.Array  # sum_m w_m (mu_m - mean)^2: the members' disagreement
  total: jax.Array  # aleatoric + epistemic, the mixture's variance


def _f32(a) -> jax.Array:
  return jnp.asarray(a, jnp.float32)


def _per_example_sum(a: jax.Array) -> jax.Array:
  """[B] from [B] or [B, D, ...] by summing the target dimensions."""
  return a if a.ndim <= 1 else a.reshape(a.shape[0], -1).sum(axis=1)


def _included(means: jax.Array, member_mask: jax.Array | None) -> jax.Array:
  """[M, 1, ...] bool, broadcastable against the members' [M, B(, D)] outputs."""
  mask = jnp.ones(means.shape[:1], bool) if member_mask is None else jnp.asarray(member_mask, bool)
  return mask.reshape(mask.shape + (1,) * (means.ndim - 1))


def _members(means, variances, member_mask):
  """(means, variances, included, weights): excluded members set to N(0, 1), weight 0.

  Replacing (not weighting by zero) keeps an excluded member's NaN or inf out: 0 * NaN = NaN.
  """
  means, variances = _f32(means), _f32(variances)
  included = _included(means, member_mask)
  weights = included / jnp.sum(included.astype(jnp.float32))
  return (jnp.where(included, means, 0.0), jnp.where(included, variances, 1.0), included,
          weights)


def gaussian_nll(mean: jax.Array, var: jax.Array, y: jax.Array) -> jax.Array:
  """Negative log density of y under N(mean, var), per example [B].

  nll = 0.5 * sum_d [log(2 pi var_d) + (y_d - mean_d)^2 / var_d].

  Example:
    >>> float(gaussian_nll(jnp.zeros(1), jnp.ones(1), jnp.zeros(1))[0]).__round__(6)
    0.918939
  """
  mean, var, y = _f32(mean), _f32(var), _f32(y)
  return _per_example_sum(0.5 * (_LOG_2PI + jnp.log(var) + jnp.square(y - mean) / var))


def mixture_moments(means: jax.Array, variances: jax.Array,
                    member_mask: jax.Array | None = None) -> MixtureMoments:
  """The ensemble's predictive mean and variance decomposition (see MixtureMoments).

  With weights w_m = 1/K over the K included members; epistemic is the population variance
  of the members' means (ddof 0), so total is exactly the mixture's variance.

  Args:
    means, variances: [M, B(, D)] members' Gaussian parameters.
    member_mask: [M] bool, members in the ensemble (None = all).
  """
  means, variances, _, w = _members(means, variances, member_mask)
  mean = jnp.sum(w * means, axis=0)
  aleatoric = jnp.sum(w * variances, axis=0)
  epistemic = jnp.sum(w * jnp.square(means - mean), axis=0)  # two-pass: no E[mu^2] - mean^2
  return MixtureMoments(mean, aleatoric, epistemic, aleatoric + epistemic)


def mixture_nll(means: jax.Array, variances: jax.Array, y: jax.Array,
                member_mask: jax.Array | None = None) -> jax.Array:
  """Negative log density of y under the uniform mixture, per example [B].

  nll = -log (1/K) sum_{m included} prod_d N(y_d; mu_md, s2_md), as a logsumexp over members
  of the members' log densities (excluded members at -inf, like ensemble_log_probs).

  Example:
    >>> two = jnp.zeros((2, 1))  # two identical N(0, 1) members: the mixture is N(0, 1)
    >>> float(mixture_nll(two, jnp.ones((2, 1)), jnp.zeros(1))[0]).__round__(6)
    0.918939
  """
  means, variances, included, _ = _members(means, variances, member_mask)
  log_density = -jax.vmap(gaussian_nll, in_axes=(0, 0, None))(means, variances, y)  # [M, B]
  included = included.reshape(included.shape[:1] + (1,))
  log_mixture = jax.nn.logsumexp(jnp.where(included, log_density, -jnp.inf), axis=0)
  return jnp.log(jnp.sum(included.astype(jnp.float32))) - log_mixture


def _crps_a(mu: jax.Array, var: jax.Array) -> jax.Array:
  """A(mu, s2) = E|Z| for Z ~ N(mu, s2): 2 s phi(mu / s) + mu (2 Phi(mu / s) - 1)."""
  s = jnp.sqrt(var)
  z = mu / s
  return 2 * s * jnp.exp(-0.5 * jnp.square(z)) / math.sqrt(2 * math.pi) + mu * (2 * ndtr(z) - 1)


def gaussian_crps(mean: jax.Array, var: jax.Array, y: jax.Array) -> jax.Array:
  """Continuous ranked probability score of N(mean, var) at y, per example [B].

  CRPS = integral (F(z) - 1[z >= y])^2 dz = s [w (2 Phi(w) - 1) + 2 phi(w) - 1/sqrt(pi)],
  w = (y - mean) / s, s = sqrt(var) (Gneiting & Raftery 2007); summed over target dims.
  """
  mean, var, y = _f32(mean), _f32(var), _f32(y)
  return _per_example_sum(_crps_a(y - mean, var) - jnp.sqrt(var / math.pi))


def mixture_crps(means: jax.Array, variances: jax.Array, y: jax.Array,
                 member_mask: jax.Array | None = None) -> jax.Array:
  """CRPS of the uniform Gaussian mixture at y, per example [B], in closed form.

  CRPS = E|X - y| - 0.5 E|X - X'| with X, X' independent draws of the mixture
       = sum_m w_m A(y - mu_m, s2_m) - 0.5 sum_{m,n} w_m w_n A(mu_m - mu_n, s2_m + s2_n),
  A(mu, s2) = E|N(mu, s2)| (Grimit et al. 2006); summed over target dims. Costs O(M^2) a value.
  """
  means, variances, _, w = _members(means, variances, member_mask)
  to_target = jnp.sum(w * _crps_a(_f32(y) - means, variances), axis=0)
  pair_w = w[:, None] * w[None, :]
  between = _crps_a(means[:, None] - means[None, :], variances[:, None] + variances[None, :])
  return _per_example_sum(to_target - 0.5 * jnp.sum(pair_w * between, axis=(0, 1)))


def mixture_cdf(means: jax.Array, variances: jax.Array, y: jax.Array,
                member_mask: jax.Array | None = None) -> jax.Array:
  """The mixture's CDF at y, F(y) = sum_m w_m Phi((y - mu_m) / s_m): the PIT value, [B(, D)].

  For a calibrated model the PIT values of the test targets are uniform on [0, 1].
  """
  means, variances, _, w = _members(means, variances, member_mask)
  return jnp.sum(w * ndtr((_f32(y) - means) / jnp.sqrt(variances)), axis=0)


def mixture_quantile(means: jax.Array, variances: jax.Array, q: float | Sequence[float],
                     member_mask: jax.Array | None = None) -> jax.Array:
  """The mixture's q-quantile, F^-1(q) for q in (0, 1), by bisection, [B(, D)]; for a
  sequence of Q levels, [Q, B(, D)] from one bisection (one loop in the program, not Q).

  It lies between the smallest and largest of the included members' own q-quantiles
  (F(x) is a mean of member CDFs, each <= q below all of them and >= q above), which is the
  starting bracket; a fixed number of steps keeps it jittable.
  """
  means, variances, included, w = _members(means, variances, member_mask)
  levels = jnp.asarray(q, jnp.float32).reshape((-1,) + (1,) * means.ndim)  # [Q, 1, 1(, 1)]
  scale = jnp.sqrt(variances)
  member_q = means + scale * ndtri(levels)  # [Q, M, B(, D)]
  lo = jnp.min(jnp.where(included, member_q, jnp.inf), axis=1)
  hi = jnp.max(jnp.where(included, member_q, -jnp.inf), axis=1)
  levels = levels[:, 0]  # [Q, 1(, 1)] against the brackets [Q, B(, D)]

  def step(_, bracket):
    lo, hi = bracket
    mid = 0.5 * (lo + hi)
    below = jnp.sum(w * ndtr((mid[:, None] - means) / scale), axis=1) < levels  # F(mid) < q
    return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

  lo, hi = jax.lax.fori_loop(0, _BISECTION_STEPS, step, (lo, hi))
  out = 0.5 * (lo + hi)
  return out if np.ndim(q) else out[0]


def mixture_central_interval(means: jax.Array, variances: jax.Array,
                             level: float | Sequence[float],
                             member_mask: jax.Array | None = None
                             ) -> tuple[jax.Array, jax.Array]:
  """The mixture's central interval [F^-1((1 - level) / 2), F^-1((1 + level) / 2)], [B(, D)];
  for a sequence of L levels, each bound [L, B(, D)] (all 2L quantiles in one bisection).

  Example:
    >>> lo, hi = mixture_central_interval(jnp.zeros((1, 1)), jnp.ones((1, 1)), 0.95)
    >>> round(float(hi[0]), 4)
    1.96
  """
  levels = np.asarray(level, np.float64)
  bounds = mixture_quantile(means, variances, np.concatenate(
      [np.ravel((1 - levels) / 2), np.ravel((1 + levels) / 2)]), member_mask)
  lo, hi = bounds[:levels.size], bounds[levels.size:]
  return (lo, hi) if levels.ndim else (lo[0], hi[0])


def gaussian_central_interval(mean: jax.Array, var: jax.Array, level: float | Sequence[float]
                              ) -> tuple[jax.Array, jax.Array]:
  """A single Gaussian's central interval, mean -/+ s Phi^-1((1 + level) / 2) (per member);
  for a sequence of L levels, each bound with a leading axis L."""
  z = ndtri(jnp.asarray((1 + np.asarray(level, np.float64)) / 2, jnp.float32))
  half = jnp.sqrt(_f32(var)) * z.reshape(z.shape + (1,) * jnp.ndim(var))
  return _f32(mean) - half, _f32(mean) + half


def pit_below(pit: jax.Array, levels=CALIBRATION_LEVELS) -> jax.Array:
  """[B, L]: the share of an example's PIT values (over target dims) that are <= each level.

  Additive over examples: the summed rows over n examples divided by n are the observed
  frequencies that the calibration error compares with the levels (tasks/regression_eval.py).
  """
  pit = _f32(pit)
  pit = pit.reshape(pit.shape[0], -1) if pit.ndim > 1 else pit[:, None]
  below = pit[:, :, None] <= _f32(levels)  # [B, D, L]
  return below.astype(jnp.float32).mean(axis=1)
