"""config.data.member_split: K-fold and repeated hold-out as one run. Each member trains
on exactly its split's examples (checked by index through the input pipeline), each split's
ensemble is evaluated on its own held-out part (checked against an independent numpy
computation from Ensemble.predict), and results aggregate as mean +- standard error."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import support

import dist_ens
from dist_ens import data
from dist_ens.run import assemble
from dist_ens.data import member_split, uci
from dist_ens.errors import ConfigError

DEFAULT = Path(__file__).parent.parent / 'configs' / 'default.py'


def test_kfold_folds_partition_the_pool_and_each_split_trains_on_the_rest():
  splits = member_split.make_member_splits('kfold:4', 103, 8, seed=3)
  held = np.concatenate(splits.held_out)
  assert sorted(held.tolist()) == list(range(103))  # Disjoint folds covering the pool.
  assert sorted(map(len, splits.held_out)) == [25, 26, 26, 26]
  for train, out in zip(splits.train, splits.held_out):
    assert not set(train) & set(out) and len(train) + len(out) == 103
  assert [splits.split_of(m) for m in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
  again = member_split.make_member_splits('kfold:4', 103, 8, seed=3)
  assert all(np.array_equal(a, b) for a, b in zip(splits.held_out, again.held_out))


def test_holdout_splits_are_the_uci_protocols_splits():
  x, y = uci.read_uci(uci.SHIPPED['yacht'])
  splits = member_split.make_member_splits('holdout:3', len(y), 6, seed=0)
  for s in range(3):
    train, test = uci.load_uci('uci:yacht', split_index=s)
    assert np.array_equal(x[splits.train[s]], train.x)
    assert np.array_equal(y[splits.held_out[s]], test.y)
  assert len(member_split.make_member_splits('holdout:2:0.25', 100, 2, 0).held_out[1]) == 25


def test_blocks_are_contiguous_in_order_and_hold_nothing_out():
  splits = member_split.make_member_splits('blocks:3', 12, 6, seed=5)
  assert [t.tolist() for t in splits.train] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
  assert all(len(h) == 0 for h in splits.held_out)
  assert [p.tolist()[0] for p in splits.member_pools(6)] == [0, 0, 4, 4, 8, 8]


@pytest.mark.parametrize('spec, members, match', [
    ('kfold', 4, 'use'), ('kfold:x', 4, 'use'), ('fold:4', 4, 'use'), ('kfold:1', 4, 'K >= 2'),
    ('holdout:2:1.5', 4, r'fraction F in \(0, 1\)'), ('kfold:3', 4, 'multiple of 3'),
    ('kfold:200', 200, 'leave a fold empty'), ('blocks:3', 3, 'equal blocks'),
    ('blocks:0', 4, 'S >= 1'), ('blocks:2:0.5', 4, 'use')])
def test_bad_specs_are_refused_naming_the_field(spec, members, match):
  with pytest.raises(ConfigError, match=match) as info:
    member_split.make_member_splits(spec, 100, members, seed=0)
  assert 'config.data.member_split' in str(info.value) or 'num_members' in str(info.value)


def test_aggregate_is_the_mean_and_standard_error():
  values = [1.0, 2.0, 4.0, 7.0]
  out = member_split.aggregate(values)
  assert out['mean'] == pytest.approx(3.5)
  assert out['se'] == pytest.approx(np.std(values, ddof=1) / 2)
  assert member_split.aggregate([5.0]) == {'mean': 5.0, 'se': 0.0}


def _config(spec='kfold:4', members=8, order='shuffled'):
  config = dist_ens.load_config(DEFAULT)
  config.num_members = members
  config.data.member_split, config.data.member_order = spec, order
  config.data.batch_size = 32
  config.model.widths = (16,)  # support.config's MLP: the splits are the property, not it.
  config.train.steps, config.train.log_every, config.train.eval_every = 40, 20, 0
  config.checkpoint.every = 40
  config.writers = ('jsonl',)
  return config


@pytest.mark.parametrize('order', ['shuffled', 'shared', 'bootstrap'])
def test_each_member_reads_only_its_splits_training_examples(order):
  """Through the real pipeline on a 4 x 2 mesh: the indices in member m's batches over an
  epoch lie in its split's training part, and with 'shuffled' cover it exactly."""
  run = assemble.build_run(_config(order=order))
  splits = run.data.member_splits
  batches = run.batches(data.IteratorState(), 1, with_index=True)
  seen = [set() for _ in range(8)]
  try:
    for _ in range(run.data.order.batches_per_epoch):
      _, _, index = next(batches)
      index = np.asarray(jax.device_get(index))
      for m in range(8):
        seen[m] |= set(index[m].tolist())
  finally:
    batches.close()
  for m in range(8):
    train = set(splits.train[splits.split_of(m)].tolist())
    assert seen[m] <= train
    used = run.data.order.batches_per_epoch * 32
    assert len(seen[m]) == used if order != 'bootstrap' else len(seen[m]) < used
  if order == 'shared':  # Members of one split see the same batches; others do not.
    assert seen[0] == seen[1] and seen[0] != seen[2]


def test_bad_batch_for_a_split_is_refused():
  config = _config('holdout:2:0.5', members=2)
  config.data.batch_size = 3000
  with pytest.raises(ConfigError, match='member_split'):
    assemble.build_run(config)


def _curve(n, seed):
  rng = np.random.default_rng(seed)
  x = rng.uniform(-1, 1, (n, 1)).astype(np.float32)
  return x, (3 * np.sin(3 * x[:, 0]) + 5 + 0.3 * rng.standard_normal(n)).astype(np.float32)


def _outlier_pool(n=200):
  """A pool whose first held-out row of split 0 (held out by split 1 too) is an extreme
  outlier (x and y ~1e4)."""
  x, y = _curve(n, 2)
  splits = member_split.make_member_splits('holdout:2:0.2', n, 4, seed=0)
  row = splits.held_out[0][0]
  x[row], y[row] = 1e4, -1e4
  return x, y, splits, row


@pytest.fixture(scope='module')
def holdout_run(tmp_path_factory):
  """(workdir, final metrics, pool x, pool y, splits, the outlier's row) of ONE
  holdout:2:0.2 regression run of 4 members (2 per split, a (16,) MLP, batch 16, 200
  steps) on the outlier pool, whose outlier both splits hold out (no member trains on
  it). Both holdout tests read it: the aggregates and learning, and each split's own
  statistics."""
  workdir = tmp_path_factory.mktemp('holdout')
  x, y, splits, row = _outlier_pool()
  assert all(row in held for held in splits.held_out)
  config = _config('holdout:2:0.2', members=4, order='shuffled')
  config.task, config.data.batch_size = 'regression', 16
  config.model.widths = (16,)
  config.optim.learning_rate, config.optim.weight_decay = 1e-2, 0.0
  config.train.steps = config.checkpoint.every = 200
  config.eval.joint_tau = 0  # nothing here reads the joint log-loss (its own programs)
  assert config.seed == 0  # the seed _outlier_pool's splits are drawn with
  final = dist_ens.train(config, str(workdir), dataset=data.from_arrays(x, y, x[:8], y[:8]))
  return workdir, final, x, y, splits, row


def test_regression_holdout_run_reports_each_splits_ensemble_on_its_held_out_part(holdout_run):
  workdir, final, x, y, splits, row = holdout_run
  out = final['member_split']
  assert (out['splits'], out['members_per_split'], len(out['members']['rmse'])) == (2, 2, 4)
  # Independently: the split ensemble's RMSE from the members' predicted means.
  pred = dist_ens.Ensemble.load(str(workdir)).predict(x)
  rmses = []
  for s, held in enumerate(splits.held_out):
    mean = pred.member_mean[2 * s:2 * s + 2, held].mean(axis=0)
    rmses.append(np.sqrt(np.mean((mean - y[held]) ** 2)))
    assert out['per_split'][s]['ensemble']['rmse'] == pytest.approx(rmses[-1], rel=1e-4)
    assert out['per_split'][s]['held_out'] == len(held) == 40
    # Learned (the curve's std is ~2.2), on the split's held-out rows but the outlier.
    curve = held[held != row]
    error = pred.member_mean[2 * s:2 * s + 2, curve].mean(axis=0) - y[curve]
    assert np.sqrt(np.mean(error ** 2)) < 0.6
  assert out['ensemble']['rmse']['mean'] == pytest.approx(np.mean(rmses), rel=1e-4)
  assert out['ensemble']['rmse']['se'] == pytest.approx(
      np.std(rmses, ddof=1) / np.sqrt(2), rel=1e-3)
  assert out['ensemble']['nll']['mean'] < out['member_mean']['nll']['mean']


# MNIST-1D's training split less one example: 3,999 rows, so kfold:2's folds differ in size.
MNIST1D = data.load_dataset('mnist1d')
ODD_POOL = data.from_arrays(MNIST1D.train.x[:-1], MNIST1D.train.y[:-1], MNIST1D.test.x,
                            MNIST1D.test.y)


@pytest.fixture(scope='module')
def kfold2(tmp_path_factory):
  """(workdir, final metrics, (examples, the prediction program's cache size) after each
  predicted split) of ONE kfold:2 run of support.config's 4 members (2 per fold) on
  ODD_POOL with an evaluation batch of 2,000 (its init and test programs are the shared
  tiny run's, from the persistent cache in the suite): the two kfold tests read it."""
  from dist_ens.eval import shift  # pylint: disable=import-outside-toplevel
  workdir, traces = tmp_path_factory.mktemp('kfold2'), []
  original = shift.PredictionEvaluator.predict

  def counting(self, state, split, *args, **kwargs):
    out = original(self, state, split, *args, **kwargs)
    traces.append((len(split.y), self.step._cache_size()))  # pylint: disable=protected-access
    return out

  shift.PredictionEvaluator.predict = counting
  try:
    config = support.config({'data.member_split': 'kfold:2', 'eval.batch_size': 2000})
    final = dist_ens.train(config, str(workdir), dataset=ODD_POOL)
  finally:
    shift.PredictionEvaluator.predict = original
  return workdir, final, traces


def test_kfold_classification_run_evaluates_each_fold(kfold2):
  workdir, final, _ = kfold2
  out = final['member_split']
  assert out['splits'] == 2 and len(out['members']['accuracy']) == 4
  assert len(final['members']['accuracy']) == 4  # The test split is still evaluated.
  # Independently: fold k's ensemble (members 2k, 2k+1) on fold k's examples.
  train = ODD_POOL.train
  # All 4,000 rows predicted, the pool's 3,999 read: one program (batches of 1,000), not a
  # second one for a short last batch.
  probs = dist_ens.Ensemble.load(str(workdir)).predict(
      MNIST1D.train.x, preprocessed=True).member_probs[:, :len(train.y)]
  splits = member_split.make_member_splits('kfold:2', len(train.y), 4, seed=0)
  for k, held in enumerate(splits.held_out):
    ensemble = probs[2 * k:2 * k + 2, held].mean(axis=0)
    accuracy = np.mean(ensemble.argmax(-1) == train.y[held])
    assert out['per_split'][k]['ensemble']['accuracy'] == pytest.approx(accuracy, abs=1e-6)
    for m in (2 * k, 2 * k + 1):
      member = np.mean(probs[m, held].argmax(-1) == train.y[held])
      assert out['members']['accuracy'][m] == pytest.approx(member, abs=1e-6)


def test_population_based_training_is_refused_with_a_member_split(tmp_path):
  config = _config('kfold:2', members=4)
  config.pbt.enabled, config.data.validation_size = True, 100
  config.optim.learning_rate = 'loguniform(1e-4,1e-2)'
  with pytest.raises(ConfigError, match='data.member_split'):
    dist_ens.train(config, str(tmp_path))


def test_held_out_parts_of_different_sizes_share_one_evaluation_program(kfold2):
  """kfold:2 of ODD_POOL's 3,999 training examples gives parts of 2,000 and 1,999: the
  test split and both parts run one compiled program, the one that predicts the test split."""
  _, final, traces = kfold2
  assert [p['held_out'] for p in final['member_split']['per_split']] == [2000, 1999]
  assert [n for n, _ in traces[-2:]] == [2000, 1999]  # The held-out parts came last,
  assert {size for _, size in traces} == {1}  # and compiled nothing new.
  assert len(ODD_POOL.test.y) in [n for n, _ in traces[:-2]]


def test_each_splits_statistics_come_from_its_training_rows_only():
  """A held-out row, however extreme, does not move its split's statistics; every member's
  batches are its split's rows standardised with them (issue 45 item 3)."""
  x, y, splits, row = _outlier_pool()
  config = _config('holdout:2:0.2', members=4)
  config.task, config.data.batch_size = 'regression', 16
  run = assemble.build_run(config, dataset=data.from_arrays(x, y, x[:8], y[:8]))
  for s, rows in enumerate(splits.train):
    want = uci.Standardizer.fit(x[rows], y[rows])
    for got, expected in zip(run.data.split_scales[s], want):
      np.testing.assert_array_equal(got, expected)
  assert abs(float(run.data.split_scales[0].y_mean)) < 100  # The outlier is not in it.
  batches = run.batches(data.IteratorState(), 1, with_index=True)
  try:
    bx, by, index = (np.asarray(jax.device_get(a)) for a in next(batches))
  finally:
    batches.close()
  for m in range(4):
    own = run.data.split_scales[splits.split_of(m)]
    ex, ey = own.apply(x[index[m]], y[index[m]])
    np.testing.assert_array_equal(bx[m], ex)
    np.testing.assert_array_equal(by[m], ey)


def test_held_out_metrics_use_each_splits_own_statistics_in_target_units(holdout_run,
                                                                        tmp_path):
  """Both splits hold out an outlier: their metrics, in target units, equal a numpy
  recomputation from Ensemble.predict, whose members each use their split's statistics."""
  workdir, final, x, y, splits, _ = holdout_run
  out = final['member_split']
  ens = dist_ens.Ensemble.load(str(workdir))
  assert len(ens.split_scales) == 2
  pred = ens.predict(x)
  for s, held in enumerate(splits.held_out):
    own = uci.Standardizer.fit(x[splits.train[s]], y[splits.train[s]])
    members = slice(2 * s, 2 * s + 2)
    # Member means in target units are the split's standardised predictions converted back.
    assert np.all(np.isfinite(pred.member_mean[members, held]))
    mean = pred.member_mean[members, held].mean(axis=0)
    rmse = np.sqrt(np.mean((mean - y[held]) ** 2))
    assert out['per_split'][s]['ensemble']['rmse'] == pytest.approx(rmse, rel=1e-4)
    mu, var = pred.member_mean[members, held], pred.member_variance[members, held]
    log_p = -0.5 * (np.asarray(y[held], np.float64) - mu) ** 2 / var - 0.5 * np.log(2 * np.pi * var)
    top = log_p.max(0)  # log of the mixture's density, without underflow at the outlier
    mixture = top + np.log(np.mean(np.exp(log_p - top), 0))
    assert out['per_split'][s]['ensemble']['nll'] == pytest.approx(-np.mean(mixture), rel=1e-3)
    np.testing.assert_allclose(
        ens.split_scales[s].y_std, own.y_std)
  exported = json.loads((ens.export(tmp_path / 'export')[0].parent / 'ensemble.json').read_text())
  assert exported['members_per_split'] == 2 and len(exported['split_standardizers']) == 2


def test_a_standardised_holdout_runs_test_metrics_are_what_predict_gives(holdout_run):
  """The heteroscedastic case of the blocks test below, on the shared holdout run: its test
  split is the pool's first 8 rows, the outlier (row 0) among them, and the pool's
  statistics (the outlier's x and y ~1e4 in them) are far from either split's, so the run's
  test RMSE and NLL equal a numpy recomputation from Ensemble.predict, the mixture of all
  4 members in target units, only if evaluation scores each member in its own split's
  units (run/split_frames.py)."""
  workdir, final, x, y, splits, row = holdout_run
  pool = uci.Standardizer.fit(x, y)
  for rows in splits.train:
    assert float(pool.y_std) > 100 * float(uci.Standardizer.fit(x[rows], y[rows]).y_std)
  test_x, test_y = np.asarray(x[:8], np.float64), np.asarray(y[:8], np.float64)
  assert row < 8 and np.array_equal(test_x[row], [1e4])
  pred = dist_ens.Ensemble.load(str(workdir)).predict(x[:8])
  rmse = float(np.sqrt(np.mean((np.asarray(pred.mean, np.float64) - test_y) ** 2)))
  assert final['ensemble']['rmse'] == pytest.approx(rmse, rel=1e-4)
  mu, var = (np.asarray(a, np.float64) for a in (pred.member_mean, pred.member_variance))
  log_p = -0.5 * (test_y - mu) ** 2 / var - 0.5 * np.log(2 * np.pi * var)
  top = log_p.max(0)  # log of the mixture's density, without underflow at the outlier
  nll = -np.mean(top + np.log(np.mean(np.exp(log_p - top), 0)))
  assert final['ensemble']['nll'] == pytest.approx(nll, rel=1e-4)


def test_a_standardising_task_without_reframe_is_refused_with_member_splits(tmp_path):
  """Scoring each split's members needs Task.reframe; a user's standardising task without
  one is refused in one line naming both fields, before the workdir exists."""
  x, y = _curve(64, 3)
  config = _config('kfold:2', members=4)
  config.task, config.data.batch_size = 'ext_fixtures:standardising_task_without_reframe', 16
  with pytest.raises(ConfigError) as refused:
    dist_ens.train(config, str(tmp_path / 'w'), dataset=data.from_arrays(x, y, x[:8], y[:8]))
  message = str(refused.value)
  assert '\n' not in message and 'data.member_split' in message and 'config.task' in message
  assert 'reframe' in message and not (tmp_path / 'w').exists()


def test_a_standardised_member_split_runs_test_metrics_are_what_predict_gives(tmp_path):
  """Two contiguous blocks of a pool sorted by x: their statistics differ, so the run's
  test RMSE and NLL equal a numpy recomputation from Ensemble.predict (each split's
  members standardised with their own statistics, the mixture in target units) only if
  evaluation scores each member in its own split's units too (run/split_frames.py; with
  the pool's statistics for every member the RMSE was 2.50 against predict's 1.94). The
  homoscedastic task here; the heteroscedastic one on the shared holdout run (the test
  above), which saves a run of its own programs."""
  x, y = _curve(128, 2)
  order = np.argsort(x[:, 0])
  x, y = x[order], y[order]
  config = _config('blocks:2', members=4)
  config.task, config.data.batch_size = 'regression_homoscedastic', 16
  config.eval.joint_tau = 0  # nothing here reads the joint log-loss (its own programs)
  final = dist_ens.train(config, str(tmp_path), dataset=data.from_arrays(x, y, x[::4], y[::4]))
  pred = dist_ens.Ensemble.load(str(tmp_path)).predict(x[::4])
  rmse = float(np.sqrt(np.mean((np.asarray(pred.mean, np.float64) - y[::4]) ** 2)))
  assert final['ensemble']['rmse'] == pytest.approx(rmse, rel=1e-4)
  mu, var = (np.asarray(a, np.float64) for a in (pred.member_mean, pred.member_variance))
  log_p = -0.5 * (y[::4] - mu) ** 2 / var - 0.5 * np.log(2 * np.pi * var)
  top = log_p.max(0)
  nll = -np.mean(top + np.log(np.mean(np.exp(log_p - top), 0)))
  assert final['ensemble']['nll'] == pytest.approx(nll, rel=1e-4)
