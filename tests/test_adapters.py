"""Adapters of users' models (Flax linen / NNX, Equinox, Haiku, plain JAX) and config.model.factory.

Every kind is checked on the model contract (per-member init, BatchNorm state in
train vs eval, dropout keyed by rng and off in eval) and end to end through
dist_ens.train with the example that ships for it (examples/).
"""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import runs
import support

import dist_ens
from dist_ens.config import specs
from dist_ens import data, models
from dist_ens.core import adapters, rng as rng_lib
from dist_ens.errors import ConfigError
from model_specs import model_spec

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` must be importable (haiku ships its own namespace one).
  sys.path.insert(0, str(ROOT))

# example module -> (package it needs, has BatchNorm state)
KINDS = {
    'flax_linen_resnet': ('flax', True),
    'flax_nnx_mlp': ('flax', True),
    'equinox_mlp': ('equinox', True),
    'haiku_mlp': ('haiku', True),
    'plain_jax': ('jax', False),
}


def _needs(kind):
  package = KINDS[kind][0]
  return pytest.mark.skipif(importlib.util.find_spec(package) is None,
                            reason=f'{package} is not installed')


PARAMS = [pytest.param(k, marks=_needs(k)) for k in KINDS]
# The linen ResNet at a small size that keeps every layer kind (stem, a residual block
# with BatchNorm, dropout, dense head): XLA:CPU compiles its vmapped init in about a
# minute at the example's default size (16 channels, 2 blocks), 10 s at this one.
SMALL = {'flax_linen_resnet': {'channels': 4, 'num_blocks': 1}}


def _model_config(kind, **kwargs):
  return model_spec(factory=f'examples.{kind}:make_model', kwargs=kwargs)


def _differs(a, b):
  return any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope='module')
def mnist1d():
  config = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  return data.load_dataset('mnist1d', specs.data_spec(config))


@pytest.mark.parametrize('kind', PARAMS)
def test_contract(kind, mnist1d):
  """Per-member init; BN state updated in train, kept in eval; dropout keyed by rng, off in eval.

  Also: the members' initial ensemble is at chance on the test set (< 0.15), the
  baseline the end-to-end tests' accuracy is held against.
  """
  model = models.get_model(_model_config(kind, **SMALL.get(kind, {})), 10)
  x, y = mnist1d.test.x, mnist1d.test.y

  @jax.jit  # One program, the keys' draw included (eagerly: one program an operation).
  def run(x):
    keys = rng_lib.member_keys(0, jnp.arange(4))  # Training's init keys (seed 0, 4 members).
    params, state = jax.vmap(model.init, in_axes=(0, None))(keys, x[:1])
    p0, s0 = jax.tree.map(lambda a: a[0], (params, state))
    train = [model.apply(p0, s0, x[:64], train=True, rng=jax.random.key(k)) for k in (7, 8, 7)]
    logits = jax.vmap(lambda p, s: model.apply(p, s, x, train=False)[0])(params, state)
    untrained = jnp.mean(jnp.argmax(jax.nn.softmax(logits).mean(0), -1) == y)
    return params, s0, train, model.apply(p0, s0, x[:64], train=False), untrained

  # On the host: each eager index of a device array (a[0]) compiled a slice program per shape.
  params, s0, train, (eval_logits, eval_state), untrained = jax.device_get(run(x))
  assert untrained < 0.15, untrained
  for leaf in jax.tree.leaves(params):
    if np.ptp(leaf[0]) > 0:  # Randomly initialised: every member its own draw.
      assert _differs(leaf[0], leaf[1]) and _differs(leaf[1], leaf[2])
  (a, state_a), (b, _), (a_again, _) = train
  assert _differs(a, b), 'dropout must depend on the rng'
  np.testing.assert_array_equal(a, a_again)
  assert jax.tree.structure(state_a) == jax.tree.structure(s0)
  assert _differs(state_a, s0) == KINDS[kind][1]
  assert jax.tree.structure(eval_state) == jax.tree.structure(s0)
  assert not _differs(eval_state, s0)
  eval_again, _ = jax.jit(lambda p, s: model.apply(p, s, x[:64], train=False))(
      jax.tree.map(lambda a: a[0], params), s0)  # numpy's a[0]
  np.testing.assert_allclose(eval_logits, eval_again, rtol=1e-5, atol=1e-5)
  assert not np.allclose(eval_logits, a), 'eval must run without dropout, on running statistics'


def test_to_model_built_objects():
  """A built linen module, a Model or an (init, apply) pair adapt as they are."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  pair = (lambda rng, x: ({'w': jnp.ones((x.shape[-1], 2))}, {}),
          lambda p, s, x, *, train, rng=None: (x @ p['w'], s))
  for obj, kind in ((nn.Dense(2), 'flax_linen'), (pair, 'plain'),
                    (dist_ens.Model(*pair), 'plain')):
    assert adapters.kind_of(obj) == kind
    model = adapters.to_model(obj)
    # One program each: eagerly, each of init's and apply's operations compiled its own.
    logits = jax.jit(lambda key: model.apply(*model.init(key, np.zeros((1, 3), np.float32)),
                                             np.ones((4, 3), np.float32), train=False)[0])
    assert logits(jax.random.key(0)).shape == (4, 2)


def test_to_model_refuses_built_nnx_module():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  # Built abstractly (shapes only): a built module's class, without the eager init's
  # programs (one an operation).
  built = nnx.eval_shape(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
  assert isinstance(built, nnx.Linear)
  with pytest.raises(TypeError, match='pass its factory'):
    adapters.to_model(built)


def test_num_classes_only_where_the_factory_takes_it():
  assert adapters.factory_kwargs(lambda num_classes=3: 0, {}, 10) == {'num_classes': 10}
  assert adapters.factory_kwargs(lambda num_classes=3: 0, {'num_classes': 4}, 10) == {
      'num_classes': 4}
  assert adapters.factory_kwargs(lambda width=3: 0, {'width': 2}, 10) == {'width': 2}


@pytest.mark.parametrize('path, match', [
    ('no_such_pkg.nets:make', r"config.model.factory='no_such_pkg.nets:make' cannot be "
                              r"imported: ModuleNotFoundError"),
    ('examples.plain_jax:nope', 'has no attribute'),
    ('examples.plain_jax', 'must be an import path'),
])
def test_bad_factory_is_one_config_error(path, match):
  with pytest.raises(ConfigError, match=match):
    models.get_model(model_spec(factory=path), 10)


def test_bad_kwargs_are_a_config_error():
  with pytest.raises(ConfigError, match='config.model.kwargs'):
    models.get_model(_model_config('plain_jax', depth=3), 10)


# --- end to end -------------------------------------------------------------------------

# Chance on MNIST-1D's 10 classes is 0.1; test_contract checks that the members'
# initial ensemble is below 0.15 for every kind, so this is a gain of >= 0.15.
TRAINED_ACCURACY = 0.3


def _train_config(kind, steps=60, **kwargs):
  config = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  config.model.factory = f'examples.{kind}:make_model'
  config.model.kwargs = ml_collections.ConfigDict(kwargs)
  config.num_members = 4
  config.data.batch_size = 64
  config.optim.learning_rate = 1e-2
  config.train.steps = steps
  config.train.log_every = 20
  config.train.eval_every = 0
  config.checkpoint.every = 30
  return config


# The linen model is trained end to end in its own test below.
E2E = [pytest.param('flax_nnx_mlp', {}, marks=_needs('flax_nnx_mlp')),
       pytest.param('equinox_mlp', {'batch_norm': False}, marks=_needs('equinox_mlp')),
       pytest.param('haiku_mlp', {}, marks=_needs('haiku_mlp')),
       pytest.param('plain_jax', {}, marks=_needs('plain_jax'))]


def _check_trained(results, workdir, dataset):
  """Learned, one trace, and the run's contract through the adapter: predicts what it
  reported, the same on one device, and exports each member (support.check_loaded_run)."""
  assert results['ensemble']['accuracy'] > TRAINED_ACCURACY, results['ensemble']
  assert results['train_step_traces'] == 1
  ens = support.check_loaded_run(workdir, dataset, results)
  # The test split check_loaded_run predicted: the same program, not one for another size.
  out = ens.predict(dataset.test.x)
  assert out.member_probs.shape == (4, len(dataset.test.x), 10)
  return ens


@pytest.mark.parametrize('kind, kwargs', E2E)
def test_trains_end_to_end(kind, kwargs, tmp_path, mnist1d):
  results = dist_ens.train(_train_config(kind, **kwargs), str(tmp_path))
  _check_trained(results, tmp_path, mnist1d)


@_needs('equinox_mlp')
def test_equinox_batchnorm_trains_end_to_end(tmp_path, mnist1d):
  results = dist_ens.train(_train_config('equinox_mlp'), str(tmp_path))
  _check_trained(results, tmp_path, mnist1d)


@pytest.fixture(scope='module')
def linen_run(tmp_path_factory):
  """(workdir, results) of the small linen ResNet (BatchNorm, dropout) trained 60 steps,
  saved at 30 and 60: read by the two tests below, the first paying for it."""
  workdir = tmp_path_factory.mktemp('linen') / 'straight'
  config = _train_config('flax_linen_resnet', **SMALL['flax_linen_resnet'])
  return workdir, dist_ens.train(config, str(workdir))


@_needs('flax_linen_resnet')
def test_linen_batchnorm_dropout_members_train_and_predict(linen_run, mnist1d):
  """BN statistics per member; predict = softmax(eval logits)."""
  straight, _ = linen_run
  ens = dist_ens.Ensemble.load(straight)
  channels = SMALL['flax_linen_resnet']['channels']
  means = np.asarray(ens.model_state['batch_stats']['BatchNorm_0']['mean'])
  assert means.shape == (4, channels) and all(_differs(means[i], means[i + 1]) for i in range(3))
  x = mnist1d.test.x[:100]
  params, state = jax.device_get((ens.params, ens.model_state))
  logits = np.asarray(jax.jit(jax.vmap(lambda p, s: ens.model.apply(p, s, x, train=False)[0]))(
      params, state), np.float64)
  softmax = np.exp(logits - logits.max(-1, keepdims=True))  # numpy: no program an operation
  np.testing.assert_allclose(ens.predict(x).member_probs,
                             softmax / softmax.sum(-1, keepdims=True), rtol=1e-4, atol=1e-6)


@_needs('flax_linen_resnet')
def test_linen_batchnorm_dropout_members_predict_and_resume(linen_run, mnist1d, tmp_path):
  """The linen run trained (learned, one trace) and, through the adapter, loads, predicts
  what it reported and exports (_check_trained); resumed from what a kill after its step-30
  checkpoint leaves, it ends at step 60 bit for bit (BatchNorm statistics included). Two
  tests, not one, share the run, so neither holds its training, its checks and its resume
  all at once (one test did: 11 s of CI's fast tier)."""
  straight, results = linen_run
  ens = _check_trained(results, straight, mnist1d)
  resumed = runs.killed_after(straight, 30, tmp_path / 'resumed')
  dist_ens.train(_train_config('flax_linen_resnet', **SMALL['flax_linen_resnet']), str(resumed))
  ens_resumed = dist_ens.Ensemble.load(resumed)
  assert ens.step == ens_resumed.step == 60
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(ens.params),
               jax.device_get(ens_resumed.params))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(ens.model_state),
               jax.device_get(ens_resumed.model_state))
