"""benchmarks/testbed.py: the Neural Testbed's problems and its normalised joint KL."""

import importlib.util
import itertools
import types
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / 'benchmarks' / 'testbed.py'
_SPEC = importlib.util.spec_from_file_location('testbed', _PATH)
testbed = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(testbed)


def _true_agent(problem, test, members=1):
  """The true model's log-probabilities at the anchors, as M identical members."""
  log_p = problem.log_probs(test.anchors.reshape(-1, problem.d)).reshape(*test.anchors.shape[:2], 2)
  return np.broadcast_to(log_p, (members, *log_p.shape))


def test_problems_are_reproducible_and_their_labels_follow_the_true_model():
  a, b = testbed.make_problem(10, 10, 0.1, 0), testbed.make_problem(10, 10, 0.1, 0)
  for (wa, ba), (wb, bb) in zip(a.weights, b.weights):
    np.testing.assert_array_equal(wa, wb)
    np.testing.assert_array_equal(ba, bb)
  assert [w.shape for w, _ in a.weights] == [(10, 50), (50, 50), (50, 2)]
  assert not np.array_equal(a.weights[0][0], testbed.make_problem(10, 10, 0.1, 1).weights[0][0])
  x, y = testbed.sample(a, 20000, np.random.default_rng(0))
  p1 = np.exp(a.log_probs(x))[:, 1]
  assert y.mean() == pytest.approx(p1.mean(), abs=0.01)
  # A lower temperature sharpens the same function's probabilities.
  sharp = testbed.make_problem(10, 10, 0.1, 0)._replace(rho=0.01)
  assert np.abs(np.exp(sharp.log_probs(x))[:, 1] - 0.5).mean() > np.abs(p1 - 0.5).mean()


@pytest.mark.parametrize('tau', [1, 10])
def test_the_true_model_scores_zero_and_the_uniform_agent_one(tau):
  problem = testbed.make_problem(2, 10, 0.1, 0)
  test = testbed.dyadic_test(problem, tau, 500)
  assert test.anchors.shape == (500, 2, 2) and test.labels.shape == (500, tau)
  assert testbed.normalised_kl(_true_agent(problem, test, 3), test)['kl'] == pytest.approx(
      0, abs=1e-7)
  uniform = np.full((1, 500, 2, 2), np.log(0.5))
  assert testbed.normalised_kl(uniform, test)['normalised_kl'] == pytest.approx(1, abs=1e-12)
  # The truth mixed with its label-flipped twin predicts 1/2 everywhere: at tau = 1 it IS
  # the uniform agent; jointly it knows one of the two is right, so its KL stays below
  # log 2 at any tau, where the uniform agent's grows with tau.
  true = _true_agent(problem, test)
  mixed = testbed.normalised_kl(np.concatenate([true, true[..., ::-1]]), test)
  if tau == 1:
    assert mixed['normalised_kl'] == pytest.approx(1, abs=1e-9)
  else:
    assert mixed['kl'] <= np.log(2) + 1e-9 and mixed['uniform_kl'] > 2 * np.log(2)


def test_the_estimate_converges_to_the_exact_joint_kl_enumerated_in_float64():
  """KL(true joint || agent's) of each batch, exactly: a sum over all 2^tau label vectors
  (float64 numpy, no dist_ens), averaged over batches; the benchmark's Monte Carlo
  estimate (labels drawn from the true model) must agree within its sampling error."""
  problem, tau, batches = testbed.make_problem(2, 10, 0.5, 1), 3, 4000
  test = testbed.dyadic_test(problem, tau, batches, seed=3)
  rng = np.random.default_rng(0)  # A 3-member agent: the truth's logits, perturbed.
  true = _true_agent(problem, test)[0]  # [S, kappa, 2]
  agent = true[None] + rng.normal(0, 0.7, (3, 1, 1, 2)) + rng.normal(0, 0.3, (3, *true.shape))
  agent -= np.logaddexp.reduce(agent, axis=-1, keepdims=True)
  labels = np.array(list(itertools.product((0, 1), repeat=tau)))  # [2^tau, tau]
  exact = []
  for s in range(batches):
    rows = test.positions[s]
    log_true = true[s, rows[None], labels].sum(-1)  # [2^tau]
    log_agent = np.logaddexp.reduce(agent[:, s, rows[None], labels].sum(-1), axis=0) - np.log(3)
    exact.append(np.sum(np.exp(log_true) * (log_true - log_agent)))
  estimate = testbed.normalised_kl(agent, test)['kl']
  per_batch = test.true_joint - np.log(np.mean(np.exp(np.take_along_axis(
      np.take_along_axis(agent, test.positions[None, ..., None], 2),
      test.labels[None, ..., None], -1)[..., 0].sum(-1)), 0))
  assert estimate == pytest.approx(per_batch.mean(), abs=1e-9)
  assert abs(estimate - np.mean(exact)) < 4 * per_batch.std() / np.sqrt(batches)


class _FakeEnsemble:
  """member m's probability of class 1 at input row r (x = [[r]]) is (m + 1) / 100 + r / 1e4."""

  def predict(self, x):
    p1 = (np.arange(6)[:, None] + 1) / 100 + x[None, :, 0] / 1e4
    return types.SimpleNamespace(member_probs=np.stack([1 - p1, p1], -1))


def test_a_program_of_several_problems_scores_each_with_its_own_members_and_inputs():
  """Problems as blocks of one program: problem s's samples are members [s K, (s + 1) K)
  at its own rows, not another block's."""
  rows = [np.arange(4.0)[:, None], np.arange(4.0, 7.0)[:, None], np.arange(7.0, 9.0)[:, None]]
  agent = testbed.AGENTS['ensemble']
  out = testbed.group_log_probs(_FakeEnsemble(), agent, 2, rows, None, seed=0)
  assert [o.shape for o in out] == [(2, 4, 2), (2, 3, 2), (2, 2, 2)]
  for s, (o, r) in enumerate(zip(out, rows)):
    expected = (np.arange(2 * s, 2 * s + 2)[:, None] + 1) / 100 + r[None, :, 0] / 1e4
    np.testing.assert_allclose(np.exp(o[..., 1]), expected, rtol=1e-12)
