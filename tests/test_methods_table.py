"""benchmarks/methods.py's comparison columns: the calibrated NLL (temperature scaling fitted
on the validation split) and the deep-ensemble equivalent (Ashukha et al. 2020)."""

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


def _log_softmax(a):
  return a - np.log(np.exp(a).sum(-1, keepdims=True))


def test_a_temperature_fitted_on_validation_undoes_overconfidence_on_test():
  z, y = _calibrated_problem(n=6000)
  val, test = slice(0, 2000), slice(2000, None)
  overconfident = _log_softmax(3.0 * z)[None]  # one member, logits tripled
  nll, t = methods.calibrated(overconfident[:, val], y[val], overconfident[:, test], y[test])
  assert t == pytest.approx(3.0, rel=0.1)
  truth = methods._nll(z[test], y[test])
  assert methods._nll(overconfident[0, test], y[test]) > truth + 0.3  # tripled: much worse
  assert nll == pytest.approx(truth, abs=0.02)
  # Already calibrated: scaling changes (almost) nothing.
  calibrated = _log_softmax(z)[None]
  nll, t = methods.calibrated(calibrated[:, val], y[val], calibrated[:, test], y[test])
  assert t == pytest.approx(1.0, abs=0.1)
  assert nll == pytest.approx(truth, abs=0.01)


def test_the_temperature_comes_from_validation_alone():
  """Test labels that disagree with everything leave T alone: it is fitted on validation."""
  z, y = _calibrated_problem(n=3000, seed=2)
  members = _log_softmax(2.0 * z)[None]
  _, t = methods.calibrated(members[:, :1000], y[:1000], members[:, 1000:], y[1000:])
  _, t_flipped = methods.calibrated(members[:, :1000], y[:1000], members[:, 1000:],
                                    (y[1000:] + 1) % 5)
  assert t_flipped == t


def test_the_mixture_of_members_is_what_is_calibrated():
  z, y = _calibrated_problem(seed=1)
  members = np.stack([_log_softmax(z + 2.0 * np.eye(5)[k]) for k in range(5)])
  mixture = np.log(np.exp(members).mean(0))
  split = lambda a: (a[:, :2000], y[:2000], a[:, 2000:], y[2000:])
  got, want = methods.calibrated(*split(members)), methods.calibrated(*split(mixture[None]))
  assert got[0] == pytest.approx(want[0], abs=1e-6)
  assert got[1] == pytest.approx(want[1], rel=1e-5)
  # The deep-ensemble curve: the first k members' calibrated NLL, k = 1..K.
  curve = methods.deep_curve(*split(members))
  assert len(curve) == 5
  assert curve[2] == pytest.approx(methods.calibrated(*split(members[:3]))[0], abs=1e-9)


def test_dee_interpolates_the_deep_ensemble_curve():
  curve = [1.0, 0.8, 0.7, 0.65]
  assert methods.dee(0.75, curve) == pytest.approx(2.5)
  assert methods.dee(0.8, curve) == pytest.approx(2.0)
  assert methods.dee(1.0, curve) == pytest.approx(1.0)
  assert methods.dee(1.1, curve) == '<1'
  assert methods.dee(0.6, curve) == '>4'
  # A curve that is not monotone: the first k that reaches the value.
  assert methods.dee(0.72, [1.0, 0.7, 0.75, 0.6]) == pytest.approx(1 + 0.28 / 0.3)


def test_over_seeds_gives_mean_and_spread_and_each_seeds_dee():
  rows = [{'method': 'deep', 'seed': seed, 'calibrated_nll': nll, 'curve': curve,
           **{m: float(seed) for m in methods.METRICS if m != 'calibrated_nll'}}
          for seed, nll, curve in ((0, 0.8, [1.0, 0.8]), (1, 0.9, [1.0, 0.7]),
                                   (2, 1.1, [1.0, 0.9]))]
  methods.add_dee(rows)  # each seed's row on its own seed's curve
  assert [r['dee'] for r in rows] == [2.0, pytest.approx(1 + 0.1 / 0.3), '<1']
  row = methods.over_seeds(rows)
  assert row['calibrated_nll'] == pytest.approx(0.9333333)
  assert row['calibrated_nll_sd'] == pytest.approx(np.std([0.8, 0.9, 1.1], ddof=1))
  assert row['accuracy'] == 1.0 and row['accuracy_sd'] == 1.0
  assert row['seeds'] == [0, 1, 2] and len(row['per_seed']) == 3 and 'curve' not in row
  assert methods._dee_text(row) == '2.0 / 1.3 / <1'
  assert methods._cell(row, 'accuracy') == '1.000 +- 1.000'
  assert methods.over_seeds(rows[:1]) is rows[0]  # one seed: its row as it is
