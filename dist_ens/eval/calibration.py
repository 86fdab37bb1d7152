"""Post-hoc temperature scaling (Guo et al. 2017), fitted on a validation split.

A predictor's log-probabilities z [N, C] (or logits: the same up to a constant per
example) become softmax(z / T). T > 1 softens over-confident predictions, T < 1
sharpens under-confident ones; the argmax, and so accuracy, is unchanged.

T is fitted by minimising the validation NLL
  f(beta) = mean_n [logsumexp_c(beta z_nc) - beta z_n,y_n],   beta = 1 / T,
which is convex in beta (logsumexp of a linear function; f'' = mean_n Var_p[z] >= 0),
so it has one minimum and a safeguarded Newton iteration finds it: a grid over
log T in [T_MIN, T_MAX] brackets the minimum, then Newton steps in beta (bisection
whenever a step leaves the bracket) refine it. Everything is float32 and a fixed
number of steps: the same logits give the same T bit for bit. A minimum outside
[T_MIN, T_MAX] (e.g. every validation example right with a wide margin) is clipped
to the nearer end.

Members and the ensemble are scaled apart: each member m by its own T_m fitted on
its log-probabilities, and the ensemble by one T fitted on log p_bar, the log of the
members' mean probabilities (calibrate after pooling, which Rahaman & Thiery 2021
and Wu & Gales 2021 find better for ensembles than pooling calibrated members;
dist_ens.evaluators.temperature reports both).
"""

import jax
import jax.numpy as jnp
import numpy as np

T_MIN, T_MAX = 0.05, 20.0
_GRID = 64  # points of the bracketing grid over log T
_NEWTON_STEPS = 30


def nll_at(beta: jax.Array, log_probs: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean NLL of softmax(beta * log_probs) against labels ([N, C], [N])."""
  z = jnp.asarray(log_probs, jnp.float32)
  z_label = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
  return jnp.mean(jax.nn.logsumexp(beta * z, axis=-1) - beta * z_label)


def _slope_curvature(beta, z, z_label):
  """f'(beta) = mean(E_p[z] - z_y) and f''(beta) = mean(Var_p[z]), p = softmax(beta z)."""
  p = jax.nn.softmax(beta * z, axis=-1)
  # p is exactly 0 where z is -inf (a class of probability 0): count it as 0, not NaN.
  pz = jnp.where(p > 0, p * z, 0.0)
  mean_z = jnp.sum(pz, axis=-1)
  var_z = jnp.sum(jnp.where(p > 0, pz * z, 0.0), axis=-1) - mean_z ** 2
  return jnp.mean(mean_z - z_label), jnp.mean(jnp.maximum(var_z, 0.0))


def _fit_beta(log_probs: jax.Array, labels: jax.Array) -> jax.Array:
  """The NLL-minimising inverse temperature of one predictor (see the module doc)."""
  z = jnp.asarray(log_probs, jnp.float32)
  labels = jnp.asarray(labels, jnp.int32)
  z_label = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
  betas = jnp.exp(jnp.linspace(-jnp.log(T_MAX), -jnp.log(T_MIN), _GRID, dtype=jnp.float32))
  values = jax.vmap(lambda b: nll_at(b, z, labels))(betas)
  best = jnp.argmin(values)
  lo = betas[jnp.maximum(best - 1, 0)]
  hi = betas[jnp.minimum(best + 1, _GRID - 1)]

  def newton(_, carry):
    beta, lo, hi = carry
    slope, curve = _slope_curvature(beta, z, z_label)
    # f' is increasing in beta: its sign says which side of the minimum beta is on.
    lo, hi = jnp.where(slope < 0, beta, lo), jnp.where(slope > 0, beta, hi)
    step = beta - slope / curve
    inside = (curve > 0) & (step > lo) & (step < hi)
    return jnp.where(inside, step, 0.5 * (lo + hi)), lo, hi

  beta, _, _ = jax.lax.fori_loop(0, _NEWTON_STEPS, newton, (betas[best], lo, hi))
  # A predictor with a non-finite NLL (a frozen, NaN member) has no temperature.
  return jnp.where(jnp.all(jnp.isfinite(values)), jnp.clip(beta, 1.0 / T_MAX, 1.0 / T_MIN),
                   jnp.nan)


@jax.jit
def fit_temperature(log_probs: jax.Array, labels: jax.Array) -> jax.Array:
  """The temperature T minimising the NLL of softmax(log_probs / T) on (log_probs, labels).

  Example:
    >>> rng = np.random.default_rng(0)
    >>> labels = rng.integers(0, 3, 500)
    >>> logits = 3 * rng.standard_normal((500, 3)) + 2 * np.eye(3)[labels]
    >>> t = float(fit_temperature(logits, labels))  # over-confident logits: T > 1
    >>> t > 1
    True

  Args:
    log_probs: [N, C] log-probabilities or logits of one predictor.
    labels: [N] integer labels.

  Returns:
    A float32 scalar in [T_MIN, T_MAX].
  """
  return 1.0 / _fit_beta(log_probs, labels)


# Members fitted at once: the bracketing grid holds [members, _GRID, N, C] values, so
# all M at once held 1.7 GB at M=1,024 (N=500, C=10) and was slower than chunks.
_MEMBERS_AT_ONCE = 16


@jax.jit
def fit_member_temperatures(log_probs: jax.Array, labels: jax.Array) -> jax.Array:
  """[M] temperatures, one per member, from [M, N, C] log-probabilities (NaN for a
  member with non-finite log-probabilities, e.g. a frozen one). Members are fitted
  _MEMBERS_AT_ONCE at a time: memory does not grow with M."""
  return jax.lax.map(lambda lp: 1.0 / _fit_beta(lp, labels), log_probs,
                     batch_size=_MEMBERS_AT_ONCE)


# Host arrays in, host arrays out, one compiled program each (called eagerly, every array
# operation of log_softmax or logsumexp would compile a program of its own).
_scaled = jax.jit(lambda log_probs, t: jax.nn.log_softmax(log_probs / t, axis=-1))
_pooled = jax.jit(lambda log_probs, log_count: jax.nn.logsumexp(log_probs, axis=0) - log_count)


def scale(log_probs: np.ndarray, temperature: np.ndarray | float) -> np.ndarray:
  """log_softmax(log_probs / T): [..., N, C] with T a scalar or one per leading index."""
  t = np.asarray(temperature, np.float32).reshape(np.shape(temperature) + (1, 1))
  return np.asarray(_scaled(np.asarray(log_probs, np.float32), t))


def normalised(logits: np.ndarray) -> np.ndarray:
  """[..., N, C] logits -> their log-probabilities (log_softmax), float32 numpy."""
  return scale(logits, 1.0)


def pooled_log_probs(log_probs: np.ndarray, member_mask: np.ndarray | None = None) -> np.ndarray:
  """[N, C] log of the mean of the included members' probabilities, from [M, N, C]."""
  mask = np.ones(log_probs.shape[0], bool) if member_mask is None else np.asarray(member_mask)
  log_count = np.log(np.float32(mask.sum()))
  return np.asarray(_pooled(np.asarray(log_probs[mask], np.float32), log_count))
