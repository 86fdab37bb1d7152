"""Regression: every member predicts a Gaussian per example and target dimension; the
ensemble is the uniform mixture of the included members' Gaussians.

Two tasks (config.task):
  'regression'                  heteroscedastic. The model gives 2D outputs per example: D
                                means, then D raw variances; variance = softplus(raw) + a floor
                                (VARIANCE_FLOOR), in float32. Trained on the Gaussian NLL.
  'regression_homoscedastic'    the model gives D means only and trains on the MSE; every
                                prediction has the same noise variance (one per target dim).

The homoscedastic noise level is a constant of the task, not a model parameter: the model is
the user's, and a learned noise scalar would have to be one of its params (or an output that
the network could make input-dependent, which would no longer be homoscedastic). With the
variance fixed, the Gaussian NLL's gradient in the means is the MSE's up to a positive factor,
so MSE training is maximum likelihood for the means, and the maximum-likelihood noise given
those means is the mean squared training residual. The
residuals are not available inside eval_batch, so the task takes the variance as an argument:
the default, 1.0, is in STANDARDISED target units, where it is the variance of predicting the
training mean (a deliberately conservative level, never overconfident). Training fits it
after the last step, one level per member on the validation split (else the training split),
and builds the task again with `regression_homoscedastic(noise_variance=fitted)`
(evaluators/noise.py); Ensemble.load predicts with the fitted levels.

Targets are [N] (D = 1) or [N, D], integer or floating point, and are never cast to integers;
NaN, infinite or non-numeric targets are refused (check_targets).

Metrics (finalize; per member and for the ensemble; n examples, D target dims):
  rmse              sqrt of the mean over examples AND target dims of the squared error of
                    the mean (the ensemble's mean is the mixture's, the mean of the members').
  nll               mean over examples of -log p(y), the joint density over the D dims.
  crps              mean over examples of the CRPS summed over target dims.
  coverage_{50,90,95}, width_{50,90,95}
                    the share of targets inside the central interval at that level (averaged
                    over dims) and its mean width; the ensemble's interval is the mixture's.
  calibration_error quantile calibration error of the PIT values (regression_eval.py).
  aleatoric, epistemic (ensemble only) mean over examples of the mixture's variance parts,
                    summed over target dims.
All are in the units the model predicts. A trainer that standardises targets converts them
with `to_original_units` (results) or, exactly for any per-dim scales, `sums_to_original_units`
(the summed sums, before finalize).

The sums keep a trailing D axis for the quantities that carry units (squared error, CRPS,
width, variances), so that rescaling them per target dim is exact; NLL is joint over dims
(the mixture's density does not factor over them) and shifts by sum_d log(y_std_d).
"""

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dist_ens.errors import ConfigError
from dist_ens.eval import regression as reg
from dist_ens.tasks.regression_eval import (RegressionEval, _as_matrix, finalize,
                                             gaussian_eval_batch, ood_metrics,
                                             sums_to_original_units)
from dist_ens.tasks.task import Loss, Task

# Added to softplus(raw): keeps log(variance) and 1/variance finite in float32 when the raw
# output runs very negative (softplus underflows to 0 below about -100).
VARIANCE_FLOOR = 1e-6

# Percent labels of eval.regression's interval levels: 0.5 -> 50 ('coverage_50').
def split_outputs(outputs: jax.Array, squeeze: bool = True) -> tuple[jax.Array, jax.Array]:
  """A heteroscedastic model's outputs [..., 2D] -> (mean, variance), each [..., D] float32.

  variance = softplus(raw) + VARIANCE_FLOOR. softplus rather than exp: it grows linearly, so
  a large raw output cannot overflow the variance or blow up the NLL's gradient.

  Example:
    >>> mean, var = split_outputs(jnp.array([[1.0, -1e4]]))
    >>> mean.shape, round(float(var[0]), 9)
    ((1,), 1e-06)

  Args:
    outputs: [..., 2D] means then raw variances (any float dtype).
    squeeze: with D = 1, drop the last axis ([B, 2] -> [B]), the shape of [B] targets.

  Returns:
    (mean, variance) [..., D], or [...] with squeeze and D = 1.
  """
  outputs = jnp.asarray(outputs, jnp.float32)
  if outputs.shape[-1] % 2:
    raise ValueError(f'split_outputs(): a regression model gives 2D outputs (D means, D raw '
                     f'variances); got {outputs.shape[-1]}, an odd number.')
  d = outputs.shape[-1] // 2
  mean, variance = outputs[..., :d], jax.nn.softplus(outputs[..., d:]) + VARIANCE_FLOOR
  if squeeze and d == 1:
    return mean[..., 0], variance[..., 0]
  return mean, variance


def _gaussians(outputs: jax.Array, noise_variance: Any = None) -> tuple[jax.Array, jax.Array]:
  """(mean, variance) [..., D]: split_outputs, or the D means with the fixed noise variance
  of the homoscedastic task (noise_variance not None: a scalar, [D], or [M, D] per member
  for members' outputs [M, B, D])."""
  if noise_variance is None:
    return split_outputs(outputs, squeeze=False)
  mean = jnp.asarray(outputs, jnp.float32)
  variance = jnp.asarray(noise_variance, jnp.float32)
  if variance.ndim == 2:  # One level per member, [M, D]: outputs are [M, B, D].
    variance = variance[:, None, :]
  return mean, jnp.broadcast_to(variance, mean.shape)


def gaussian_nll_loss(outputs: jax.Array, targets: jax.Array,
                      hparams: Mapping[str, Any] | None = None) -> jax.Array:
  """The heteroscedastic task's loss: the mean over the batch of the Gaussian NLL (summed
  over target dims) of split_outputs(outputs). `hparams` is unused (the Loss signature)."""
  del hparams
  mean, variance = split_outputs(outputs, squeeze=False)
  return jnp.mean(reg.gaussian_nll(mean, variance, _as_matrix(targets, mean.shape[-1])))


def mse_loss(outputs: jax.Array, targets: jax.Array,
             hparams: Mapping[str, Any] | None = None) -> jax.Array:
  """The homoscedastic task's loss: the mean squared error over examples and target dims of
  the D predicted means. `hparams` is unused (the Loss signature)."""
  del hparams
  mean = jnp.asarray(outputs, jnp.float32)
  return jnp.mean(jnp.square(mean - _as_matrix(targets, mean.shape[-1])))


def _batch_mse(noise_variance: Any):
  def batch_metrics(outputs: jax.Array, targets: jax.Array) -> dict[str, jax.Array]:
    # 'mse', not 'rmse': the trainer averages batch metrics over micro-batches and steps,
    # which is exact for a mean squared error (equal-sized batches) and biased low for a
    # root (Jensen); sqrt of the logged mean is the RMSE.
    # Outputs may carry head axes ([B, H, 2D]: MIMO), as classification's accuracy allows:
    # every head is scored against the targets.
    mean = (jnp.asarray(outputs, jnp.float32) if noise_variance is not None
            else split_outputs(outputs, squeeze=False)[0])
    y = _as_matrix(targets, mean.shape[-1])
    y = y.reshape(y.shape[:1] + (1,) * (mean.ndim - 2) + y.shape[1:])
    return {'mse': jnp.mean(jnp.square(mean - y))}

  return batch_metrics


def dataset_target_dim(dataset: Any) -> int:
  """D, the number of target dims of `dataset`: 1 for targets [N], D for [N, D].

  Read from the train split's y, else the test split's (a Dataset holds its test split in
  memory). A streamed source with neither (e.g. a TFDS reader) gives 1: scalar targets, the
  common case; pass regression(target_dim=D) for more.
  """
  for split in (getattr(dataset, 'train', None), getattr(dataset, 'test', None)):
    y = getattr(split, 'y', None)
    if y is not None:
      shape = np.shape(y)
      return 1 if len(shape) <= 1 else int(shape[1])
  return 1


def check_targets(y: np.ndarray, dim: int | None, what: str) -> None:
  """Raises ConfigError (one line, naming `what`) for targets a regression cannot train on.

  Accepted: integer or floating point, shape [N] (dim 1) or [N, dim], every value finite.
  Nothing is cast: integers stay integers here (the loss reads them as float32).

  Args:
    y: the targets.
    dim: the target dims the model predicts (None: not checked).
    what: names the targets in the message, e.g. "dataset 'uci:energy' (train)".
  """
  y = np.asarray(y)
  if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
    raise ConfigError(f'{what}: regression targets must be integer or floating-point numbers, '
                      f'got dtype {y.dtype}.')
  if y.ndim not in (1, 2):
    raise ConfigError(f'{what}: regression targets must have shape [N] or [N, D], got {y.shape}.')
  got = 1 if y.ndim == 1 else y.shape[1]
  if dim is not None and got != dim:
    raise ConfigError(f'{what}: targets of shape {y.shape} have {got} target dim(s) but the '
                      f'model predicts {dim}.')
  if np.issubdtype(y.dtype, np.floating):
    bad = ~np.isfinite(y)
    if bad.any():
      index = tuple(int(i) for i in np.argwhere(bad)[0])
      at = index[0] if len(index) == 1 else index
      raise ConfigError(f'{what}: {int(bad.sum())} regression target(s) are NaN or infinite '
                        f'(the first at index {at}: {y[index]}); targets must be finite.')


# ---------------------------------------------------------------------------------------------
# Evaluation: additive sums on device, per-example values for OOD ranking.


def _eval_batch(noise_variance: Any):
  def eval_batch(member_outputs: jax.Array, targets: jax.Array, mask: jax.Array,
                 member_mask: jax.Array | None = None) -> RegressionEval:
    """gaussian_eval_batch of the members' outputs [M, B, 2D] (or [M, B, D] homoscedastic)."""
    means, variances = _gaussians(member_outputs, noise_variance)
    return gaussian_eval_batch(means, variances, targets, mask, member_mask)

  return eval_batch


def predictive(member_outputs: jax.Array, member_mask: jax.Array | None = None,
               noise_variance: Any = None, squeeze: bool = True) -> dict[str, jax.Array]:
  """The ensemble's predictive distribution from the members' outputs.

  Args:
    member_outputs: [M, N, 2D] (heteroscedastic) or [M, N, D] with noise_variance.
    member_mask: [M] bool, the members in the mixture (None = all).
    noise_variance: None for split_outputs, else the homoscedastic task's variance.
    squeeze: with D = 1, give [N] / [M, N] rather than [N, 1] / [M, N, 1].

  Returns:
    {'mean', 'variance' (total: aleatoric + epistemic), 'aleatoric' (mean of the members'
     variances), 'epistemic' (variance of their means)}: [N(, D)]; 'member_mean' and
    'member_variance': [M, N(, D)]. float32 jax arrays.
  """
  means, variances = _gaussians(member_outputs, noise_variance)
  moments = reg.mixture_moments(means, variances, member_mask)
  out = {'mean': moments.mean, 'variance': moments.total, 'aleatoric': moments.aleatoric,
         'epistemic': moments.epistemic, 'member_mean': means, 'member_variance': variances}
  if squeeze and means.shape[-1] == 1:
    out = {k: v[..., 0] for k, v in out.items()}
  return out


def combine(member_outputs: jax.Array, member_mask: jax.Array, means_only: bool = False,
            noise_variance: Any = None) -> jax.Array:
  """The ensemble's outputs in a member's format ([M, B, K] -> [B, K]): the mixture's mean,
  and (heteroscedastic) the raw output whose split_outputs variance is the mixture's total
  variance (the moment-matched Gaussian)."""
  means, variances = _gaussians(member_outputs, noise_variance)
  moments = reg.mixture_moments(means, variances, member_mask)
  if means_only:
    return moments.mean
  return jnp.concatenate([moments.mean, _raw_variance(moments.total)], axis=-1)


def _raw_variance(variance: jax.Array) -> jax.Array:
  """The raw output whose split_outputs variance is `variance` (softplus inverted; above
  20 softplus is the identity to float32's precision)."""
  excess = jnp.maximum(variance - VARIANCE_FLOOR, 1e-30)
  return jnp.where(excess > 20.0, excess, jnp.log(jnp.expm1(jnp.minimum(excess, 20.0))))


def reframe(outputs: jax.Array, scale: Any, shift: Any, means_only: bool = False) -> jax.Array:
  """Outputs [..., 2D] (or [..., D] means_only) predicting targets t -> the outputs that
  predict scale * t + shift (scale, shift [D]): means scale * mean + shift, variances
  scale^2 * variance, raw variances again such that split_outputs gives them."""
  outputs = jnp.asarray(outputs, jnp.float32)
  if means_only:
    return outputs * scale + shift
  mean, variance = split_outputs(outputs, squeeze=False)
  return jnp.concatenate([mean * scale + shift, _raw_variance(variance * jnp.square(scale))],
                         axis=-1)


def log_likelihood(member_outputs: np.ndarray, targets: np.ndarray,
                   noise_variance: Any = None) -> np.ndarray:
  """[M, N] float64 each member's Gaussian log-density of each example's targets (joint
  over the D dims), from outputs [M, N, 2D] (or [M, N, D] with the homoscedastic
  noise_variance) held on the host."""
  means, variances = (np.asarray(a, np.float64) for a in _gaussians(member_outputs,
                                                                      noise_variance))
  y = np.asarray(targets, np.float64).reshape(means.shape[1:])
  log_density = -0.5 * (np.log(2 * np.pi * variances) + np.square(y - means) / variances)
  return np.sum(log_density, axis=-1)


SELECT_METRICS = {'nll': False, 'rmse': False, 'crps': False}


def _gaussian_task(name: str, target_dim: int | None, means_only: bool, loss: Loss,
                   noise_variance: Any) -> Task:
  """A Gaussian regression task: the model gives D means (means_only; the variance is
  `noise_variance`) or D means and D raw variances."""
  dim = lambda dataset: target_dim or dataset_target_dim(dataset)
  return Task(
      name=name,
      output_units=lambda dataset: dim(dataset) * (1 if means_only else 2),
      loss=loss,
      batch_metrics=_batch_mse(noise_variance),
      check_targets=lambda y, dataset, what: check_targets(y, dim(dataset), what),
      eval_batch=_eval_batch(noise_variance),
      finalize=finalize,
      ood_metrics=ood_metrics,
      select_metrics=SELECT_METRICS,
      unscale=sums_to_original_units,
      reframe=functools.partial(reframe, means_only=means_only),
      predict=functools.partial(predictive, noise_variance=noise_variance),
      combine=functools.partial(combine, means_only=means_only, noise_variance=noise_variance),
      log_likelihood=functools.partial(log_likelihood, noise_variance=noise_variance),
      # The homoscedastic noise is one fitted level per trained member (evaluators/noise.py).
      any_members=not means_only)


def regression(target_dim: int | None = None) -> Task:
  """The heteroscedastic Gaussian task (config.task = 'regression'; see the module doc).

  Args:
    target_dim: D; None reads it from the dataset's targets (dataset_target_dim).
  """
  return _gaussian_task('regression', target_dim, False, gaussian_nll_loss, None)


def regression_homoscedastic(target_dim: int | None = None,
                             noise_variance: float | Sequence[float] = 1.0) -> Task:
  """The homoscedastic task (config.task = 'regression_homoscedastic'): D means, MSE loss.

  Args:
    target_dim: D; None reads it from the dataset's targets.
    noise_variance: every prediction's variance, a scalar, one per target dim or [M, D]
      (one per member: what training fits, evaluators/noise.py), in the units the model
      predicts (1.0: the variance of standardised targets; see the module doc).
  """
  variance = np.asarray(noise_variance, np.float32)
  if variance.ndim > 2 or not np.all(np.isfinite(variance) & (variance > 0)):
    raise ConfigError(f'regression_homoscedastic(): noise_variance={noise_variance!r} must be '
                      'a positive number, one per target dim, or [members, dims].')
  return _gaussian_task('regression_homoscedastic', target_dim, True, mse_loss, variance)
