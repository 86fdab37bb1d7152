"""`dist-ens report` on a regression run: its figures exist, and the numbers behind the
calibration curve and the ensemble-size curve equal independent computations (the mixture's
central intervals by root finding on its CDF; final_metrics.json's RMSE and NLL)."""

import json

import numpy as np
import pytest
from scipy import optimize, stats

import runs

import dist_ens
from dist_ens import data
from dist_ens.inference.prediction import GaussianPrediction
from dist_ens.report import build as report, pages as report_pages, regression as report_regression

FIGURES = ('calibration', 'predicted_vs_true', 'members_vs_ensemble', 'learning_curves',
           'ensemble_size')


@pytest.fixture(scope='module')
def workdir(tmp_path_factory, uci_run):
  """configs/uci.py on the shipped yacht set (31 test examples), a few steps, with test
  events for the learning curves: a copy of the session's shared run (tests/runs.py),
  reported."""
  path = runs.copy(uci_run, tmp_path_factory.mktemp('regression_report'))
  assert report.main(['--workdir', str(path)]) == 0
  return path


def _mixture_interval(means, sds, level):
  """The mixture's central interval at `level`, by Brent's method on its float64 CDF."""
  def cdf(x):
    return np.mean(stats.norm.cdf((x - means) / sds))
  low, high = np.min(means - 12 * sds), np.max(means + 12 * sds)
  return tuple(optimize.brentq(lambda x, q=q: cdf(x) - q, low, high, xtol=1e-12)
               for q in ((1 - level) / 2, (1 + level) / 2))


def test_the_report_writes_the_regression_figures_and_pages(workdir):
  out = workdir / 'report'
  for name in FIGURES:
    assert (out / f'{name}.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n', name
    assert (out / f'{name}.svg').stat().st_size > 1000, name
  assert not (out / 'reliability.png').exists()  # Classification's figure is not drawn.
  md = (out / 'report.md').read_text()
  for title in ('Calibration', 'Predicted against true', 'Ensemble size', 'Learning curves'):
    assert f'## {title}' in md
  assert 'for 31 of the 31 test examples' in md
  page = (out / 'report.html').read_text()
  assert '<th>RMSE</th><th>NLL</th><th>CRPS</th><th>90% coverage</th>' in page
  assert page.count('<img src="data:image/svg+xml;base64,') == len(FIGURES)


def test_the_calibration_curve_is_the_mixtures_interval_coverage(workdir):
  curves = json.loads((workdir / 'report' / report_regression.CURVES_FILE).read_text())
  cal = curves['calibration']
  test = data.load_dataset('uci:yacht').test
  out = dist_ens.Ensemble.load(workdir).predict(test.x, preprocessed=True)  # As the report.
  y = test.y.astype(np.float64)
  means = out.member_mean.astype(np.float64)
  sds = np.sqrt(out.member_variance.astype(np.float64))
  np.testing.assert_allclose(cal['levels'], np.arange(1, 20) * 0.05, atol=1e-12)
  ensemble, members = [], []
  for level in cal['levels']:
    bounds = np.array([_mixture_interval(means[:, i], sds[:, i], level) for i in range(len(y))])
    ensemble.append(np.mean((bounds[:, 0] <= y) & (y <= bounds[:, 1])))
    half = sds * stats.norm.ppf((1 + level) / 2)  # Each member's own Gaussian interval.
    members.append(np.mean((means - half <= y) & (y <= means + half)))
  np.testing.assert_allclose(cal['ensemble'], ensemble, atol=1e-12)
  np.testing.assert_allclose(cal['member_mean'], members, atol=1e-12)
  # Not a trivial curve: it rises from level 0.05 to 0.95.
  assert cal['ensemble'][0] < 0.5 < cal['ensemble'][-1]


def test_the_ensemble_size_curve_ends_at_the_runs_ensemble(workdir):
  final = json.loads((workdir / 'final_metrics.json').read_text())
  size = json.loads((workdir / 'report' / report_regression.CURVES_FILE).read_text())[
      'ensemble_size']
  assert size['size'] == [1, 2, 3, 4, 5]
  # k = 5 is the one ensemble of all; k = 1 each member alone.
  np.testing.assert_allclose(size['rmse_mean'][-1], final['ensemble']['rmse'], rtol=1e-4)
  np.testing.assert_allclose(size['nll_mean'][-1], final['ensemble']['nll'], rtol=1e-4)
  np.testing.assert_allclose([size['rmse_min'][0], size['rmse_max'][0]],
                             [min(final['members']['rmse']), max(final['members']['rmse'])],
                             rtol=1e-4)
  np.testing.assert_allclose(size['nll_mean'][0], np.mean(final['members']['nll']), rtol=1e-4)


def _prediction(means, variances):
  means, variances = np.asarray(means, np.float32), np.asarray(variances, np.float32)
  return GaussianPrediction(means.mean(0), variances.mean(0) + means.var(0), variances.mean(0),
                            means.var(0), means, variances)


def test_a_well_specified_model_covers_each_level():
  rng = np.random.default_rng(0)
  y = rng.normal(2.0, 3.0, (20000, 2))  # Two target dims, every value counted.
  cal = report_regression.calibration(
      _prediction(np.full((3, 20000, 2), 2.0), np.full((3, 20000, 2), 9.0)), y, [0, 1, 2])
  np.testing.assert_allclose(cal.ensemble, cal.levels, atol=0.01)
  np.testing.assert_allclose(cal.member_mean, cal.levels, atol=0.01)


def test_frozen_members_are_left_out_of_the_curves():
  rng = np.random.default_rng(1)
  means, variances = rng.normal(size=(3, 50)), rng.uniform(0.5, 2, (3, 50))
  y = rng.normal(size=50)
  means[2], variances[2] = np.nan, np.nan  # A diverged (frozen) member.
  kept = report_regression.calibration(_prediction(means, variances), y, [0, 1])
  alone = report_regression.calibration(_prediction(means[:2], variances[:2]), y, [0, 1])
  np.testing.assert_array_equal(kept.ensemble, alone.ensemble)
  assert np.isfinite(kept.ensemble).all() and kept.members.shape == (2, 19)
  curves = report_regression.ensemble_size_curves(means, variances, y, [0, 1])
  assert np.isfinite(curves.stat('rmse', 'max')).all() and curves.num_subsets.tolist() == [2, 1]


def test_the_scatter_shows_at_most_500_examples_the_same_ones_each_time():
  first = report_regression.scatter_sample(2000)
  assert len(first) == 500 and len(np.unique(first)) == 500 and np.all(np.diff(first) > 0)
  np.testing.assert_array_equal(first, report_regression.scatter_sample(2000))
  np.testing.assert_array_equal(report_regression.scatter_sample(40), np.arange(40))


def test_a_regression_ood_table_shows_its_variance_scores():
  ood = {'members': {'auroc_variance': [0.6, 0.8, np.nan], 'aupr_variance': [0.5, 0.7, np.nan]},
         'ensemble': {'auroc_epistemic': 0.9, 'aupr_epistemic': 0.85, 'auroc_total': 0.75,
                      'aupr_total': 0.7, 'epistemic_in': 0.01, 'epistemic_out': 0.5}}
  rows = report_pages._ood_rows(ood, active=[0, 1])  # pylint: disable=protected-access
  assert rows[0] == ['epistemic variance', '0.9000', '0.8500', '0.0100', '0.5000']
  assert rows[2][1:3] == ['0.7000', '0.6000']  # Means of the non-frozen members.
