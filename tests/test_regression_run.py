"""A regression ensemble trains end to end through the task extension point: float
targets stay float, the step trains on the task's Gaussian NLL, the evaluator reports
the task's metrics, and the tables and members.csv show them."""

import json
import logging

import numpy as np
import pytest

import support
from runs import killed_after

import dist_ens
from dist_ens import data
from dist_ens.errors import ConfigError


def _curve(n, seed):
  rng = np.random.default_rng(seed)
  x = rng.uniform(-1, 1, (n, 1)).astype(np.float32)
  y = np.sin(3 * x[:, 0]) + 0.1 * rng.standard_normal(n)
  return x, y.astype(np.float32)


def _config():
  """support.config's run (4 members, jsonl events) as a regression ensemble. Kept: a (32,)
  MLP at learning rate 1e-2 without weight decay, batch 64, 300 steps (logged every 100,
  saved at the end): what the tests check it learned (an RMSE under 0.25 on the curve,
  the homoscedastic noise level and coverage) needs them, and the curve's 1-D inputs and
  the regression head make these programs this file's own at any size."""
  return support.config({
      'task': 'regression', 'model.widths': (32,), 'optim.learning_rate': 1e-2,
      'optim.weight_decay': 0.0, 'data.batch_size': 64, 'train.steps': 300,
      'train.log_every': 100, 'checkpoint.every': 300})


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """The curve's ensemble trained twice with _config() and a validation split of 128 (the
  conformal intervals' calibration): on its targets ('plain') and on 1000 y + 5
  ('scaled'); each (workdir, final metrics). The tests below only read them."""
  (x, y), (xt, yt) = _curve(512, 0), _curve(256, 1)
  root = tmp_path_factory.mktemp('regression')
  datasets = {'plain': data.from_arrays(x, y, xt, yt, name='curve'),
              'scaled': data.from_arrays(x, 1000 * y + 5, xt, 1000 * yt + 5)}
  config = support.override(_config(), {'data.validation_size': 128})
  return {name: (root / name, dist_ens.train(config, str(root / name), dataset=dataset))
          for name, dataset in datasets.items()}


def test_a_regression_ensemble_trains_and_reports_its_metrics(runs):
  dataset = data.from_arrays(*_curve(512, 0), *_curve(256, 1), name='curve')
  assert dataset.train.y.dtype == np.float32 and dataset.num_classes == 0
  assert np.array_equal(dataset.train.y, _curve(512, 0)[1])  # Never cast to integers.
  workdir, final = runs['plain']
  members, ensemble = final['members'], final['ensemble']
  for key in ('rmse', 'nll', 'crps', 'coverage_50', 'coverage_90', 'coverage_95'):
    assert len(members[key]) == 4 and key in ensemble
  # Learned the curve (its noise is 0.1; predicting the mean alone gives ~0.7).
  assert ensemble['rmse'] < 0.25
  # The mixture's NLL is below its mean member's (Jensen, strict for differing members).
  assert ensemble['nll'] < np.mean(members['nll'])
  assert 'rmse' in (workdir / 'members.csv').read_text().splitlines()[0]


def test_float_labels_are_refused_by_classification(tmp_path):
  config = _config()
  config.task = 'classification'
  dataset = data.from_arrays(*_curve(128, 0), *_curve(64, 1))
  with pytest.raises(ConfigError, match='labels must be integer classes'):
    dist_ens.train(config, str(tmp_path), dataset=dataset)


def test_targets_are_standardised_and_metrics_reported_in_their_units(runs):
  # The same problem in other units: standardising makes training identical, and
  # the metrics come back scaled (RMSE, CRPS, widths x1000; NLL + log 1000).
  plain, scaled = runs['plain'][1], runs['scaled'][1]
  for scope in ('ensemble',):
    a, b = plain[scope], scaled[scope]
    np.testing.assert_allclose(b['rmse'], 1000 * a['rmse'], rtol=1e-3)
    np.testing.assert_allclose(b['crps'], 1000 * a['crps'], rtol=1e-3)
    np.testing.assert_allclose(b['nll'], a['nll'] + np.log(1000), rtol=1e-3)
    assert b['coverage_90'] == pytest.approx(a['coverage_90'], abs=0.01)


def test_a_regression_run_reports_conformal_intervals_in_target_units(runs):
  """A run with a validation split calibrates normalised-residual intervals on it; the
  loaded ensemble's predict_sets gives them again in the targets' own units (no
  randomness: the same coverage and width as the run's), and on 1000 y + 5 they are 1000
  times as wide and cover the same examples. No selective metrics: they are for
  classification (test_shift_eval's digits run reports them)."""
  xt, yt = _curve(256, 1)
  for name, scale in (('plain', 1.0), ('scaled', 1000.0)):
    workdir, final = runs[name]
    fitted = final['conformal']
    assert fitted['method'] == 'normalized_residual' and fitted['calibration_size'] == 128
    assert 'aurc' not in final and 'shift' not in final
    lower, upper = dist_ens.Ensemble.load(str(workdir)).predict_sets(xt)
    y = scale * yt + (5 if name == 'scaled' else 0)
    assert np.mean((lower <= y) & (y <= upper)) == pytest.approx(fitted['coverage'])
    assert np.mean(upper - lower) == pytest.approx(fitted['mean_width'], rel=1e-4)
  plain, scaled = runs['plain'][1]['conformal'], runs['scaled'][1]['conformal']
  assert scaled['mean_width'] == pytest.approx(1000 * plain['mean_width'], rel=1e-3)
  assert scaled['coverage'] == pytest.approx(plain['coverage'], abs=0.01)
  assert 0.8 < plain['coverage'] <= 1


def test_the_uci_config_trains_on_a_shipped_set(uci_run):
  # configs/uci.py on uci:yacht for 4 epochs: the session's shared run (tests/runs.py).
  _, final = uci_run
  train, test = data.load_dataset('uci:yacht').train, data.load_dataset('uci:yacht').test
  assert (train.num_examples, test.num_examples) == (277, 31)
  assert final['num_members'] == 5 and np.isfinite(final['ensemble']['nll'])
  # Metrics in the targets' units: an RMSE below the test targets' own spread.
  assert final['ensemble']['rmse'] < np.std(test.y)


def test_a_regression_ensemble_loads_and_predicts_in_target_units(runs):
  xt, yt = _curve(256, 1)
  workdir, final = runs['scaled']  # trained on 1000 y + 5
  ensemble = dist_ens.Ensemble.load(str(workdir))
  out = ensemble.predict(xt, batch_size=100)  # Raw inputs; three chunks, one padded.
  assert out.mean.shape == (256,) and out.member_mean.shape == (4, 256)
  # In the targets' units: the RMSE equals what training reported on the same test split.
  rmse = np.sqrt(np.mean((out.mean - (1000 * yt + 5)) ** 2))
  np.testing.assert_allclose(rmse, final['ensemble']['rmse'], rtol=1e-4)
  np.testing.assert_allclose(out.variance, out.aleatoric + out.epistemic, rtol=1e-5)
  np.testing.assert_allclose(out.mean, out.member_mean.mean(0), rtol=1e-5, atol=1e-3)
  np.testing.assert_allclose(out.epistemic, out.member_mean.var(0), rtol=1e-3, atol=1e-3)


def test_an_exported_regression_member_predicts_with_numpy_alone(runs, tmp_path):
  """ensemble.json carries the task and the standardiser, so a member's .npz predicts in
  target units without dist_ens: standardise x, run the MLP, unscale the mean."""
  xt, _ = _curve(256, 1)
  ensemble = dist_ens.Ensemble.load(str(runs['scaled'][0]))  # trained on 1000 y + 5
  paths = ensemble.export(tmp_path / 'members')
  meta = json.loads((tmp_path / 'members' / 'ensemble.json').read_text())
  assert meta['task'] == 'regression'
  scale = {k: np.asarray(v, np.float64) for k, v in meta['standardizer'].items()}
  w = np.load(paths[2])
  h = np.maximum(((xt - scale['x_mean']) / scale['x_std']) @ w['0/w'] + w['0/b'], 0)
  mean = (h @ w['1/w'] + w['1/b'])[:, 0] * scale['y_std'] + scale['y_mean']
  np.testing.assert_allclose(mean, ensemble.predict(xt).member_mean[2], rtol=1e-4, atol=1e-3)


def test_a_regression_sweep_with_k_fold_resumes_exactly(tmp_path, caplog):
  """Resume, a per-member sweep and member_split together: resumed from what a kill after
  step 4's checkpoint leaves (runs.killed_after: a copy of the uninterrupted run without
  its later checkpoint), it ends where the uninterrupted run ends, held-out results too.
  The resume redraws each member's pool order of the interrupted epoch from its seed (the
  matrix preempts and resumes every case; this is the fast tier's resume of member pools)."""
  caplog.set_level(logging.INFO, logger='absl')
  dataset = data.from_arrays(*_curve(512, 0), *_curve(256, 1), name='curve')

  def config():
    c = _config()
    c.optim.learning_rate = [3e-3, 1e-2, 3e-3, 1e-2]
    c.data.member_split, c.data.member_order = 'kfold:2', 'shuffled'
    # Few steps: resume is exact after any number, and each step is host time here.
    c.train.steps, c.train.log_every, c.checkpoint.every = 8, 4, 4
    return c

  straight = dist_ens.train(config(), str(tmp_path / 'a'), dataset=dataset)
  resumed = dist_ens.train(config(), str(killed_after(tmp_path / 'a', 4, tmp_path / 'b')),
                           dataset=dataset)
  assert 'resuming from the checkpoint at step 4' in caplog.text
  for key in ('members', 'ensemble', 'member_split', 'hyperparameters'):
    assert resumed[key] == straight[key], key
  assert straight['hyperparameters']['optim.learning_rate'] == [3e-3, 1e-2, 3e-3, 1e-2]


def test_homoscedastic_noise_is_fitted_on_validation_and_used_by_predict(tmp_path):
  """The fitted level is each member's mean squared validation residual; with it the
  test intervals cover near their nominal rate, and Ensemble.predict uses the same levels."""
  rng = np.random.default_rng(3)
  x = rng.uniform(-1, 1, (1400, 1)).astype(np.float32)
  y = (20 * np.sin(3 * x[:, 0]) + 100 + 6 * rng.standard_normal(1400)).astype(np.float32)
  config = _config()
  config.task, config.data.validation_size = 'regression_homoscedastic', 300
  config.train.steps = 300
  config.checkpoint.every = 300
  final = dist_ens.train(config, str(tmp_path), dataset=data.from_arrays(
      x[:1000], y[:1000], x[1000:], y[1000:]))
  fitted = final['noise_variance']
  assert fitted['fitted_on'] == 'validation'
  # The members' validation MSE (target units) is the fitted level.
  np.testing.assert_allclose(np.asarray(fitted['target_units'])[:, 0],
                             np.square(final['validation']['members']['rmse']), rtol=1e-4)
  assert np.all(np.abs(np.sqrt(np.asarray(fitted['target_units'])) - 6) < 1.0)  # True noise: 6.
  assert abs(final['ensemble']['coverage_90'] - 0.9) < 0.06
  out = dist_ens.Ensemble.load(str(tmp_path)).predict(x[1000:])
  np.testing.assert_allclose(out.aleatoric, np.mean(np.asarray(fitted['target_units'])),
                             rtol=1e-4)
