"""mCE against a baseline run (config.eval.shift_baseline): two tiny runs, the second's
CE / mCE / relative mCE checked against numpy on both runs' final_metrics.json, and
the baseline's errors refused before training."""

import json

import numpy as np
import pytest

import support

from dist_ens import data
from dist_ens.config.checks import validate
from dist_ens.errors import ConfigError
from dist_ens.training.trainer import train

PAIRS = 'gaussian_noise:2-4,contrast:3-5,pixelate:4'


def _dataset():
  rng = np.random.default_rng(0)
  centres = rng.random((4, 8, 8, 1), dtype=np.float32)

  def split(n, seed):
    r = np.random.default_rng(seed)
    y = r.integers(0, 4, n).astype(np.int32)
    noise = 0.25 * r.standard_normal((n, 8, 8, 1)).astype(np.float32)
    return np.clip(centres[y] + noise, 0, 1), y

  return data.from_arrays(*split(256, 1), *split(200, 2))


def _config(seed, steps, shift=PAIRS, baseline=''):
  """support.config's run (a (16,) MLP, batch 32) for `steps` steps, logged and saved at
  the end only, evaluated on the `shift` pairs against `baseline`. Kept: 3 members, not 4:
  the 8 x 8 images make these programs this file's own, and each member is evaluated on
  every pair (4 measured about 7% more CPU). Two steps a call whatever `steps`: the
  automatic choice (a divisor of steps) would make a run of 4 steps and one of 30 two
  train programs, each compiled. No joint evaluation: programs of its own that no test
  here reads."""
  return support.config({'num_members': 3, 'seed': seed, 'train.steps': steps,
                         'train.log_every': steps, 'checkpoint.every': steps,
                         'train.steps_per_call': 2, 'eval.joint_tau': 0,
                         'eval.shift': shift, 'eval.shift_baseline': baseline})


def _errors(result):
  members = 1 - np.asarray(result['members']['accuracy'])
  return np.array([1 - result['ensemble']['accuracy'], members.mean(), *members])


def test_mce_equals_numpy_on_two_runs(tmp_path, devices):
  base, run = tmp_path / 'base', tmp_path / 'run'
  # One seed for both: the seed is compiled into the init and shift-evaluation programs,
  # so the run reads the baseline's programs from the cache (its first 4 steps are the
  # baseline's).
  train(_config(1, 4), str(base), devices=devices[:1], dataset=_dataset())
  train(_config(1, 30, baseline=str(base)), str(run), devices=devices[:1], dataset=_dataset())
  baseline = json.loads((base / 'final_metrics.json').read_text())
  final = json.loads((run / 'final_metrics.json').read_text())
  shift = final['shift']
  ce, relative = {}, {}
  for name, severities in shift['corruptions'].items():
    mine = sum(_errors(r) for r in severities.values())
    theirs = sum(1 - baseline['shift']['corruptions'][name][s]['ensemble']['accuracy']
                 for s in severities)
    k = len(severities)
    ce[name] = mine / theirs
    relative[name] = (mine - k * _errors(final)) / (
        theirs - k * (1 - baseline['ensemble']['accuracy']))
  assert set(ce) == {'gaussian_noise', 'contrast', 'pixelate'}
  assert shift['baseline'] == str(base)
  for key, table in (('mCE', ce), ('relative_mCE', relative)):
    want = np.mean(list(table.values()), axis=0)
    got = shift[key]
    np.testing.assert_allclose([got['ensemble'], got['mean_member'], *got['members']], want,
                               rtol=1e-9)
  for name, want in ce.items():
    np.testing.assert_allclose([shift['CE'][name]['ensemble'], shift['CE'][name]['mean_member']],
                               want[:2], rtol=1e-9)
    np.testing.assert_allclose(shift['relative_CE'][name]['ensemble'], relative[name][0],
                               rtol=1e-9)
  # 30 steps against 4: the better-trained ensemble errs less than the baseline.
  assert shift['mCE']['ensemble'] < 1


def test_a_bad_baseline_fails_before_training(tmp_path, devices):
  missing = tmp_path / 'nowhere'
  with pytest.raises(ConfigError, match=r'eval\.shift_baseline=.*nowhere.*no finished run'):
    train(_config(0, 4, baseline=str(missing)), str(tmp_path / 'a'), devices=devices[:1],
          dataset=_dataset())
  assert not (tmp_path / 'a').exists()  # refused before the workdir is written
  plain = tmp_path / 'plain'
  plain.mkdir()
  (plain / 'final_metrics.json').write_text(json.dumps({'ensemble': {'accuracy': 0.9}}))
  with pytest.raises(ConfigError, match=r"eval\.shift_baseline=.*no 'shift' section"):
    train(_config(0, 4, baseline=str(plain)), str(tmp_path / 'b'), devices=devices[:1],
          dataset=_dataset())
  fewer = {'ensemble': {'accuracy': 0.9}, 'shift': {'spec': 'contrast:3', 'corruptions': {
      'contrast': {'3': {'ensemble': {'accuracy': 0.5}}}}}}
  (plain / 'final_metrics.json').write_text(json.dumps(fewer))
  with pytest.raises(ConfigError, match=r"eval\.shift='contrast:3', which lacks 6 of this "
                                        r"run's 7 pairs \(gaussian_noise:2, gaussian_noise:3"):
    train(_config(0, 4, baseline=str(plain)), str(tmp_path / 'c'), devices=devices[:1],
          dataset=_dataset())
  assert not (tmp_path / 'c').exists()
  config = _config(0, 4, shift='', baseline=str(plain))
  with pytest.raises(ConfigError, match=r'eval\.shift_baseline=.*eval\.shift set too'):
    validate(config)
