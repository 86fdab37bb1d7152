"""benchmarks/methods.py's comparison columns: the calibrated NLL (temperature scaling with
test-time cross-validation) and the deep-ensemble equivalent (Ashukha et al. 2020)."""

import numpy as np
import pytest

from benchmarks import methods


def _calibrated_problem(n=4000, classes=5, seed=0):
  """Logits z and labels drawn from softmax(z): softmax(z) is calibrated by construction."""
  rng = np.random.default_rng(seed)
  z = rng.normal(size=(n, classes)) * 1.5
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  y = np.array([rng.choice(classes, p=row) for row in p])
  return z, y


def test_temperature_scaling_undoes_overconfidence_on_held_out_halves():
  z, y = _calibrated_problem()
  log_softmax = lambda a: a - np.log(np.exp(a).sum(-1, keepdims=True))
  overconfident = log_softmax(3.0 * z)[None]  # one member, logits tripled
  assert methods._fitted_temperature(overconfident[0], y) == pytest.approx(3.0, rel=0.1)
  truth = methods._nll(z, y)
  calibrated = methods.calibrated_nll(overconfident, y)
  assert methods._nll(overconfident[0], y) > truth + 0.3  # tripled logits: much worse
  assert calibrated == pytest.approx(truth, abs=0.02)
  # Already calibrated: scaling changes (almost) nothing.
  assert methods.calibrated_nll(log_softmax(z)[None], y) == pytest.approx(truth, abs=0.01)


def test_the_mixture_of_members_is_what_is_calibrated():
  z, y = _calibrated_problem(seed=1)
  log_softmax = lambda a: a - np.log(np.exp(a).sum(-1, keepdims=True))
  members = np.stack([log_softmax(z + 2.0 * np.eye(5)[k]) for k in range(5)])
  mixture = np.log(np.exp(members).mean(0))
  assert methods.calibrated_nll(members, y) == pytest.approx(
      methods.calibrated_nll(mixture[None], y), abs=1e-9)


def test_dee_interpolates_the_deep_ensemble_curve():
  curve = [1.0, 0.8, 0.7, 0.65]
  assert methods.dee(0.75, curve) == pytest.approx(2.5)
  assert methods.dee(0.8, curve) == pytest.approx(2.0)
  assert methods.dee(1.0, curve) == pytest.approx(1.0)
  assert methods.dee(1.1, curve) == '<1'
  assert methods.dee(0.6, curve) == '>4'
  # A curve that is not monotone: the first k that reaches the value.
  assert methods.dee(0.72, [1.0, 0.7, 0.75, 0.6]) == pytest.approx(1 + 0.28 / 0.3)
