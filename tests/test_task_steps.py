"""Every step after training goes through the task (issue 44's failures): a regression
ensemble's top-k, greedy selection, snapshot and MC dropout members are scored with
regression's metrics; [N, D] targets train end to end; a step the task cannot do is
refused in one line before anything runs."""

import json
from pathlib import Path

import numpy as np
import pytest

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


def test_regression_top_k_greedy_and_collected_members_use_regression_metrics(tmp_path):
  config = _config(**{'select.top_k': 2, 'ensemble.method': 'snapshot',
                      'ensemble.snapshot.cycles': 2, 'optim.schedule': 'cosine'})
  final = dist_ens.train(config, str(tmp_path / 'topk'), dataset=_dataset())
  # Before: KeyError 'accuracy' after training; the snapshot section was accuracy and
  # ECE from a softmax of the members' (mean, variance).
  assert REGRESSION_KEYS <= set(final['selected']['ensemble'])
  assert REGRESSION_KEYS <= set(final['snapshot']['ensemble'])
  assert not {'accuracy', 'ece'} & set(final['snapshot']['ensemble'])
  assert final['snapshot']['predicting_members'] == 8
  config = _config(**{'select.method': 'greedy', 'select.greedy_size': 6})
  final = dist_ens.train(config, str(tmp_path / 'greedy'), dataset=_dataset())
  greedy = final['greedy']
  assert set(greedy['ensemble']) == REGRESSION_KEYS  # Before: an IndexError.
  assert greedy['validation_nll'] == min(greedy['validation_nll_by_size'])


def test_a_greedy_selection_of_one_member_scores_as_that_member(tmp_path):
  """The greedy ensemble's test metrics are the chosen members' mixture: with one pick
  it is that member, whose own test metrics the run reports too."""
  config = _config(**{'select.method': 'greedy', 'select.greedy_size': 1})
  final = dist_ens.train(config, str(tmp_path), dataset=_dataset())
  [member] = final['greedy']['picks']
  for key in REGRESSION_KEYS:
    assert final['greedy']['ensemble'][key] == pytest.approx(final['members'][key][member],
                                                             rel=1e-4)


@pytest.mark.parametrize('field, value', [('eval.temperature_scaling', True)])
def test_a_step_the_task_cannot_do_is_refused_before_anything_runs(tmp_path, field, value):
  with pytest.raises(ConfigError, match=rf"config\.{field} .*config\.task='regression'"):
    dist_ens.train(_config(**{field: value}), str(tmp_path / 'w'), dataset=_dataset())
  assert not (tmp_path / 'w').exists()


def test_vector_targets_train_evaluate_and_predict(tmp_path):
  dataset = _dataset(dims=2)
  final = dist_ens.train(_config(**{'train.steps': 200, 'checkpoint.every': 200}),
                         str(tmp_path), dataset=dataset)
  assert final['ensemble']['rmse'] < 0.8  # the targets' own spread is ~1.6
  prediction = dist_ens.Ensemble.load(str(tmp_path)).predict(dataset.test.x)
  assert prediction.mean.shape == (128, 2) and prediction.member_mean.shape == (4, 128, 2)
  # The mixture mean's RMSE, recomputed from predict, is the run's (pooled over dims).
  rmse = np.sqrt(np.mean(np.square(prediction.mean - dataset.test.y)))
  assert rmse == pytest.approx(final['ensemble']['rmse'], rel=1e-3)
  assert json.loads((tmp_path / 'final_metrics.json').read_text())['step'] == 200
