"""The regression task's evaluation: additive sums of a batch (exact under padding and
excluded members), their final metrics, OOD scores by epistemic variance, and the
conversion of standardised results back to the targets' units (see tasks/regression.py)."""

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple
import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtr
from dist_ens.eval import ranks
from dist_ens.eval import regression as reg

_LEVELS = tuple((level, round(level * 100)) for level in reg.INTERVAL_LEVELS)



def _as_matrix(y: jax.Array, d: int) -> jax.Array:
  """Targets [B] or [B, D] -> float32 [B, D] (D = 1 for [B]), checked against the outputs' D.

  Checked at trace time: [B, 1] means would otherwise broadcast silently against [B, D].
  """
  y = jnp.asarray(y, jnp.float32)
  y = y[:, None] if y.ndim == 1 else y
  if y.ndim != 2 or y.shape[1] != d:
    raise ValueError(f'regression targets of shape {y.shape} do not match a model that '
                     f'predicts {d} target dim(s); targets must be [B] (D = 1) or [B, {d}].')
  return y

class RegressionEval(NamedTuple):
  """What eval_batch returns for one batch: additive sums and per-example values."""
  sums: dict[str, jax.Array]
  examples: 'RegressionExamples'


class RegressionExamples(NamedTuple):
  """Per-example values for OOD ranking; the last axis is the example axis B.

  Variances are summed over target dims (a scalar score per example).
  """
  member_variance: Any  # [M, B] each member's own predicted variance
  aleatoric: Any  # [B] mean of the included members' variances
  epistemic: Any  # [B] variance of the included members' means
  total: Any  # [B] aleatoric + epistemic, the mixture's variance


# ---------------------------------------------------------------------------------------------
# Outputs and targets.


def _masked_sum(x: jax.Array, mask: jax.Array, axis: int) -> jax.Array:
  """Sum over the example axis `axis` of x, padding rows (mask False) set to exactly zero.

  jnp.where, not a product: a NaN or inf on a padding row would survive 0 * NaN.
  """
  shape = [1] * x.ndim
  shape[axis] = mask.shape[0]
  return jnp.sum(jnp.where(mask.reshape(shape), x, 0.0), axis=axis)


def _member_sums(means: jax.Array, variances: jax.Array, y: jax.Array,
                 mask: jax.Array) -> dict[str, jax.Array]:
  """Each member's own sums ('member_*'): means, variances [M, B, D], y [B, D]."""
  y_m = jnp.broadcast_to(y, means.shape)
  nll = jax.vmap(reg.gaussian_nll, in_axes=(0, 0, None))(means, variances, y)  # [M, B]
  # Flattened to [M*B*D] so gaussian_crps keeps every dim apart (it sums over a second axis).
  crps = reg.gaussian_crps(means.reshape(-1), variances.reshape(-1), y_m.reshape(-1))
  pit = ndtr((y_m - means) / jnp.sqrt(variances))  # [M, B, D]
  sums = {
      'member_sq_err': _masked_sum(jnp.square(y_m - means), mask, 1),  # [M, D]
      'member_nll': _masked_sum(nll, mask, 1),  # [M]
      'member_crps': _masked_sum(crps.reshape(means.shape), mask, 1),  # [M, D]
      'member_pit_below': _masked_sum(jax.vmap(reg.pit_below)(pit), mask, 1),  # [M, L]
  }
  bounds = reg.gaussian_central_interval(means, variances, reg.INTERVAL_LEVELS)  # [L, M, B, D]
  for (_, pct), lo, hi in zip(_LEVELS, *bounds):
    covered = ((lo <= y_m) & (y_m <= hi)).astype(jnp.float32).mean(axis=-1)  # [M, B]
    sums[f'member_cover_{pct}'] = _masked_sum(covered, mask, 1)
    sums[f'member_width_{pct}'] = _masked_sum(hi - lo, mask, 1)  # [M, D]
  return sums


def _ensemble_sums(means: jax.Array, variances: jax.Array, y: jax.Array, mask: jax.Array,
                   member_mask: jax.Array, moments: reg.MixtureMoments
                   ) -> dict[str, jax.Array]:
  """The uniform mixture's sums ('ensemble_*') over the members in member_mask."""
  num_members = means.shape[0]
  nll = reg.mixture_nll(means, variances, y, member_mask)  # [B], joint over dims
  crps = reg.mixture_crps(means.reshape(num_members, -1), variances.reshape(num_members, -1),
                          y.reshape(-1), member_mask).reshape(y.shape)  # [B, D]
  pit = reg.mixture_cdf(means, variances, y, member_mask)  # [B, D]
  sums = {
      'ensemble_sq_err': _masked_sum(jnp.square(y - moments.mean), mask, 0),  # [D]
      'ensemble_nll': _masked_sum(nll, mask, 0),
      'ensemble_crps': _masked_sum(crps, mask, 0),  # [D]
      'ensemble_pit_below': _masked_sum(reg.pit_below(pit), mask, 0),  # [L]
      'ensemble_aleatoric': _masked_sum(moments.aleatoric, mask, 0),  # [D]
      'ensemble_epistemic': _masked_sum(moments.epistemic, mask, 0),  # [D]
  }
  # Every level's interval from one bisection: one loop in the program, not one a level.
  bounds = reg.mixture_central_interval(means, variances, reg.INTERVAL_LEVELS, member_mask)
  for (_, pct), lo, hi in zip(_LEVELS, *bounds):
    covered = ((lo <= y) & (y <= hi)).astype(jnp.float32).mean(axis=-1)  # [B]
    sums[f'ensemble_cover_{pct}'] = _masked_sum(covered, mask, 0)
    sums[f'ensemble_width_{pct}'] = _masked_sum(hi - lo, mask, 0)  # [D]
  return sums


def gaussian_eval_batch(means: jax.Array, variances: jax.Array, targets: jax.Array,
                        mask: jax.Array, member_mask: jax.Array | None = None
                        ) -> RegressionEval:
  """Additive sums and per-example values of members' Gaussians on one batch (jittable).

  Args:
    means, variances: [M, B, D] float32, each member's Gaussian per example and dim.
    targets: [B] or [B, D].
    mask: [B] bool; False marks padding, which adds exactly zero to every sum (its values,
      NaN included, never reach them) and holds arbitrary values in `examples`.
    member_mask: [M] bool, the members in the ensemble (None = all). Excluded members keep
      their own 'member_*' sums but leave the mixture (eval.regression replaces them).

  Returns:
    RegressionEval. `sums` (float32): 'count' []; per member 'member_sq_err' [M, D],
    'member_nll' [M], 'member_crps' [M, D], 'member_cover_{50,90,95}' [M],
    'member_width_{50,90,95}' [M, D], 'member_pit_below' [M, L] (L = CALIBRATION_LEVELS);
    the same 'ensemble_*' without the M axis, plus 'ensemble_aleatoric' and
    'ensemble_epistemic' [D]. `examples`: RegressionExamples.
  """
  means, variances = jnp.asarray(means, jnp.float32), jnp.asarray(variances, jnp.float32)
  y = _as_matrix(targets, means.shape[-1])
  mask = jnp.asarray(mask, bool)
  if member_mask is None:
    member_mask = jnp.ones(means.shape[:1], bool)
  member_mask = jnp.asarray(member_mask, bool)
  moments = reg.mixture_moments(means, variances, member_mask)
  sums = {'count': jnp.sum(mask.astype(jnp.float32)),
          **_member_sums(means, variances, y, mask),
          **_ensemble_sums(means, variances, y, mask, member_mask, moments)}
  examples = RegressionExamples(
      member_variance=variances.sum(axis=-1), aleatoric=moments.aleatoric.sum(axis=-1),
      epistemic=moments.epistemic.sum(axis=-1), total=moments.total.sum(axis=-1))
  return RegressionEval(sums, examples)


def _calibration_error(pit_below: np.ndarray, count: float) -> np.ndarray:
  """Mean over levels p of (p - observed_p)^2, along the last (level) axis: Kuleshov et al.
  (2018)'s quantile calibration error with equal weights (the squared variant), in numpy."""
  levels = np.asarray(reg.CALIBRATION_LEVELS, np.float64)
  return np.mean(np.square(levels - pit_below / count), axis=-1)


def _scope_metrics(sums: Mapping[str, np.ndarray], prefix: str, count: float) -> dict[str, Any]:
  """Final metrics of one scope ('member': arrays [M]; 'ensemble': 0-d) from the sums."""
  s = {k[len(prefix) + 1:]: np.asarray(v, np.float64) for k, v in sums.items()
       if k.startswith(prefix + '_')}
  dims = s['sq_err'].shape[-1]
  out = {'rmse': np.sqrt(s['sq_err'].sum(-1) / (count * dims)),
         'nll': s['nll'] / count,
         'crps': s['crps'].sum(-1) / count}
  for _, pct in _LEVELS:
    out[f'coverage_{pct}'] = s[f'cover_{pct}'] / count
    out[f'width_{pct}'] = s[f'width_{pct}'].mean(-1) / count
  out['calibration_error'] = _calibration_error(s['pit_below'], count)
  if prefix == 'ensemble':
    out['aleatoric'] = s['aleatoric'].sum(-1) / count
    out['epistemic'] = s['epistemic'].sum(-1) / count
  return out


def finalize(sums: Mapping[str, Any], examples: Any = None) -> dict[str, Any]:
  """The final metrics (see the module doc) from a split's summed `sums`.

  Args:
    sums: eval_batch's sums, added over the split's batches.
    examples: unused (every metric here is a ratio of sums); the Task signature.

  Returns:
    {'members': {metric: list of M floats}, 'ensemble': {metric: float}} (JSON-able),
    metrics 'rmse', 'nll', 'crps', 'coverage_{50,90,95}', 'width_{50,90,95}',
    'calibration_error', and for the ensemble also 'aleatoric' and 'epistemic'.
  """
  del examples
  count = float(np.asarray(sums['count']))
  members = _scope_metrics(sums, 'member', count)
  ensemble = _scope_metrics(sums, 'ensemble', count)
  return {'members': {k: np.asarray(v).tolist() for k, v in members.items()},
          'ensemble': {k: float(v) for k, v in ensemble.items()}}


def ood_metrics(in_examples: Any, out_examples: Any) -> dict[str, Any]:
  """AUROC/AUPR of telling OOD from in-distribution examples, OOD the positive class.

  The ensemble's score is its epistemic variance (the members' disagreement), and also its
  total variance; a single member has no epistemic part, so each member is scored by its own
  predicted variance.

  Args:
    in_examples, out_examples: RegressionExamples (or tuples in its field order) of the two
      splits, padding removed.

  Returns:
    {'members': {'auroc_variance', 'aupr_variance': lists of M floats},
     'ensemble': {'auroc_epistemic', 'aupr_epistemic', 'auroc_total', 'aupr_total',
     'epistemic_in', 'epistemic_out'}: floats}.
  """
  a, b = RegressionExamples(*in_examples), RegressionExamples(*out_examples)
  members_in, members_out = np.asarray(a.member_variance), np.asarray(b.member_variance)
  epi_in, epi_out = np.asarray(a.epistemic), np.asarray(b.epistemic)
  total_in, total_out = np.asarray(a.total), np.asarray(b.total)
  return {
      'members': {
          'auroc_variance': [ranks.auroc(i, o) for i, o in zip(members_in, members_out)],
          'aupr_variance': [ranks.aupr(i, o) for i, o in zip(members_in, members_out)],
      },
      'ensemble': {
          'auroc_epistemic': ranks.auroc(epi_in, epi_out),
          'aupr_epistemic': ranks.aupr(epi_in, epi_out),
          'auroc_total': ranks.auroc(total_in, total_out),
          'aupr_total': ranks.aupr(total_in, total_out),
          'epistemic_in': float(np.mean(epi_in)), 'epistemic_out': float(np.mean(epi_out)),
      },
  }


# ---------------------------------------------------------------------------------------------
# Units: metrics of a model trained on standardised targets, in the data's original units.


def _scales(y_std: Any) -> np.ndarray:
  scales = np.atleast_1d(np.asarray(y_std, np.float64))
  if scales.ndim != 1 or not np.all(np.isfinite(scales) & (scales > 0)):
    raise ValueError(f'y_std must be a positive scale or one per target dim, got {y_std!r}.')
  return scales


def to_original_units(results: Mapping[str, Any], y_std: float | Sequence[float]
                      ) -> dict[str, Any]:
  """finalize's results of standardised targets (y - y_mean) / y_std, in the original units.

  RMSE, CRPS and interval widths scale by y_std, the aleatoric and epistemic variances by
  y_std^2, and the NLL (a density over the D dims) shifts by sum_d log(y_std_d); coverage and
  calibration error do not change. Exact when every dim has the same scale; results pool the
  dims, so different per-dim scales need the sums (sums_to_original_units, before finalize).

  Example:
    >>> r = {'members': {'rmse': [0.5], 'nll': [1.0]}, 'ensemble': {'rmse': 0.5, 'nll': 1.0}}
    >>> to_original_units(r, 2.0)['ensemble']
    {'rmse': 1.0, 'nll': 1.6931471805599454}

  Args:
    results: finalize's {'members': ..., 'ensemble': ...}.
    y_std: the training targets' std: a float for targets [N], else one per target dim (D
      values; the NLL shift counts them, so pass [s] * D for a common scale s).

  Returns:
    A new results dict; the input is not changed.
  """
  scales = _scales(y_std)
  if np.ptp(scales) > 0:
    raise ValueError('to_original_units(): per-dim scales differ; pooled results cannot be '
                     'rescaled exactly. Use sums_to_original_units on the summed sums.')
  scale, shift = scales[0], float(np.sum(np.log(scales)))

  def convert(name: str, value: Any) -> Any:
    if name in ('rmse', 'crps') or name.startswith('width_'):
      factor, offset = scale, 0.0
    elif name in ('aleatoric', 'epistemic'):
      factor, offset = scale ** 2, 0.0
    elif name == 'nll':
      factor, offset = 1.0, shift
    else:
      return value
    array = np.asarray(value, np.float64) * factor + offset
    return array.tolist() if isinstance(value, list) else float(array)

  return {scope: {k: convert(k, v) for k, v in metrics.items()}
          for scope, metrics in results.items()}


def sums_to_original_units(sums: Mapping[str, Any], y_std: float | Sequence[float]
                           ) -> dict[str, np.ndarray]:
  """eval_batch's summed sums of standardised targets, in the original units (exact).

  The unit-carrying sums keep their target dim (last axis), so each dim gets its own scale:
  squared errors and variances by y_std_d^2, CRPS and widths by y_std_d; the NLL sums add
  count * sum_d log(y_std_d). finalize of the result gives metrics in the original units.

  Args:
    sums: the split's sums (eval_batch's, added over batches).
    y_std: the targets' std, a scalar (every dim) or one per target dim.
  """
  scales = np.broadcast_to(_scales(y_std), np.shape(sums['ensemble_sq_err']))
  shift = float(np.asarray(sums['count'])) * float(np.sum(np.log(scales)))
  out = {}
  for name, value in sums.items():
    value = np.asarray(value, np.float64)
    if name.endswith(('_sq_err', '_aleatoric', '_epistemic')):
      value = value * scales ** 2
    elif name.endswith('_crps') or '_width_' in name:
      value = value * scales
    elif name.endswith('_nll'):
      value = value + shift
    out[name] = value
  return out


# ---------------------------------------------------------------------------------------------
# Prediction and the tasks.
