"""The report's figures for a regression run (a task whose Ensemble.predict gives a mixture
of the members' Gaussians, dist_ens.prediction.GaussianPrediction).

report.make_report calls `draw` in place of the classification figures. It writes into
DIR/report/ (each figure as NAME.png and NAME.svg):
  calibration              observed against expected coverage of central intervals at the
                           levels 0.05..0.95: the ensemble's (the mixture's interval), every
                           member's and their mean (each its own Gaussian's); beside it the
                           histogram of the ensemble's PIT values
  predicted_vs_true        the ensemble's mean against the target, with the mixture's 90%
                           central interval as error bars (at most 500 test examples)
  members_vs_ensemble      test RMSE, NLL and calibration error of every member and the ensemble
  learning_curves          train loss, test RMSE and NLL of every member over steps
  ensemble_size            test RMSE and NLL of ensembles of k members, over member subsets
  regression_curves.json   the numbers behind calibration and ensemble_size

Everything is computed in float64 numpy from the prediction in the targets' units. A target
lies inside the mixture's central interval at level p exactly when its PIT value F(y) is
within p/2 of 1/2 (F is continuous and increasing), so coverage needs no quantiles; only the
error bars do (dist_ens.eval.regression.mixture_central_interval). Targets [N, D] count every
dimension as one more value, as the coverage metrics do; the scatter shows dimension 0.
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from scipy.special import logsumexp, ndtr

from dist_ens.eval import regression as reg
from dist_ens.inference.prediction import GaussianPrediction
from dist_ens.report import plots as plots
from dist_ens.report.data import finite_mean, read_events
from dist_ens.report.pages import Figure
from dist_ens.report.stats import over_subsets, subset_stat

LEVELS = np.array(reg.CALIBRATION_LEVELS)  # 0.05, 0.10, ..., 0.95
SCATTER_LEVEL = 0.9
SCATTER_POINTS = 500  # A scatter of more hides its points' error bars under one another.
CURVES_FILE = 'regression_curves.json'

# (key, title, axis floor, axis ceiling); a regression NLL can be negative: no floor.
MEMBER_PANELS = (('rmse', 'test RMSE (lower is better)', 0.0, None),
                 ('nll', 'test NLL (lower is better)', None, None),
                 ('calibration_error', 'test calibration error (lower is better)', 0.0, None))
TEST_PANELS = (('rmse', 'test RMSE', 0.0, None), ('nll', 'test NLL', None, None))


def _per_value(a: np.ndarray, members: bool) -> np.ndarray:
  """float64 [(M,) N, D] from [(M,) N] or [(M,) N, D]: one column per target dimension."""
  a = np.asarray(a, np.float64)
  return a[..., None] if a.ndim == (2 if members else 1) else a


def mixture_pit(means: np.ndarray, variances: np.ndarray, y: np.ndarray) -> np.ndarray:
  """F(y) of the uniform mixture of K Gaussians: [N, D] from means, variances [K, N, D]."""
  return np.mean(ndtr((y - means) / np.sqrt(variances)), axis=0)


def central_coverage(pit: np.ndarray, levels: np.ndarray = LEVELS) -> np.ndarray:
  """[L]: the share of PIT values (any shape) inside each level's central interval."""
  distance = np.abs(np.asarray(pit, np.float64).ravel() - 0.5)
  return np.mean(distance[:, None] <= np.asarray(levels)[None, :] / 2, axis=0)


class Calibration(NamedTuple):
  """Observed coverage of the central intervals at `levels` on the test split."""
  levels: np.ndarray  # [L] expected coverage
  ensemble: np.ndarray  # [L] the mixture of the non-frozen members
  members: np.ndarray  # [K, L] each non-frozen member's own Gaussian, in `active` order
  pit: np.ndarray  # [N * D] the ensemble's PIT values

  @property
  def member_mean(self) -> np.ndarray:
    """[L] the members' coverage averaged over members (NaN with none)."""
    return self.members.mean(axis=0) if len(self.members) else np.full(len(self.levels), np.nan)


def calibration(prediction: GaussianPrediction, y: np.ndarray, active: Sequence[int],
                levels: np.ndarray = LEVELS) -> Calibration:
  """The ensemble's (mixture over `active`) and each active member's interval coverage."""
  y = _per_value(y, members=False)
  means = _per_value(prediction.member_mean, members=True)[list(active)]
  variances = _per_value(prediction.member_variance, members=True)[list(active)]
  if not len(active):
    return Calibration(levels, np.full(len(levels), np.nan), np.zeros((0, len(levels))),
                       np.full(y.size, np.nan))
  pit = mixture_pit(means, variances, y)
  members = np.array([central_coverage(mixture_pit(m[None], v[None], y), levels)
                      for m, v in zip(means, variances)])
  return Calibration(levels, central_coverage(pit, levels), members, pit.ravel())


def mixture_rmse_nll(means: np.ndarray, variances: np.ndarray,
                     y: np.ndarray) -> tuple[float, float]:
  """RMSE of the mixture's mean and its mean NLL (joint over target dims), as the task
  reports them: means, variances [K, N, D], y [N, D], float64."""
  rmse = float(np.sqrt(np.mean(np.square(y - means.mean(axis=0)))))
  log_density = -0.5 * np.sum(np.log(2 * np.pi * variances) + np.square(y - means) / variances,
                              axis=-1)  # [K, N]
  nll = float(np.mean(np.log(len(means)) - logsumexp(log_density, axis=0)))
  return rmse, nll


class SizeCurves(NamedTuple):
  """RMSE and NLL of ensembles of k members over member subsets (as stats.SizeSpread:
  row i is size[i], its first num_subsets[i] columns one subset each, the rest NaN)."""
  size: np.ndarray  # [K]
  num_subsets: np.ndarray  # [K]
  rmse: np.ndarray  # [K, S]
  nll: np.ndarray  # [K, S]

  def stat(self, key: str, name: str) -> np.ndarray:
    """[K] 'mean', 'min', 'max', 'q25' or 'q75' of 'rmse' or 'nll' per size."""
    if key not in ('rmse', 'nll'):
      raise ValueError(f"key={key!r}: use 'rmse' or 'nll'")
    return subset_stat(getattr(self, key), name)


def ensemble_size_curves(member_mean: np.ndarray, member_variance: np.ndarray, y: np.ndarray,
                         members: Sequence[int], num_subsets: int = 20, seed: int = 0,
                         max_sizes: int = 24) -> SizeCurves:
  """RMSE and NLL of the mixtures of k of `members`, k = 1..len(members), with the subsets
  stats.ensemble_size_spread draws (every one when there are at most num_subsets)."""
  means = _per_value(member_mean, members=True)
  variances = _per_value(member_variance, members=True)
  y = _per_value(y, members=False)
  rmse_nll = lambda chosen: mixture_rmse_nll(means[chosen], variances[chosen], y)
  return SizeCurves(*over_subsets(members, rmse_nll, num_subsets, seed, max_sizes))


def scatter_sample(n: int, max_points: int = SCATTER_POINTS, seed: int = 0) -> np.ndarray:
  """Sorted indices of the examples the scatter shows: all, or max_points drawn with
  numpy's default_rng(seed) (the same ones on every report of the same test split)."""
  if n <= max_points:
    return np.arange(n)
  return np.sort(np.random.default_rng(seed).choice(n, size=max_points, replace=False))


def scatter_interval(prediction: GaussianPrediction, active: Sequence[int], index: np.ndarray,
                     level: float = SCATTER_LEVEL) -> tuple[np.ndarray, np.ndarray]:
  """The mixture's central interval at `level` of target dimension 0 of examples `index`."""
  means = _per_value(prediction.member_mean, members=True)[list(active)][:, index, 0]
  variances = _per_value(prediction.member_variance, members=True)[list(active)][:, index, 0]
  lo, hi = reg.mixture_central_interval(means, variances, level)
  return np.asarray(lo, np.float64), np.asarray(hi, np.float64)


def draw(out: Path, workdir: Path, final: dict[str, Any], prediction: GaussianPrediction,
         targets: np.ndarray, frozen: set[int], active: list[int]) -> list[Figure]:
  """Every regression figure and regression_curves.json into `out`; returns the figures
  with their captions, in the order the report shows them."""
  y = np.asarray(targets, np.float64)
  cal = calibration(prediction, y, active)
  curves = ensemble_size_curves(prediction.member_mean, prediction.member_variance, y, active)
  index = scatter_sample(len(y))
  lo, hi = scatter_interval(prediction, active, index) if active else (index * np.nan,) * 2
  plot_calibration(out, cal, final)
  plot_predicted_vs_true(out, _per_value(y, False)[index, 0],
                         _per_value(prediction.mean, False)[index, 0], lo, hi, final)
  plots.plot_members_vs_ensemble(out, final, MEMBER_PANELS)
  plots.plot_learning_curves(out, read_events(workdir / 'metrics.jsonl'), frozen, TEST_PANELS,
                             loss_floor=None)  # The Gaussian NLL can be negative.
  plots.plot_ensemble_size(out, curves, {k: finite_mean(final['members'][k], active)
                                         for k, *_ in TEST_PANELS}, TEST_PANELS)
  _write_curves(out / CURVES_FILE, cal, curves, active)
  return figures(final, cal, curves, active, len(index), len(y))


def _write_curves(path: Path, cal: Calibration, curves: SizeCurves, active: list[int]) -> None:
  """The numbers behind the calibration and ensemble-size figures, as JSON (NaN as null)."""
  def floats(a):
    return [None if not np.isfinite(v) else float(v) for v in np.ravel(a)]
  data = {
      'calibration': {'levels': floats(cal.levels), 'ensemble': floats(cal.ensemble),
                      'member_mean': floats(cal.member_mean),
                      'members': {str(m): floats(row) for m, row in zip(active, cal.members)}},
      'ensemble_size': {'size': curves.size.tolist(),
                        **{f'{key}_{name}': floats(curves.stat(key, name))
                           for key in ('rmse', 'nll') for name in ('mean', 'min', 'max')}}}
  path.write_text(json.dumps(data, indent=1), encoding='utf-8')


def figures(final: dict[str, Any], cal: Calibration, curves: SizeCurves, active: list[int],
            shown: int, total: int) -> list[Figure]:
  """The regression figures with the captions report.md and report.html give them."""
  ens = final['ensemble']
  size = (f'Ensembles of k of the {len(active)} non-frozen members: every subset of each size '
          f'when there are at most {curves.rmse.shape[1]}, else that many drawn at random '
          '(numpy seed 0); the line is the mean over subsets, the bands their interquartile '
          'range and min-max.')
  if len(curves.size):
    size += (f' All {curves.size[-1]} together: RMSE {curves.stat("rmse", "mean")[-1]:.4g}, '
             f'NLL {curves.stat("nll", "mean")[-1]:.4f}.')
  return [
      Figure('calibration', 'Calibration',
             'Left: the share of test targets inside the central interval of each level '
             '(0.05 to 0.95) against the level: the ensemble\'s (the mixture\'s interval), '
             'every member\'s own and their mean; above the diagonal is under-confident, '
             'below over-confident. Right: the ensemble\'s PIT values F(y), uniform for a '
             'calibrated model. Quantile calibration error (one-sided levels, in the metrics '
             f'table): ensemble {ens.get("calibration_error", np.nan):.4f}, member mean '
             f'{finite_mean(final["members"]["calibration_error"], active):.4f}.'),
      Figure('predicted_vs_true', 'Predicted against true',
             f'The ensemble\'s mean against the target for {shown} of the {total} test '
             f'examples{" (drawn with numpy seed 0)" if shown < total else ""}, with the '
             f'mixture\'s {SCATTER_LEVEL:.0%} central interval as error bars; red: the target '
             f'lies outside it. On the whole test split the interval covers '
             f'{ens.get("coverage_90", np.nan):.1%}.'),
      Figure('members_vs_ensemble', 'Members and the ensemble',
             'Every member\'s test RMSE, NLL and quantile calibration error, the member mean '
             '(dashed) and the ensemble (orange). Frozen or non-finite members are grey '
             'crosses at the axis edge.'),
      Figure('learning_curves', 'Learning curves',
             'Train loss and test RMSE and NLL over steps of '
             f'{plots.learning_curves_members(final["num_members"])}, the ensemble in orange.'),
      Figure('ensemble_size', 'Ensemble size', size)]


def plot_calibration(out: Path, cal: Calibration, final: dict[str, Any]) -> None:
  """calibration: coverage against level (members thin, their mean dashed, the ensemble
  orange) and the ensemble's PIT histogram."""
  fig, axes = plots._figure(10.0, 4.4, 2)  # pylint: disable=protected-access
  ax, hist = axes
  for i, row in enumerate(cal.members):
    ax.plot(cal.levels, row, color=plots._MEMBER_COLOR, lw=0.7, alpha=0.35,
            label='members' if i == 0 else None)
  ax.plot(cal.levels, cal.member_mean, '--', color=plots._MEMBER_COLOR, lw=1.5,
          label='member mean')
  ax.plot(cal.levels, cal.ensemble, marker='o', ms=3, color=plots._ENSEMBLE_COLOR, lw=2,
          label='ensemble')
  ax.plot([0, 1], [0, 1], ':', color='gray', lw=1, label='perfect calibration')
  ax.set(xlim=(0, 1), ylim=(0, 1), xlabel='expected coverage (central interval level)',
         ylabel='observed coverage (share of test targets)',
         title=f'central intervals, {len(cal.pit)} test values')
  ax.legend(fontsize=8, loc='upper left')
  edges = np.linspace(0, 1, 11)
  finite = cal.pit[np.isfinite(cal.pit)]
  hist.hist(finite, bins=edges, color=plots._ENSEMBLE_COLOR, edgecolor='white')
  hist.axhline(len(finite) / 10, ls=':', color='gray', lw=1, label='uniform')
  hist.set(xlim=(0, 1), xlabel='PIT value F(y) of the ensemble', ylabel='test values',
           title='ensemble PIT histogram (calibration error '
                 f'{final["ensemble"].get("calibration_error", np.nan):.4f})')
  hist.legend(fontsize=8)
  plots._save(fig, out, 'calibration')  # pylint: disable=protected-access


def plot_predicted_vs_true(out: Path, y: np.ndarray, mean: np.ndarray, lo: np.ndarray,
                           hi: np.ndarray, final: dict[str, Any]) -> None:
  """predicted_vs_true: the ensemble's mean against the target with its central interval."""
  fig, axes = plots._figure(5.6, 5.2, 1)  # pylint: disable=protected-access
  ax = axes[0]
  inside = (lo <= y) & (y <= hi)
  for keep, color, label in ((inside, plots._MEMBER_COLOR, 'target inside the interval'),
                             (~inside, '#c44e52', 'target outside')):
    if keep.any():
      ax.errorbar(y[keep], mean[keep], yerr=[mean[keep] - lo[keep], hi[keep] - mean[keep]],
                  fmt='o', ms=3, color=color, ecolor=color, elinewidth=0.7, alpha=0.7,
                  label=label)
  low, high = plots._limits(np.concatenate([y, lo, hi]))  # pylint: disable=protected-access
  ax.plot([low, high], [low, high], ':', color='gray', lw=1, label='predicted = true')
  ax.set(xlim=(low, high), ylim=(low, high), xlabel='true target',
         ylabel=f'ensemble mean and {SCATTER_LEVEL:.0%} interval',
         title=f'{inside.mean():.1%} of the {len(y)} shown inside; RMSE (all) '
               f'{final["ensemble"].get("rmse", np.nan):.4g}')
  ax.legend(fontsize=8, loc='upper left')
  plots._save(fig, out, 'predicted_vs_true')  # pylint: disable=protected-access
