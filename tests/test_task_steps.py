"""Every step after training goes through the task (issue 44's failures): a regression
ensemble's top-k, greedy selection, snapshot and MC dropout members are scored with
regression's metrics; [N, D] targets train end to end; a step the task cannot do is
refused in one line before anything runs."""

import json
from pathlib import Path

import numpy as np
import pytest
import scipy.special

import support

import dist_ens
from dist_ens import data
from dist_ens.errors import ConfigError

DEFAULT = Path(__file__).parent.parent / 'configs' / 'default.py'
REGRESSION_KEYS = {'rmse', 'nll', 'crps'}


def _curve(n, seed, dims=0):
  rng = np.random.default_rng(seed)
  x = rng.uniform(-1, 1, (n, 3)).astype(np.float32)
  y = np.sin(3 * x[:, :1]) * np.arange(1, max(dims, 1) + 1) + 0.1 * rng.standard_normal(
      (n, max(dims, 1)))
  return x, (y if dims else y[:, 0]).astype(np.float32)


def _config(**overrides):
  # No joint log-loss (a program and numpy work after every run): nothing here reads it
  # (tests/test_joint.py checks it; the shared uci run, tests/runs.py, computes a
  # regression one).
  return support.config({'task': 'regression', 'data.validation_size': 64, 'train.steps': 20,
                         'train.log_every': 10, 'checkpoint.every': 20, 'eval.joint_tau': 0,
                         **overrides})


def _dataset(dims=0):
  return data.from_arrays(*_curve(256, 0, dims), *_curve(128, 1, dims), name='curve')


@pytest.fixture(scope='module')
def greedy_run(tmp_path_factory):
  """(workdir, final metrics) of a regression run with greedy selection of up to 6 picks
  (with replacement)."""
  workdir = tmp_path_factory.mktemp('greedy')
  config = _config(**{'select.method': 'greedy', 'select.greedy_size': 6})
  return workdir, dist_ens.train(config, str(workdir), dataset=_dataset())


@pytest.mark.parametrize('field, value', [('eval.temperature_scaling', True)])
def test_a_step_the_task_cannot_do_is_refused_before_anything_runs(tmp_path, field, value):
  with pytest.raises(ConfigError, match=rf"config\.{field} .*config\.task='regression'"):
    dist_ens.train(_config(**{field: value}), str(tmp_path / 'w'), dataset=_dataset())
  assert not (tmp_path / 'w').exists()


def test_regression_top_k_uses_regression_metrics(tmp_path):
  final = dist_ens.train(_config(**{'select.top_k': 2}), str(tmp_path), dataset=_dataset())
  # Before: KeyError 'accuracy' after training.
  assert REGRESSION_KEYS <= set(final['selected']['ensemble'])
  assert not {'accuracy', 'ece'} & set(final['selected']['ensemble'])


def test_regression_snapshot_members_use_regression_metrics(tmp_path):
  # The top-k run's config but for the method, so the programs they share (init, the test
  # and validation evaluations) are read from the compilation cache.
  config = _config(**{'ensemble.method': 'snapshot', 'ensemble.snapshot.cycles': 2,
                      'optim.schedule': 'cosine'})
  final = dist_ens.train(config, str(tmp_path), dataset=_dataset())
  # Before: the snapshot section was accuracy and ECE from a softmax of the members'
  # (mean, variance).
  assert REGRESSION_KEYS <= set(final['snapshot']['ensemble'])
  assert not {'accuracy', 'ece'} & set(final['snapshot']['ensemble'])
  assert final['snapshot']['predicting_members'] == 8


def _np_mixture_metrics(mean, var, y):
  """float64 numpy RMSE, NLL and CRPS of the uniform mixture of Gaussians mean, var [K, N]
  against targets y [N] (CRPS in closed form: E|X - y| - E|X - X'| / 2, with E|Z| of a
  normal Z ~ N(m, s2) = 2 sqrt(s2) phi(m / sqrt(s2)) + m (2 Phi(m / sqrt(s2)) - 1))."""
  mean, var, y = (np.asarray(a, np.float64) for a in (mean, var, y))

  def abs_mean(m, s2):
    z = m / np.sqrt(s2)
    return 2 * np.sqrt(s2) * np.exp(-0.5 * z ** 2) / np.sqrt(2 * np.pi) + m * (
        2 * scipy.special.ndtr(z) - 1)

  log_p = -0.5 * (y - mean) ** 2 / var - 0.5 * np.log(2 * np.pi * var)
  spread = abs_mean(mean[:, None] - mean[None], var[:, None] + var[None])  # [K, K, N]
  crps = abs_mean(y - mean, var).mean(0) - 0.5 * spread.mean((0, 1))
  return {'rmse': np.sqrt(np.mean((mean.mean(0) - y) ** 2)),
          'nll': -np.mean(np.logaddexp.reduce(log_p, axis=0) - np.log(len(mean))),
          'crps': np.mean(crps)}


def test_a_greedy_selection_scores_as_the_mixture_of_its_picks(greedy_run):
  """A regression run's greedy selection is scored with regression's metrics, and they are
  its picks' mixture (a member picked twice counts twice), recomputed with numpy from
  Ensemble.predict; and that reference with one pick is the member's own test metrics the
  run reports (a greedy selection of one member scores as that member)."""
  workdir, final = greedy_run
  greedy = final['greedy']
  assert set(greedy['ensemble']) == REGRESSION_KEYS  # Before: an IndexError.
  assert greedy['validation_nll'] == min(greedy['validation_nll_by_size'])
  test = _dataset().test
  pred = dist_ens.Ensemble.load(str(workdir)).predict(test.x)
  picks = final['greedy']['picks']
  want = _np_mixture_metrics(pred.member_mean[picks], pred.member_variance[picks], test.y)
  every = _np_mixture_metrics(pred.member_mean, pred.member_variance, test.y)
  for key in REGRESSION_KEYS:
    assert final['greedy']['ensemble'][key] == pytest.approx(want[key], rel=1e-4), key
    # The reference with all 4 members is the run's ensemble (the closed forms checked).
    assert final['ensemble'][key] == pytest.approx(every[key], rel=1e-4), key
  for member in range(4):
    alone = _np_mixture_metrics(pred.member_mean[member:member + 1],
                                pred.member_variance[member:member + 1], test.y)
    for key in REGRESSION_KEYS:
      assert final['members'][key][member] == pytest.approx(alone[key], rel=1e-4), key


def test_vector_targets_train_evaluate_and_predict(tmp_path):
  dataset = _dataset(dims=2)
  # No validation split: nothing here reads what it adds (the validation evaluation and
  # the conformal intervals calibrated on it; test_regression_run checks those).
  final = dist_ens.train(_config(**{'train.steps': 200, 'checkpoint.every': 200,
                                    'data.validation_size': 0}),
                         str(tmp_path), dataset=dataset)
  assert final['ensemble']['rmse'] < 0.8  # the targets' own spread is ~1.6
  prediction = dist_ens.Ensemble.load(str(tmp_path)).predict(dataset.test.x)
  assert prediction.mean.shape == (128, 2) and prediction.member_mean.shape == (4, 128, 2)
  # The mixture mean's RMSE, recomputed from predict, is the run's (pooled over dims).
  rmse = np.sqrt(np.mean(np.square(prediction.mean - dataset.test.y)))
  assert rmse == pytest.approx(final['ensemble']['rmse'], rel=1e-3)
  assert json.loads((tmp_path / 'final_metrics.json').read_text())['step'] == 200
