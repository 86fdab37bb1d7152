"""benchmarks/testbed.py: the Neural Testbed's problems and its normalised joint KL."""

import importlib.util
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
