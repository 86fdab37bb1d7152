"""What a run reports for decisions, against independent computations: AURC and accuracy
at coverage from a split's per-example stats, conformal coverage of the run's ensemble
predictor over repeated splits, and the shift summary's means."""

import math

import numpy as np
import pytest

from dist_ens import tasks
from dist_ens.eval import decisions
from dist_ens.eval.ranks import ExampleStats

N_CAL = N_TEST = 1000
SPLITS = 200


def _stats(n=500, m=3, seed=0):
  rng = np.random.default_rng(seed)
  member = rng.random((m, n))
  return ExampleStats(member, member > 0.5, member, rng.random(n), rng.random(n) < 0.7,
                      rng.random(n) * 2, rng.random(n) * 0.3)


def _aurc_by_loop(score, correct):
  """The risk-coverage curve's mean, one coverage at a time (scores distinct)."""
  order = sorted(range(len(score)), key=lambda i: -score[i])
  risks = [sum(1 - correct[i] for i in order[:k]) / k for k in range(1, len(score) + 1)]
  return sum(risks) / len(risks), order


def test_aurc_and_accuracy_at_coverage_equal_a_loop():
  stats = _stats()
  report = decisions.selective_report(stats)
  correct = np.asarray(stats.ensemble_correct, float)
  for name, score in [('confidence', stats.ensemble_confidence), ('entropy', -stats.entropy),
                      ('mutual_information', -stats.mutual_information)]:
    want, order = _aurc_by_loop(list(score), list(correct))
    assert report['aurc'][name] == pytest.approx(want, abs=1e-6)
    for pct, got in report['accuracy_at_coverage'][name].items():
      k = math.ceil(float(pct) / 100 * len(score) - 1e-9)
      assert got == pytest.approx(np.mean(correct[order[:k]]), abs=1e-6), (name, pct)
  # Ranking by correctness itself is the best order: excess AURC >= 0.
  assert all(v >= -1e-12 for v in report['excess_aurc'].values())
  assert decisions.selective_report(object()) is None  # another task's stats


def _classification(seed, n=N_CAL + N_TEST, m=3, c=10):
  """Members' logits; labels drawn from sharper logits than theirs (miscalibrated)."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(m, n, c)) * 2
  truth = np.exp(2 * logits.mean(0))
  truth /= truth.sum(-1, keepdims=True)
  return logits, (truth.cumsum(1) > rng.random((n, 1))).argmax(1)


def _regression(seed, n=N_CAL + N_TEST, m=4):
  """Members' [mean, raw variance] outputs for targets with heteroscedastic noise."""
  rng = np.random.default_rng(seed)
  x = rng.uniform(-2, 2, n)
  y = np.sin(x) + rng.normal(size=n) * (0.2 + 0.3 * np.abs(x))
  means = np.sin(x)[None] + rng.normal(size=(m, n)) * 0.1
  raw = np.broadcast_to(np.log(np.expm1(0.1)), (m, n))  # a variance the model gets wrong
  return np.stack([means, raw], axis=-1).astype(np.float32), y


@pytest.mark.parametrize('kind', ['classification', 'regression'])
def test_conformal_coverage_is_one_minus_alpha_over_repeated_splits(kind):
  alpha = 0.1
  outputs, y = (_classification if kind == 'classification' else _regression)(seed=0)
  predict = None if kind == 'classification' else tasks.get_task('regression').predict
  mask = np.ones(outputs.shape[0], bool)
  rng = np.random.default_rng(1)
  coverages, sizes = [], []
  for i in range(SPLITS if kind == 'classification' else SPLITS // 2):
    perm = rng.permutation(len(y))
    cal, test = perm[:N_CAL], perm[N_CAL:]
    fit = decisions.fit_conformal(outputs[:, cal], y[cal], mask, alpha, 2 * i, predict)
    out = decisions.conformal_report(fit, outputs[:, test], y[test], mask, 2 * i + 1, predict)
    coverages.append(out['coverage'])
    sizes.append(out.get('mean_set_size', out.get('mean_width')))
  assert abs(np.mean(coverages) - (1 - alpha)) < 0.02, np.mean(coverages)
  assert np.mean(sizes) > 0


def test_regression_intervals_are_wider_where_the_ensemble_is_unsure_and_in_target_units():
  outputs, y = _regression(seed=2)
  outputs = outputs.copy()
  outputs[1, :, 0] += np.linspace(0, 2, outputs.shape[1])  # members disagree more later
  predict, mask = tasks.get_task('regression').predict, np.ones(4, bool)
  fit = decisions.fit_conformal(outputs, y, mask, 0.1, 0, predict)
  mean, variance = (np.asarray(v) for v in (predict(outputs, mask)['mean'],
                                            predict(outputs, mask)['variance']))
  assert fit.method == 'normalized_residual'
  want = np.quantile(np.abs(y - mean) / np.sqrt(variance), 0.9, method='higher')
  assert fit.threshold == pytest.approx(want, rel=1e-3)
  unit = decisions.conformal_report(fit, outputs, y, mask, 1, predict)
  scaled = decisions.conformal_report(fit, outputs, y, mask, 1, predict, y_scale=3.0)
  assert scaled['mean_width'] == pytest.approx(3 * unit['mean_width'])
  assert unit['mean_width'] == pytest.approx(np.mean(2 * fit.threshold * np.sqrt(variance)))


def test_shift_summary_means_every_metric_over_the_pairs():
  pair = lambda a, nll: {'members': {'accuracy': [a, a / 2]},
                         'ensemble': {'accuracy': a, 'nll': nll, 'ece': 0.1},
                         'selective': {'aurc': {'confidence': nll / 10}}}
  summary = decisions.shift_summary({('contrast', 1): pair(0.8, 1.0),
                                     ('contrast', 3): pair(0.6, 2.0),
                                     ('gaussian_noise', 2): pair(0.4, 3.0)})
  assert summary['pairs'] == 3 and set(summary['corruptions']['contrast']) == {'1', '3'}
  assert summary['cA'] == pytest.approx(0.6) and summary['cNLL'] == pytest.approx(2.0)
  assert summary['cCE'] == pytest.approx(0.1)
  assert summary['mean']['members']['accuracy'] == pytest.approx([0.6, 0.3])
  assert summary['mean']['selective']['aurc']['confidence'] == pytest.approx(0.2)
