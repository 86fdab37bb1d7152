"""config.eval.metrics: a user's per-example metric by import path, averaged per member and
for the ensemble inside the compiled evaluation, exact under padding. Checked against the
built-in metrics it must reproduce (0-1 error = 1 - accuracy, label NLL = NLL, squared error
of the mean = RMSE^2 in standardised units)."""

import numpy as np
import pytest

import support

import dist_ens
from dist_ens import data
from dist_ens.errors import ConfigError


def _config(*metrics):
  """support.config's tiny run (4 members of a (16,) MLP, batch 32, 4 steps) evaluated with
  `metrics`. Kept: eval.batch_size=296, so MNIST-1D's 1000 test examples end in a padded
  batch (the metrics must be exact under padding)."""
  return support.config({'eval.batch_size': 296, 'eval.metrics': metrics})


def test_classification_metrics_match_the_built_in_ones(tmp_path):
  final = dist_ens.train(_config('metric_fixtures:zero_one', 'metric_fixtures:label_nll'),
                         str(tmp_path))
  members, ensemble = final['members'], final['ensemble']
  np.testing.assert_allclose(members['zero_one'], 1 - np.asarray(members['accuracy']), atol=1e-6)
  assert ensemble['zero_one'] == pytest.approx(1 - ensemble['accuracy'], abs=1e-6)
  np.testing.assert_allclose(members['label_nll'], members['nll'], rtol=1e-5)
  assert ensemble['label_nll'] == pytest.approx(ensemble['nll'], rel=1e-5)


def test_regression_metric_sees_standardised_units_and_the_mixture_mean(tmp_path):
  rng = np.random.default_rng(0)
  x = rng.uniform(-1, 1, (700, 1)).astype(np.float32)
  y = (4 * np.sin(3 * x[:, 0]) + 10 + 0.3 * rng.standard_normal(700)).astype(np.float32)
  config = support.override(_config('metric_fixtures:squared_error'), task='regression')
  final = dist_ens.train(config, str(tmp_path),
                         dataset=data.from_arrays(x[:500], y[:500], x[500:], y[500:]))
  y_std = np.std(y[:500].astype(np.float64))
  members, ensemble = final['members'], final['ensemble']
  np.testing.assert_allclose(np.asarray(members['squared_error']) * y_std ** 2,
                             np.square(members['rmse']), rtol=1e-4)
  assert ensemble['squared_error'] * y_std ** 2 == pytest.approx(ensemble['rmse'] ** 2, rel=1e-4)


@pytest.mark.parametrize('path, match', [
    ('metric_fixtures:nothing', 'config.eval.metrics'),
    ('metric_fixtures:whole_batch', r'one value per example')])
def test_bad_metrics_are_refused_with_one_line(tmp_path, path, match):
  with pytest.raises(ConfigError, match=match):
    dist_ens.train(_config(path), str(tmp_path / 'run'))
