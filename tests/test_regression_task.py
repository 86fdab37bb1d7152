"""The regression tasks (dist_ens.tasks.regression) against float64 numpy references."""

import functools
import importlib
import json
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from dist_ens.data.sources import Dataset, Split
from dist_ens.errors import ConfigError
from dist_ens.eval.regression import CALIBRATION_LEVELS
from dist_ens.tasks import TASKS, get_task

# The package exports the function `regression`, which shadows the submodule's attribute.
rt = importlib.import_module('dist_ens.tasks.regression')
rt_eval = importlib.import_module('dist_ens.tasks.regression_eval')

FLOOR = rt.VARIANCE_FLOOR

# One task of each kind and one jit of its eval_batch (and of gaussian_eval_batch) for the
# whole file, and the tests' outputs in few shapes (4 members; 32 or 16 examples; 2 target
# dims): each distinct function or shape is a compile of the bisection loops (4 s on a
# CPU), and these are compiled once each.
REGRESSION = rt.regression()
HOMOSCEDASTIC = rt.regression_homoscedastic(noise_variance=[0.5, 2.0])
_jit = functools.cache(jax.jit)


def _outputs(seed, members, batch, dims):
  """Random heteroscedastic outputs [M, B, 2D] float32 and targets [B, D] float32."""
  rng = np.random.default_rng(seed)
  outputs = rng.normal(size=(members, batch, 2 * dims)).astype(np.float32)
  y = rng.normal(size=(batch, dims)).astype(np.float32)
  return outputs, y


def _np_gaussians(outputs):
  """float64 (mean, variance) [M, B, D] of split_outputs, computed independently."""
  outputs = np.asarray(outputs, np.float64)
  d = outputs.shape[-1] // 2
  return outputs[..., :d], np.logaddexp(0.0, outputs[..., d:]) + FLOOR


def _np_density(mean, var, y):
  """Explicit Gaussian densities, the product over the target dims: [..., B]."""
  pdf = np.exp(-0.5 * (y - mean) ** 2 / var) / np.sqrt(2 * np.pi * var)
  return np.prod(pdf, axis=-1)


def _raw_for(variance):
  """The raw output whose softplus(raw) + floor is `variance`."""
  return np.log(np.expm1(np.asarray(variance, np.float64) - FLOOR))


def _dataset(y):
  split = Split(np.zeros((len(y), 3), np.float32), y)
  return Dataset('toy', split, split, 0, (3,))


def _assert_results_close(got, want, rtol, atol):
  assert {s: set(m) for s, m in got.items()} == {s: set(m) for s, m in want.items()}
  for scope in want:
    for name in want[scope]:
      np.testing.assert_allclose(got[scope][name], want[scope][name], rtol=rtol, atol=atol,
                                 err_msg=f'{scope} {name}')


def _evaluate(task, outputs, y, mask=None, member_mask=None):
  mask = np.ones(len(y), bool) if mask is None else mask
  member_mask = np.ones(len(outputs), bool) if member_mask is None else member_mask
  # Jitted: one compile instead of eager op-by-op dispatch of the bisection loops (slow on
  # CPU), and once per task and shape (_jit).
  out = _jit(task.eval_batch)(outputs, y, mask, member_mask)
  return out, task.finalize(jax.device_get(out.sums), out.examples)


@pytest.mark.parametrize('dims', [1, 2])
def test_mixture_nll_equals_numpy_densities(dims):
  outputs, y = _outputs(0, 4, 32, dims)
  targets = y[:, 0] if dims == 1 else y  # [B] targets for D = 1
  _, results = _evaluate(REGRESSION, outputs, targets)
  mean, var = _np_gaussians(outputs)
  member_density = _np_density(mean, var, y.astype(np.float64))  # [M, B]
  expected_ensemble = np.mean(-np.log(member_density.mean(axis=0)))
  expected_members = np.mean(-np.log(member_density), axis=1)
  assert abs(results['ensemble']['nll'] - expected_ensemble) <= 1e-6
  np.testing.assert_allclose(results['members']['nll'], expected_members, rtol=0, atol=1e-6)


def test_mixture_nll_with_excluded_member_equals_numpy():
  outputs, y = _outputs(1, 4, 32, 2)
  member_mask = np.array([True, False, True, False])
  _, results = _evaluate(REGRESSION, outputs, y, member_mask=member_mask)
  mean, var = _np_gaussians(outputs)
  density = _np_density(mean[member_mask], var[member_mask], y.astype(np.float64))
  assert abs(results['ensemble']['nll'] - np.mean(-np.log(density.mean(axis=0)))) <= 1e-6


def test_padding_rows_and_excluded_members_change_nothing():
  task = REGRESSION
  outputs, y = _outputs(2, 4, 16, 2)
  member_mask = np.array([True, False, True, True])
  # The reference: the same members, member 1 finite (and excluded), no padding rows.
  reference, _ = _evaluate(task, outputs, y, member_mask=member_mask)
  # 16 NaN padding rows, and the excluded member 1 NaN.
  pad_out = np.full((4, 16, 4), np.nan, np.float32)
  padded = np.concatenate([outputs, pad_out], axis=1)
  padded[1] = np.nan
  padded_y = np.concatenate([y, np.full((16, 2), np.nan, np.float32)])
  mask = np.arange(32) < 16
  out, _ = _evaluate(task, padded, padded_y, mask, member_mask)
  real = [0, 2, 3]
  for name, want in reference.sums.items():
    got, want = np.asarray(out.sums[name]), np.asarray(want)
    got, want = (got[real], want[real]) if name.startswith('member_') else (got, want)
    assert np.all(np.isfinite(got)), name
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)
  for name, want in reference.examples._asdict().items():
    got, want = np.asarray(getattr(out.examples, name))[..., :16], np.asarray(want)
    got, want = (got[real], want[real]) if name.startswith('member_') else (got, want)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)


def _evaluate_in_batches(task, outputs, y, batch=32):
  """_evaluate's results for any number of examples, from their batches' summed sums (the
  sums are additive: test_sums_of_half_batches_add_up_to_the_whole). Batches of 32 are the
  shapes the file's other tests compile already."""
  sums = None
  for start in range(0, len(y), batch):
    out, _ = _evaluate(task, outputs[:, start:start + batch], y[start:start + batch])
    part = jax.device_get(out.sums)
    sums = part if sums is None else {k: sums[k] + v for k, v in part.items()}
  return task.finalize(sums, None)


def _np_mixture_quantile(mean, var, u):
  """float64 numpy: the uniform mixture's u-quantile, per example and dim, by bisection of
  its CDF (the mean of the members' normal CDFs) inside the members' own u-quantiles."""
  member_q = mean + np.sqrt(var) * scipy.special.ndtri(u)
  lo, hi = member_q.min(axis=0), member_q.max(axis=0)
  for _ in range(100):
    mid = 0.5 * (lo + hi)
    below = np.mean(scipy.special.ndtr((mid - mean) / np.sqrt(var)), axis=0) < u
    lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
  return 0.5 * (lo + hi)


def _mixture_targets(seed, n, members, dims, identical):
  """Outputs [M, N, 2D] of random Gaussians and targets from their uniform mixture, drawn
  by stratified inversion: target n of dim d is the mixture's quantile at a point of the
  grid (i + 0.5) / N (a random permutation of it per dim), so each dim's PIT values are
  that grid exactly and a correct interval covers its nominal share to within 1/N."""
  rng = np.random.default_rng(seed)
  shape = (1 if identical else members, n, dims)
  mean = np.broadcast_to(rng.normal(size=shape) * 2, (members, n, dims))
  var = np.broadcast_to(np.exp(rng.normal(size=shape)), (members, n, dims))
  grid = (np.arange(n) + 0.5) / n
  u = np.stack([rng.permutation(grid) for _ in range(dims)], axis=-1)  # [N, D]
  y = _np_mixture_quantile(mean, var, u)
  outputs = np.concatenate([mean, _raw_for(var)], axis=-1).astype(np.float32)
  return outputs, y.astype(np.float32)


@pytest.mark.parametrize('identical,dims', [(False, 1), (True, 2)])
def test_coverage_is_nominal_for_a_well_specified_model(identical, dims):
  """Targets from the model itself (stratified, so the check is exact rather than
  statistical: 512 of them where 20,000 random draws were needed for +-0.02)."""
  outputs, y = _mixture_targets(3, 512, 4, dims, identical)
  results = _evaluate_in_batches(REGRESSION, outputs, y[:, 0] if dims == 1 else y)
  scopes = [results['ensemble']]
  if identical:  # each member is then the true distribution too
    scopes += [{k: v[m] for k, v in results['members'].items()} for m in range(4)]
  for scope in scopes:
    for pct in (50, 90, 95):
      assert abs(scope[f'coverage_{pct}'] - pct / 100) <= 0.01, (pct, scope)
    assert scope['calibration_error'] < 1e-4


def test_calibration_error_is_the_squared_gap_to_the_levels_and_grows_when_miscalibrated():
  """The ensemble's calibration error against Kuleshov et al.'s formula on numpy's PIT
  values, for the well-specified model and for one that is overconfident (variances / 9) or
  biased (means + 1): the metric sees both."""
  outputs, y = _mixture_targets(3, 512, 4, 1, False)  # The shapes the coverage test compiles.
  mean, var = _np_gaussians(outputs)
  levels = np.asarray(CALIBRATION_LEVELS, np.float64)
  errors = {}
  for name, shift, factor in [('well specified', 0.0, 1.0), ('overconfident', 0.0, 1 / 9),
                              ('biased', 1.0, 1.0)]:
    changed = np.concatenate([mean + shift, _raw_for(var * factor)], axis=-1).astype(np.float32)
    got = _evaluate_in_batches(REGRESSION, changed, y[:, 0])['ensemble']['calibration_error']
    changed_mean, changed_var = _np_gaussians(changed)
    pit = scipy.special.ndtr((y - changed_mean) / np.sqrt(changed_var)).mean(axis=0)  # [N, 1]
    expected = np.mean((levels - np.mean(pit <= levels, axis=0)) ** 2)
    assert got == pytest.approx(expected, abs=1e-6), name
    errors[name] = got
  assert errors['well specified'] < 1e-4
  assert errors['overconfident'] > 1e-3 and errors['biased'] > 1e-2, errors


def test_rmse_equals_numpy():
  outputs, y = _outputs(4, 4, 32, 2)
  _, results = _evaluate(REGRESSION, outputs, y)
  mean = np.asarray(outputs, np.float64)[..., :2]
  y = y.astype(np.float64)
  np.testing.assert_allclose(results['members']['rmse'],
                             np.sqrt(np.mean((mean - y) ** 2, axis=(1, 2))), rtol=1e-6)
  assert results['ensemble']['rmse'] == pytest.approx(
      np.sqrt(np.mean((mean.mean(axis=0) - y) ** 2)), rel=1e-6)


def test_nan_and_unusable_targets_are_refused_in_one_line():
  task = rt.regression()
  good = np.zeros(10, np.float32)
  y = good.copy()
  y[3] = np.nan
  with pytest.raises(ConfigError) as error:
    task.check_targets(y, _dataset(good), "dataset 'toy' (train)")
  message = str(error.value)
  assert '\n' not in message and "dataset 'toy' (train)" in message and 'index 3' in message
  y2 = np.zeros((4, 2), np.float64)
  y2[2, 1] = np.inf
  with pytest.raises(ConfigError, match=r'index \(2, 1\)'):
    task.check_targets(y2, _dataset(y2), 'test targets')
  for bad in (np.array(['a', 'b']), np.zeros(3, bool), np.zeros((2, 2, 2), np.float32)):
    with pytest.raises(ConfigError):
      task.check_targets(bad, _dataset(good), 'targets')
  with pytest.raises(ConfigError, match='predicts 1'):  # [N, 2] against a D = 1 dataset
    task.check_targets(np.zeros((3, 2), np.float32), _dataset(good), 'targets')
  ints = np.arange(5, dtype=np.int32)
  task.check_targets(ints, _dataset(ints), 'targets')  # accepted, and not cast
  assert ints.dtype == np.int32


def test_get_task_and_output_units():
  assert set(TASKS) >= {'classification', 'regression', 'regression_homoscedastic'}
  task = get_task('regression')
  assert task.name == 'regression'
  assert task.output_units(_dataset(np.zeros(7, np.float32))) == 2
  assert task.output_units(_dataset(np.zeros((7, 3), np.float32))) == 6
  # A streamed source with no .y anywhere: scalar targets unless told otherwise.
  streamed = types.SimpleNamespace(train=object(), test=object())
  assert task.output_units(streamed) == 2
  assert rt.regression(target_dim=4).output_units(streamed) == 8
  homoscedastic = get_task('regression_homoscedastic')
  assert homoscedastic.output_units(_dataset(np.zeros((7, 3), np.float32))) == 3
  assert task.select_metrics == {'nll': False, 'rmse': False, 'crps': False}


@pytest.mark.parametrize('name', ['regression', 'regression_homoscedastic'])
def test_eval_batch_under_jit_matches_eager(name):
  # The file's tasks and shapes: the jitted side is compiled once for the file. The
  # homoscedastic task with per-dim noise levels (get_task's default is one level).
  task = {'regression': REGRESSION, 'regression_homoscedastic': HOMOSCEDASTIC}[name]
  assert task.name == get_task(name).name == name
  outputs, y = _outputs(5, 4, 16, 2)
  outputs = outputs[..., :2] if name == 'regression_homoscedastic' else outputs
  mask = np.arange(16) < 13
  member_mask = np.array([True, True, False, True])
  eager = task.eval_batch(outputs, y, mask, member_mask)
  jitted = _jit(task.eval_batch)(outputs, y, mask, member_mask)
  for name_, value in eager.sums.items():
    np.testing.assert_allclose(jitted.sums[name_], value, rtol=1e-6, atol=1e-6, err_msg=name_)
  for a, b in zip(jitted.examples, eager.examples):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_sums_of_half_batches_add_up_to_the_whole():
  task = REGRESSION
  outputs, y = _outputs(6, 4, 32, 2)
  whole, _ = _evaluate(task, outputs, y)
  first, _ = _evaluate(task, outputs[:, :16], y[:16])
  second, _ = _evaluate(task, outputs[:, 16:], y[16:])
  for name, value in whole.sums.items():
    np.testing.assert_allclose(np.asarray(first.sums[name]) + np.asarray(second.sums[name]),
                               value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_losses_and_batch_metrics_equal_numpy():
  outputs, y = _outputs(7, 1, 32, 2)
  outputs, yd = outputs[0], y.astype(np.float64)
  mean, var = _np_gaussians(outputs)
  nll = np.mean(-np.log(_np_density(mean, var, yd)))
  task = rt.regression()
  # Jitted: eagerly, each of their ops compiles a program of its own.
  assert float(jax.jit(task.loss)(outputs, y, {})) == pytest.approx(nll, abs=1e-5)
  mse = np.mean((mean - yd) ** 2)
  assert float(jax.jit(task.batch_metrics)(outputs, y)['mse']) == pytest.approx(mse, rel=1e-6)
  homoscedastic = rt.regression_homoscedastic()
  assert float(jax.jit(homoscedastic.loss)(outputs[:, :2], y, {})) == pytest.approx(mse,
                                                                                   rel=1e-6)
  assert float(jax.jit(homoscedastic.batch_metrics)(outputs[:, :2], y)['mse']) == (
      pytest.approx(mse, rel=1e-6))
  with pytest.raises(ValueError, match='do not match'):  # [B, 1] means against [B, 2] targets
    task.loss(outputs[:, :2], y, {})


def test_split_outputs_floor_and_shapes():
  # Jitted, and the inputs numpy: eagerly, each op compiles a program of its own.
  split_outputs = jax.jit(rt.split_outputs, static_argnames=('squeeze',))
  mean, var = split_outputs(np.array([[0.5, -1e4], [1.0, 1e4]], jnp.bfloat16))
  assert mean.shape == (2,) and var.dtype == jnp.float32
  var = np.asarray(var)
  assert float(var[0]) == pytest.approx(FLOOR) and np.isfinite(float(var[1]))
  mean, var = split_outputs(np.zeros((5, 6), np.float32))
  assert mean.shape == var.shape == (5, 3)
  assert float(np.asarray(var)[0, 0]) == pytest.approx(math.log(2) + FLOOR)
  assert split_outputs(np.zeros((5, 2), np.float32), squeeze=False)[0].shape == (5, 1)


def test_original_units_equal_metrics_of_rescaled_predictions():
  rng = np.random.default_rng(8)
  means = rng.normal(size=(4, 16, 2)).astype(np.float32)
  variances = np.exp(rng.normal(size=(4, 16, 2))).astype(np.float32)
  y = rng.normal(size=(16, 2)).astype(np.float32)
  std, offset = np.array([3.0, 0.5], np.float32), np.array([10.0, -2.0], np.float32)
  # Jitted (one compile for the three calls, shared with the homoscedastic test's
  # reference): eager dispatch of the bisection loops is slow on a CPU.
  gaussian_eval_batch = _jit(rt_eval.gaussian_eval_batch)
  standard = gaussian_eval_batch(means, variances, y, np.ones(16, bool))
  original = gaussian_eval_batch(means * std + offset, variances * std ** 2, y * std + offset,
                                 np.ones(16, bool))
  want = rt_eval.finalize(original.sums)
  got = rt_eval.finalize(rt_eval.sums_to_original_units(jax.device_get(standard.sums), std))
  _assert_results_close(got, want, 2e-4, 1e-5)
  # One common scale: the pooled results convert exactly too.
  common = np.array([2.5, 2.5], np.float32)
  rescaled = gaussian_eval_batch(means * common, variances * common ** 2, y * common,
                                 np.ones(16, bool))
  want = rt_eval.finalize(rescaled.sums)
  got = rt_eval.to_original_units(rt_eval.finalize(standard.sums), [2.5, 2.5])
  _assert_results_close(got, want, 2e-4, 1e-5)
  with pytest.raises(ValueError, match='sums_to_original_units'):
    rt_eval.to_original_units(rt_eval.finalize(standard.sums), std)


def test_finalize_is_json_and_has_the_documented_keys():
  _, results = _evaluate(REGRESSION, *_outputs(9, 4, 16, 2))
  json.dumps(results)
  keys = {'rmse', 'nll', 'crps', 'calibration_error'} | {
      f'{k}_{p}' for k in ('coverage', 'width') for p in (50, 90, 95)}
  assert set(results['members']) == keys
  assert set(results['ensemble']) == keys | {'aleatoric', 'epistemic'}
  assert all(len(v) == 4 for v in results['members'].values())


def test_ood_scores_rank_by_epistemic_variance():
  rng = np.random.default_rng(10)
  same = np.broadcast_to(rng.normal(size=(1, 32, 2)), (4, 32, 2))
  apart = rng.normal(size=(4, 32, 2)) * 5
  raw = np.zeros((4, 32, 2))
  task, zeros = REGRESSION, np.zeros((32, 2), np.float32)
  inside, _ = _evaluate(task, np.concatenate([same, raw], -1).astype(np.float32), zeros)
  outside, _ = _evaluate(task, np.concatenate([apart, raw + 3], -1).astype(np.float32), zeros)
  ood = task.ood_metrics(inside.examples, outside.examples)
  assert ood['ensemble']['auroc_epistemic'] == pytest.approx(1.0)
  assert ood['ensemble']['aupr_epistemic'] == pytest.approx(1.0)
  assert ood['ensemble']['epistemic_in'] == pytest.approx(0.0, abs=1e-6)
  # Each member alone: scored by its own variance, larger outside (raw + 3).
  assert ood['members']['auroc_variance'] == pytest.approx([1.0] * 4)
  json.dumps(ood)


def test_predictive_decomposes_the_mixture_variance():
  outputs, _ = _outputs(11, 4, 9, 1)
  # Jitted: eagerly, each of its ops compiles a program of its own.
  predictive = jax.jit(rt.predictive, static_argnames=('noise_variance', 'squeeze'))
  pred = predictive(outputs)
  mean, var = _np_gaussians(outputs)
  mean, var = mean[..., 0], var[..., 0]
  np.testing.assert_allclose(pred['mean'], mean.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(pred['aleatoric'], var.mean(0), rtol=1e-5)
  np.testing.assert_allclose(pred['epistemic'], mean.var(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(pred['variance'], var.mean(0) + mean.var(0), rtol=1e-5)
  assert pred['member_mean'].shape == pred['member_variance'].shape == (4, 9)
  assert predictive(np.zeros((2, 5, 6), np.float32))['mean'].shape == (5, 3)
  homoscedastic = predictive(np.zeros((2, 5, 1), np.float32), noise_variance=0.25)
  np.testing.assert_allclose(homoscedastic['variance'], 0.25)


def test_homoscedastic_task_uses_its_noise_variance():
  outputs, y = _outputs(12, 4, 16, 2)
  means = outputs[..., :2]
  out, results = _evaluate(HOMOSCEDASTIC, means, y)
  # Jitted, as _evaluate is: eager dispatch of the bisection loops is slow on a CPU.
  reference = _jit(rt_eval.gaussian_eval_batch)(
      means, np.broadcast_to(np.float32([0.5, 2.0]), means.shape), y, np.ones(16, bool))
  _assert_results_close(results, rt_eval.finalize(jax.device_get(reference.sums)), 1e-5, 1e-6)
  with pytest.raises(ConfigError):
    rt.regression_homoscedastic(noise_variance=0.0)


def test_a_members_interval_holds_its_end_points():
  """Coverage counts a target on an interval's end as inside: two targets, one on each end
  of the 50% interval, both covered (a strict comparison would count neither)."""
  reg = importlib.import_module('dist_ens.eval.regression')
  means, variances = jnp.zeros((1, 2, 1)), jnp.full((1, 2, 1), 4.0)
  lo, hi = reg.gaussian_central_interval(means, variances, reg.INTERVAL_LEVELS)
  level = reg.INTERVAL_LEVELS.index(0.5)
  y = jnp.stack([lo[level, 0, 0], hi[level, 0, 1]])  # [B=2, D=1]
  assert float(y[0, 0]) < 0 < float(y[1, 0])
  sums = rt_eval._member_sums(means, variances, y, jnp.ones(2, bool))
  assert float(sums['member_cover_50'][0]) == 2.0
