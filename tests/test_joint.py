"""The dyadic joint log-loss (dist_ens.eval.joint) and its action after training."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import runs

import dist_ens
from dist_ens import data, tasks
from dist_ens.errors import ConfigError
from dist_ens.config.loading import load_config
from dist_ens.config.checks import validate
from dist_ens.eval import evaluate, joint
from dist_ens import Ensemble
from dist_ens.evaluators import joint as joint_action

ROOT = Path(__file__).resolve().parents[1]


def _joint64(member_probs, labels, batches):
  """(members [M], ensemble) mean -log joint likelihood, recomputed in float64 by hand."""
  p = np.asarray(member_probs, np.float64)[:, np.arange(len(labels)), labels]  # [M, N]
  members, ensemble = [], []
  for row in batches:
    per_member = np.prod(p[:, row], axis=1)  # prod over the tau positions
    members.append(-np.log(per_member))
    ensemble.append(-np.log(per_member.mean()))
  return np.mean(members, axis=0), float(np.mean(ensemble))


def test_dyadic_batches_draw_two_anchors_and_depend_only_on_their_arguments():
  batches = joint.dyadic_batches(500, tau=10, num_batches=2000, seed=3)
  assert batches.shape == (2000, 10) and batches.dtype == np.int64
  assert batches.min() >= 0 and batches.max() < 500
  distinct = np.array([len(set(row)) for row in batches])
  assert distinct.max() == 2 and (distinct == 1).mean() == pytest.approx(2 * 0.5 ** 10, abs=0.01)
  np.testing.assert_array_equal(batches, joint.dyadic_batches(500, 10, 2000, 3))
  assert not np.array_equal(batches, joint.dyadic_batches(500, 10, 2000, 4))
  counts = np.bincount(batches.ravel(), minlength=500)  # every example can be an anchor
  assert (counts > 0).mean() > 0.99
  assert joint.dyadic_batches(1, 3, 2, 0).tolist() == [[0, 0, 0], [0, 0, 0]]
  with pytest.raises(ValueError, match='>= 1'):
    joint.dyadic_batches(10, 0, 5, 0)


def test_joint_nll_is_a_product_within_members_and_a_mean_across_them():
  # Two members, sure of opposite labels: each alone pays a lot on one label, the pair
  # little; repeating an input doubles a member's loss but not the ensemble's.
  ll = np.log([[0.9, 0.1], [0.1, 0.9]])  # [M=2, N=2]
  one = joint.joint_log_loss(ll, np.array([[0, 0]]))
  np.testing.assert_allclose(one.members, [-2 * np.log(0.9), -2 * np.log(0.1)])
  assert one.ensemble == pytest.approx(-np.log((0.81 + 0.01) / 2))
  # The marginal mixture would give -2 log 0.5: the joint is not tau x the marginal.
  assert one.ensemble != pytest.approx(-2 * np.log(0.5))
  only_first = joint.joint_log_loss(ll, np.array([[0, 1]]), included=np.array([True, False]))
  assert only_first.ensemble == pytest.approx(-np.log(0.9 * 0.1))
  with pytest.raises(ValueError, match='no member'):
    joint.joint_nll(ll[:, None], np.zeros(2, bool))


def test_tau_one_covering_every_example_once_is_the_marginal_nll():
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 5, 300)
  logits = (2 * rng.standard_normal((4, 300, 5)) + 2 * np.eye(5)[labels]).astype(np.float32)
  task = tasks.get_task('classification')
  scored = evaluate.Scorer.of(task).metrics(logits, labels, np.ones(4, bool))
  cover = np.arange(300)[:, None]
  loss = joint.joint_log_loss(task.log_likelihood(logits, labels), cover)
  np.testing.assert_allclose(loss.members, scored['members']['nll'], rtol=1e-5)
  np.testing.assert_allclose(loss.ensemble, scored['ensemble']['nll'], rtol=1e-5)


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """A short 4-member deep ensemble on a 2 x 2 mesh with tau = 3; (workdir, final)."""
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.model.widths = 4, (32,)
  config.train.steps, config.train.log_every, config.train.eval_every = 30, 30, 0
  config.data.batch_size, config.writers = 64, ('jsonl',)
  config.mesh.member, config.mesh.data = 2, 2
  config.eval.joint_tau, config.eval.joint_batches = 3, 400
  workdir = tmp_path_factory.mktemp('joint')
  return workdir, dist_ens.train(config, str(workdir), devices=jax.devices()[:4])


def test_deep_ensemble_joint_equals_a_float64_recomputation_from_predict(run):
  workdir, final = run
  test = data.load_dataset('mnist1d').test
  out = Ensemble.load(workdir).predict(test.x)
  got = final['joint']
  assert (got['tau'], got['kappa'], got['batches']) == (3, 2, 400)
  assert json.loads((workdir / 'final_metrics.json').read_text())['joint'] == got
  batches = joint.dyadic_batches(len(test.y), 3, 400, seed=0)  # the run's: config.seed = 0
  members, ensemble = _joint64(out.member_probs, test.y, batches)
  np.testing.assert_allclose(got['members'], members, rtol=1e-5)
  assert got['ensemble'] == pytest.approx(ensemble, rel=1e-5)
  # Other batches give another figure (the check above can fail), within sampling.
  other_members, other = _joint64(out.member_probs, test.y,
                                  joint.dyadic_batches(len(test.y), 3, 400, seed=1))
  assert other != pytest.approx(ensemble, rel=1e-5)
  # A member's joint loss is a sum of its marginals: tau x its NLL, within sampling.
  np.testing.assert_allclose(got['members'], 3 * np.asarray(final['members']['nll']), rtol=0.15)
  # tau = 1 over every example once is exactly the run's marginal NLL.
  p = np.asarray(out.member_probs, np.float64)[:, np.arange(len(test.y)), test.y]
  cover = joint.joint_log_loss(np.log(p), np.arange(len(test.y))[:, None])
  assert cover.ensemble == pytest.approx(final['ensemble']['nll'], rel=1e-5)
  np.testing.assert_allclose(cover.members, final['members']['nll'], rtol=1e-5)
  splits = [json.loads(line) for line in (workdir / 'metrics.jsonl').open()]
  event = [e for e in splits if e.get('split') == 'test_joint']
  assert len(event) == 1 and event[0]['ensemble']['joint_nll'] == pytest.approx(ensemble, rel=1e-5)


def test_snapshot_joint_is_of_its_predicting_members(tmp_path):
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.model.widths = 2, (16,)
  config.train.steps, config.train.log_every, config.train.eval_every = 24, 24, 0
  config.data.batch_size, config.writers = 32, ()
  config.ensemble.method, config.ensemble.snapshot.cycles = 'snapshot', 3
  config.optim.schedule = 'cosine'
  config.eval.joint_tau, config.eval.joint_batches = 2, 300
  final = dist_ens.train(config, str(tmp_path), devices=jax.devices()[:2])
  test = data.load_dataset('mnist1d').test
  out = Ensemble.load(tmp_path).predict(test.x)
  assert out.member_probs.shape[0] == 6
  assert final['joint']['snapshot']['predicting_members'] == 6
  _, ensemble = _joint64(out.member_probs, test.y, joint.dyadic_batches(len(test.y), 2, 300, 0))
  assert final['joint']['snapshot']['ensemble'] == pytest.approx(ensemble, rel=1e-5)
  assert len(final['joint']['members']) == 2  # the trained members


def test_joint_tau_zero_leaves_it_out(tiny_run):
  # The session's shared finished run (tests/runs.py): support.config with eval.joint_tau=0.
  workdir, final = tiny_run
  assert runs.TINY['eval.joint_tau'] == 0
  assert 'joint' not in final
  assert 'joint' not in json.loads((workdir / 'final_metrics.json').read_text())


def test_joint_fields_are_checked_and_a_task_without_likelihoods_is_skipped():
  for field, value in (('joint_tau', -1), ('joint_batches', 0)):
    config = load_config(ROOT / 'configs' / 'default.py')
    config.eval[field] = value
    with pytest.raises(ConfigError, match=f'config.eval.{field}'):
      validate(config)
  task = tasks.get_task('classification')
  assert joint_action.joint_actions(0, 10, 0, task) == []
  assert len(joint_action.joint_actions(10, 10, 0, task)) == 1
  assert joint_action.joint_actions(10, 10, 0, task._replace(log_likelihood=None)) == []
