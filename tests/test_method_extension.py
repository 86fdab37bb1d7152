"""A user's ensemble method, defined here (not in dist_ens), used by import path:
config.ensemble.method = 'test_method_extension:make', its fields in
config.ensemble.options. And: no module of dist_ens outside a method's own file tests a
method's name."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support

import dist_ens
from dist_ens.core.hooks import MethodHooks
from dist_ens.ensembles.method import Method, MethodSpec
from dist_ens.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def make(spec: MethodSpec) -> Method:
  """Polyak averaging per member: each member keeps an exponential moving average of its
  weights (ensemble.options.decay), and the averaged weights predict."""
  decay = spec.options.get('decay', 0.9)
  if not isinstance(decay, float) or not 0.0 <= decay <= 1.0:
    raise ConfigError(f'config.ensemble.options.decay={decay!r} must be a float in [0, 1].')

  def init(params, state):
    return {'params': jax.tree.map(jnp.zeros_like, params), 'state': state}

  def collect(collected, params, state, step):
    mix = lambda old, new: jnp.where(step == 1, new, decay * old + (1 - decay) * new)
    return {'params': jax.tree.map(mix, collected['params'], params), 'state': state}

  def members(collected, params, state, step, key):
    del params, state, key
    one = lambda tree: jax.tree.map(lambda a: a[None], tree)
    return one(collected['params']), one(collected['state']), (step >= 1)[None]

  return Method('ema', hooks=MethodHooks(init_collected=init, collect=collect), members=members)


def _config(decay):
  config = support.config({'train.steps': 12, 'train.log_every': 6, 'checkpoint.every': 6})
  config.ensemble.method = 'test_method_extension:make'
  config.ensemble.options.decay = decay
  return config


def test_a_users_method_trains_collects_and_predicts(tmp_path):
  final = dist_ens.train(_config(0.0), str(tmp_path / 'now'))
  # decay 0: the average is the last weights, so it predicts as the trained members.
  assert final['ema']['predicting_members'] == 4
  for key in ('accuracy', 'nll'):
    assert final['ema']['ensemble'][key] == pytest.approx(final['ensemble'][key], rel=1e-6)
  # decay 1: it keeps the first step's weights, which predict worse than the last.
  slow = dist_ens.train(_config(1.0), str(tmp_path / 'first'))
  assert slow['ema']['ensemble']['nll'] > slow['ensemble']['nll'] + 0.01
  ens = dist_ens.Ensemble.load(str(tmp_path / 'first'))
  x = np.asarray(dist_ens.data.load_dataset('mnist1d').test.x[:16])
  assert ens.predict(x).member_probs.shape == (4, 16, 10)


def test_a_users_method_checks_its_own_fields_in_one_line(tmp_path):
  with pytest.raises(ConfigError, match=r'config\.ensemble\.options\.decay=2\.0'):
    dist_ens.train(_config(2.0), str(tmp_path / 'w'))
  assert not (tmp_path / 'w').exists()


_METHOD_FILES = {'deep.py', 'batchensemble.py', 'mimo.py', 'snapshot.py', 'swag.py',
                 'prior.py', 'epinet.py', 'methods.py'}  # methods.py: the registry of the built-ins' names
_NAMES = ('deep', 'batchensemble', 'mimo', 'snapshot', 'multiswag', 'prior', 'epinet')
# A test of a method's name: compared (==, !=, in) with a name, or with ensemble.method.
_TEST = re.compile(r"(==|!=|\bin)\s*\(?\s*'(%s)'|'(%s)'\s*(==|!=)|ensemble\.method\s*(==|!=|in\b)|"
                   r"method\.name\s*(==|!=|in\b)" % ('|'.join(_NAMES), '|'.join(_NAMES)))


def test_no_module_outside_a_methods_file_tests_its_name():
  found = []
  for path in sorted((ROOT / 'dist_ens').rglob('*.py')):
    if path.parent.name == 'ensembles' and path.name in _METHOD_FILES:
      continue
    for number, line in enumerate(path.read_text().splitlines(), 1):
      if _TEST.search(line.split('#')[0]):
        found.append(f'{path.relative_to(ROOT)}:{number}: {line.strip()}')
  assert not found, '\n'.join(found)
