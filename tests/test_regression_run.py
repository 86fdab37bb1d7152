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
  the regression head make these programs this file's own at any size. No joint
  log-loss: no test here reads it."""
  return support.config({
      'task': 'regression', 'model.widths': (32,), 'optim.learning_rate': 1e-2,
      'optim.weight_decay': 0.0, 'data.batch_size': 64, 'train.steps': 300,
      'train.log_every': 100, 'checkpoint.every': 300, 'eval.joint_tau': 0})


def _curve_run(tmp_path_factory, run, targets, **dataset_fields):
  """(workdir, final metrics) of the curve's ensemble trained with _config() and a
  validation split of 128 (the conformal intervals' calibration) on targets(y)."""
  (x, y), (xt, yt) = _curve(512, 0), _curve(256, 1)
  dataset = data.from_arrays(x, targets(y), xt, targets(yt), **dataset_fields)
  workdir = tmp_path_factory.mktemp('regression') / run
  config = support.override(_config(), {'data.validation_size': 128})
  return workdir, dist_ens.train(config, str(workdir), dataset=dataset)


# One module fixture a run, so that no test waits for both trainings: the first test that
# reads a run trains it (the scaled run's programs are the plain run's, read from the
# compilation cache).
@pytest.fixture(scope='module')
def plain_run(tmp_path_factory):
  """_curve_run on the curve's own targets."""
  return _curve_run(tmp_path_factory, 'plain', lambda y: y, name='curve')


@pytest.fixture(scope='module')
def scaled_run(tmp_path_factory):
  """_curve_run on 1000 y + 5."""
  return _curve_run(tmp_path_factory, 'scaled', lambda y: 1000 * y + 5)


@pytest.fixture(scope='module')
def runs(plain_run, scaled_run):
  """Both curve runs by name ('plain', 'scaled'); the tests below only read them."""
  return {'plain': plain_run, 'scaled': scaled_run}


@pytest.fixture(scope='module')
def loaded(runs):
  """Ensemble.load of each of `runs`, shared by the tests that only predict from them."""
  return {name: dist_ens.Ensemble.load(str(workdir)) for name, (workdir, _) in runs.items()}


def test_a_regression_ensemble_trains_and_reports_its_metrics(plain_run):
  dataset = data.from_arrays(*_curve(512, 0), *_curve(256, 1), name='curve')
  assert dataset.train.y.dtype == np.float32 and dataset.num_classes == 0
  assert np.array_equal(dataset.train.y, _curve(512, 0)[1])  # Never cast to integers.
  workdir, final = plain_run
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


def test_a_regression_run_reports_conformal_intervals_in_target_units(runs, loaded):
  """A run with a validation split calibrates normalised-residual intervals on it; the
  loaded ensemble's predict_sets gives them again in the targets' own units (no
  randomness: the same coverage and width as the run's), and on 1000 y + 5 they are 1000
  times as wide and cover the same examples. No selective metrics: they are for
  classification (test_shift_eval's digits run reports them)."""
  xt, yt = _curve(256, 1)
  for name, scale in (('plain', 1.0), ('scaled', 1000.0)):
    _, final = runs[name]
    fitted = final['conformal']
    assert fitted['method'] == 'normalized_residual' and fitted['calibration_size'] == 128
    assert 'aurc' not in final and 'shift' not in final
    lower, upper = loaded[name].predict_sets(xt)
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


def _refused(call, match):
  with pytest.raises(ValueError, match=match) as refused:
    call()
  assert '\n' not in str(refused.value)


def test_a_regression_ensemble_loads_and_predicts_in_target_units(runs, loaded):
  """Ensemble.load of the run on 1000 y + 5 predicts in the targets' units. It has no
  Laplace predictive (eval.laplace fits a classifier's softmax layer): predict(laplace=True)
  and laplace_samples() are refused in one line before any input is read (None is passed),
  and the refused ensemble still predicts its own way (test_laplace_predict's refusals)."""
  xt, yt = _curve(256, 1)
  _, final = runs['scaled']  # trained on 1000 y + 5
  ensemble = loaded['scaled']
  assert ensemble.config.task == 'regression'
  _refused(lambda: ensemble.predict(None, laplace=True),
           r"predict\(laplace=True\): config\.task='regression'")
  _refused(lambda: ensemble.laplace_samples(None),
           r"laplace_samples\(\): config\.task='regression'")
  out = ensemble.predict(xt, batch_size=100)  # Raw inputs; three chunks, one padded.
  assert out.mean.shape == (256,) and out.member_mean.shape == (4, 256)
  # In the targets' units: the RMSE equals what training reported on the same test split.
  rmse = np.sqrt(np.mean((out.mean - (1000 * yt + 5)) ** 2))
  np.testing.assert_allclose(rmse, final['ensemble']['rmse'], rtol=1e-4)
  np.testing.assert_allclose(out.variance, out.aleatoric + out.epistemic, rtol=1e-5)
  np.testing.assert_allclose(out.mean, out.member_mean.mean(0), rtol=1e-5, atol=1e-3)
  np.testing.assert_allclose(out.epistemic, out.member_mean.var(0), rtol=1e-3, atol=1e-3)


def test_an_exported_regression_member_predicts_with_numpy_alone(loaded, tmp_path):
  """ensemble.json carries the task and the standardiser, so a member's .npz predicts in
  target units without dist_ens: standardise x, run the MLP, unscale the mean."""
  xt, _ = _curve(256, 1)
  ensemble = loaded['scaled']  # trained on 1000 y + 5
  paths = ensemble.export(tmp_path / 'members')
  meta = json.loads((tmp_path / 'members' / 'ensemble.json').read_text())
  assert meta['task'] == 'regression'
  scale = {k: np.asarray(v, np.float64) for k, v in meta['standardizer'].items()}
  w = np.load(paths[2])
  h = np.maximum(((xt - scale['x_mean']) / scale['x_std']) @ w['0/w'] + w['0/b'], 0)
  mean = (h @ w['1/w'] + w['1/b'])[:, 0] * scale['y_std'] + scale['y_mean']
  np.testing.assert_allclose(mean, ensemble.predict(xt).member_mean[2], rtol=1e-4, atol=1e-3)


def _noisy_curve():
  """1400 examples of 20 sin(3x) + 100 with Gaussian noise of std 6: (x, y)."""
  rng = np.random.default_rng(3)
  x = rng.uniform(-1, 1, (1400, 1)).astype(np.float32)
  y = (20 * np.sin(3 * x[:, 0]) + 100 + 6 * rng.standard_normal(1400)).astype(np.float32)
  return x, y


# The sweep's checkpoint before its last: at step 294, 6 steps before the end and inside an
# epoch of each member's 350-row pool (53.76 epochs of 64-row batches; 58.8 of 5 whole
# batches, were a pool's last partial batch dropped).
_KILLED_AT = 294


def _sweep_config():
  """_config() as the homoscedastic task with a validation split of 300, a per-member
  learning-rate sweep and member_split='kfold:2' with shuffled pools: 1000 training rows,
  300 for validation, each member trains on one fold of the 700 left (350 rows) and is
  scored on the other; saved at _KILLED_AT and at the end (checkpoint.keep=2 keeps both)."""
  config = _config()
  config.task, config.data.validation_size = 'regression_homoscedastic', 300
  config.optim.learning_rate = [1e-2, 2e-2, 1e-2, 2e-2]
  config.data.member_split, config.data.member_order = 'kfold:2', 'shuffled'
  config.checkpoint.every, config.checkpoint.keep = _KILLED_AT, 2
  return config


@pytest.fixture(scope='module')
def sweep(tmp_path_factory):
  """(workdir, final metrics, dataset) of _sweep_config() on _noisy_curve() (the first 1000
  examples to train and validate on, the last 400 to test): a homoscedastic regression
  sweep with k-fold member pools. The noise test only reads it (first in the file, it
  waits for this run, and the resume test for its resume alone); the resume test resumes
  a copy."""
  x, y = _noisy_curve()
  dataset = data.from_arrays(x[:1000], y[:1000], x[1000:], y[1000:])
  workdir = tmp_path_factory.mktemp('regression_sweep')
  return workdir, dist_ens.train(_sweep_config(), str(workdir), dataset=dataset), dataset


def test_homoscedastic_noise_is_fitted_on_validation_and_used_by_predict(sweep):
  """The fitted level is each member's mean squared validation residual; with it the
  test intervals cover near their nominal rate, and Ensemble.predict uses the same levels
  (the sweep's members, each standardised with its own fold's statistics)."""
  workdir, final, dataset = sweep
  fitted = final['noise_variance']
  assert fitted['fitted_on'] == 'validation'
  # The members' validation MSE (target units) is the fitted level.
  np.testing.assert_allclose(np.asarray(fitted['target_units'])[:, 0],
                             np.square(final['validation']['members']['rmse']), rtol=1e-4)
  assert np.all(np.abs(np.sqrt(np.asarray(fitted['target_units'])) - 6) < 1.0)  # True noise: 6.
  assert abs(final['ensemble']['coverage_90'] - 0.9) < 0.06
  out = dist_ens.Ensemble.load(str(workdir)).predict(_noisy_curve()[0][1000:])  # Raw x.
  np.testing.assert_allclose(out.aleatoric, np.mean(np.asarray(fitted['target_units'])),
                             rtol=1e-4)


def test_a_regression_sweep_with_k_fold_resumes_exactly(sweep, tmp_path, caplog):
  """Resume, a per-member sweep and member_split together: resumed from what a kill after
  the step-294 checkpoint leaves (runs.killed_after: a copy of the uninterrupted run without
  its later checkpoint), it ends where the uninterrupted run ends, held-out results,
  validation metrics and the fitted noise levels too. The resume redraws each member's pool
  order of the interrupted epoch from its seed (the matrix preempts and resumes every case;
  this is the fast tier's resume of member pools)."""
  caplog.set_level(logging.INFO, logger='absl')
  workdir, straight, dataset = sweep
  resumed = dist_ens.train(_sweep_config(),
                           str(killed_after(workdir, _KILLED_AT, tmp_path / 'b')),
                           dataset=dataset)
  assert f'resuming from the checkpoint at step {_KILLED_AT}' in caplog.text
  for key in ('members', 'ensemble', 'member_split', 'hyperparameters', 'validation',
              'noise_variance'):
    assert resumed[key] == straight[key], key
  assert straight['member_split']['spec'] == 'kfold:2'
  assert straight['hyperparameters']['optim.learning_rate'] == [1e-2, 2e-2, 1e-2, 2e-2]
