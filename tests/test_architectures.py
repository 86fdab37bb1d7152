"""LeNet-5, ResNets and their layers on the (params, state) model contract.

Big nets are only traced (jax.eval_shape); anything compiled is tiny, and compiled once:
inputs are drawn and references computed in numpy, and each layer's checks run its layer
in one jitted program (eagerly each jax op compiles a program of its own).
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dist_ens.core.model import Model
from dist_ens.errors import ConfigError
from dist_ens.models import layers
from dist_ens.models.lenet import make_lenet5
from dist_ens.models.resnet import make_resnet, make_resnet18, make_wide_resnet
from model_specs import model_spec
import support

MAKERS = {'lenet5': make_lenet5, 'resnet': make_resnet, 'resnet18': make_resnet18,
          'wide_resnet': make_wide_resnet}


def _model(name, num_classes=10, **fields):
  return MAKERS[name](model_spec(name=name, **fields), num_classes)


def _spec(shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def _abstract(model, input_shape, batch=2):
  """(params, state, logits, train_state) as shapes only: nothing is computed."""
  params, state = jax.eval_shape(model.init, jax.random.key(0), _spec((1, *input_shape)))
  apply = lambda p, s, x: model.apply(p, s, x, train=True, rng=jax.random.key(1))
  logits, new_state = jax.eval_shape(apply, params, state, _spec((batch, *input_shape)))
  return params, state, logits, new_state


def _count(tree):
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def _normal(shape, seed=0):
  """Standard-normal float32 draws, in numpy."""
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


_batch_norm = jax.jit(layers.batch_norm, static_argnames='train')


# ----------------------------------------------------------------- parameter counts

@pytest.mark.parametrize('name,fields,exact,published', [
    ('resnet', {}, 272_474, 0.272e6),  # ResNet-20 with 1x1-conv projections.
    ('resnet', {'depth': 56}, 855_770, 0.85e6),
    ('resnet18', {}, 11_173_962, 11.17e6),
    ('wide_resnet', {}, 36_479_194, 36.5e6),  # WRN-28-10.
])
def test_parameter_counts_match_published(name, fields, exact, published):
  params, state, _, _ = _abstract(_model(name, **fields), (32, 32, 3))
  assert _count(params) == exact
  assert abs(_count(params) / published - 1) < 0.01
  assert _count(state) > 0  # BatchNorm running statistics are state, not params.


def test_resnet20_count_by_hand():
  conv = lambda k, i, o: k * k * i * o
  bn = lambda c: 2 * c
  stem = conv(3, 3, 16) + bn(16)
  stage1 = 3 * 2 * (conv(3, 16, 16) + bn(16))
  stage2 = conv(3, 16, 32) + 5 * conv(3, 32, 32) + 6 * bn(32) + conv(1, 16, 32) + bn(32)
  stage3 = conv(3, 32, 64) + 5 * conv(3, 64, 64) + 6 * bn(64) + conv(1, 32, 64) + bn(64)
  head = 64 * 10 + 10
  params, _, _, _ = _abstract(_model('resnet', depth=20), (32, 32, 3))
  assert _count(params) == stem + stage1 + stage2 + stage3 + head


@pytest.mark.parametrize('input_shape,expected', [
    # conv1 6*(5*5*1)+6, conv2 16*(5*5*6)+16, 400*120+120, 120*84+84, 84*10+10.
    ((32, 32, 1), 156 + 2_416 + 48_120 + 10_164 + 850),
    ((28, 28, 1), 61_706),  # Padded to 32x32, as LeCun et al. padded MNIST.
    ((8, 8, 1), 61_706),
    ((32, 32, 3), 456 + 2_416 + 48_120 + 10_164 + 850),
    ((40, 1), 6 * 5 + 6 + 16 * 5 * 6 + 16 + 7 * 16 * 120 + 120 + 10_164 + 850),  # 40-36-18-14-7.
])
def test_lenet5_count_by_hand(input_shape, expected):
  params, state, _, _ = _abstract(_model('lenet5'), input_shape)
  assert _count(params) == expected
  assert state == {}


def test_resnets_have_no_bias_before_batch_norm():
  for name, fields in [('resnet', {'depth': 8}), ('resnet18', {}),
                       ('wide_resnet', {'depth': 10, 'widen_factor': 1})]:
    params, _, _, _ = _abstract(_model(name, **fields), (8, 8, 1))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert [p for p in paths if p.endswith("['b']")] == ["['head']['b']"], name


# ------------------------------------------------------------------- shapes, errors

@pytest.mark.parametrize('name,fields', [
    ('lenet5', {}), ('resnet', {'depth': 8}), ('resnet18', {}),
    ('wide_resnet', {'depth': 10, 'widen_factor': 2, 'dropout': 0.3})])
@pytest.mark.parametrize('input_shape', [(32, 32, 3), (28, 28, 1), (8, 8, 1), (40, 1)])
def test_logits_and_state_shapes(name, fields, input_shape):
  params, state, logits, new_state = _abstract(_model(name, 7, **fields), input_shape, batch=5)
  assert logits.shape == (5, 7)
  # train=True returns running statistics of the same structure and shapes.
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  assert jax.tree.map(lambda a: a.shape, new_state) == jax.tree.map(lambda a: a.shape, state)


@pytest.mark.parametrize('name,depth,match', [
    ('resnet', 18, r'config.model.depth=18 is not 6n\+2.*make_resnet18.*\[8, 14, 20, 26'),
    ('resnet', 21, r'config.model.depth=21 .*\[8, 14, 20'),
    ('resnet', 2, r'depth=2 '),
    ('wide_resnet', 20, r'config.model.depth=20 is not 6n\+4.*\[10, 16, 22, 28'),
    ('wide_resnet', 28.0, r'depth=28.0'),
])
def test_wrong_depth_names_field_and_valid_values(name, depth, match):
  with pytest.raises(ConfigError, match=match):
    _model(name, depth=depth)


def test_bad_fields_and_inputs():
  with pytest.raises(ConfigError, match='config.model.widen_factor=0'):
    _model('wide_resnet', widen_factor=0)
  with pytest.raises(ConfigError, match='config.model.dropout=1.5'):
    _model('resnet', dropout=1.5)
  with pytest.raises(ConfigError, match='config.model.conv_impl'):
    _model('lenet5', conv_impl='cudnn')
  with pytest.raises(ConfigError, match=r'\(1, 784\)'):
    _model('resnet').init(jax.random.key(0), np.zeros((1, 784), np.float32))


# ---------------------------------------------------------------------------- layers

def test_batch_norm_train_normalises_and_moves_running_stats():
  x = (3.0 + 2.0 * _normal((16, 5, 5, 4))) * np.arange(1.0, 5.0, dtype=np.float32)
  # (A different scale per channel.)
  params, state = layers.batch_norm_init(4)
  y, new = jax.device_get(_batch_norm(params, state, x, train=True))
  np.testing.assert_allclose(y.mean((0, 1, 2)), 0.0, atol=1e-5)
  np.testing.assert_allclose(y.var((0, 1, 2)), 1.0, atol=1e-3)
  batch_mean, batch_var = x.mean((0, 1, 2)), x.var((0, 1, 2))
  np.testing.assert_allclose(new['mean'], 0.1 * batch_mean, rtol=1e-5)
  np.testing.assert_allclose(new['var'], 0.9 + 0.1 * batch_var, rtol=1e-5)
  # Threaded through steps (the program above), the running statistics converge to the
  # batch's.
  for _ in range(60):
    new = _batch_norm(params, new, x, train=True)[1]
  np.testing.assert_allclose(new['mean'], batch_mean, rtol=1e-2)
  np.testing.assert_allclose(new['var'], batch_var, rtol=1e-2)


def test_batch_norm_eval_uses_running_stats_and_keeps_state():
  x = _normal((8, 6, 3))
  params = {'scale': np.array([1.0, 2.0, 0.5], np.float32),
            'bias': np.array([0.0, 1.0, -1.0], np.float32)}
  state = {'mean': np.array([0.5, -1.0, 2.0], np.float32),
           'var': np.array([4.0, 1.0, 0.25], np.float32)}

  def normalised(params, state, x):
    y, new = layers.batch_norm(params, state, x, train=False)
    assert new is state  # Checked while tracing: the state it was given, no copy.
    return y

  y = jax.jit(normalised)(params, state, x)
  expected = (x - state['mean']) / np.sqrt(state['var'] + 1e-5) * params['scale'] + params['bias']
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_batch_norm_matches_flax():
  x = 1.0 + _normal((10, 7, 5), seed=3)
  bn = nn.BatchNorm(momentum=0.9, epsilon=1e-5)

  @jax.jit  # Flax's and ours in one program.
  def both(x):
    variables = bn.init(jax.random.key(0), x, use_running_average=False)
    ref, updates = bn.apply(variables, x, use_running_average=False, mutable=['batch_stats'])
    ours = layers.batch_norm(variables['params'], variables['batch_stats'], x, train=True)
    return ours, (ref, updates)

  (y, new), (ref, updates) = both(x)
  np.testing.assert_allclose(y, ref, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               new, dict(updates['batch_stats']))


def test_batch_norm_gradient_ignores_running_stats():
  x = _normal((8, 3))
  params, state = layers.batch_norm_init(3)

  @jax.jit  # Both gradients in one program.
  def gradients(state, x):
    by_state = jax.grad(lambda s: sum(jnp.sum(v) for v in layers.batch_norm(
        params, s, x, train=True)[1].values()))(state)
    running_mean = lambda x: jnp.sum(layers.batch_norm(params, state, x, train=True)[1]['mean'])
    return by_state, jax.grad(running_mean)(x)

  grads, grad_x = gradients(state, x)
  # Only the old running stats carry a gradient (0.9); the batch statistics are stopped.
  np.testing.assert_allclose(grads['mean'], 0.9)
  np.testing.assert_array_equal(grad_x, 0.0)


def test_dropout():
  x = np.ones((200, 50), np.float32)
  drop = jax.jit(lambda key: layers.dropout(key, x, 0.3, train=True))
  a, b = np.asarray(drop(jax.random.key(0))), np.asarray(drop(jax.random.key(1)))
  assert not np.array_equal(a, b)
  np.testing.assert_allclose(np.unique(a), [0.0, 1 / 0.7], rtol=1e-6)
  assert abs(float((a == 0).mean()) - 0.3) < 0.02
  assert layers.dropout(None, x, 0.3, train=False) is x
  assert layers.dropout(None, x, 0.0, train=True) is x
  with pytest.raises(ValueError, match='needs a PRNG key'):
    layers.dropout(None, x, 0.3, train=True)


def test_he_normal_init_fills_kernels_only():
  tree = {'conv': layers.conv_kernel(3, 2, 64, 128), 'dense': layers.dense_params(512, 256),
          'bn': layers.batch_norm_init(4)[0]}
  pair = [layers.kernel(4, 4), layers.kernel(4, 4)]

  @jax.jit  # The three inits in one program.
  def inits(key, other_key):
    filled = layers.he_normal_init(key, tree)
    # Checked while tracing: what is no kernel is passed on as given, not copied.
    assert (filled['bn']['scale'] is tree['bn']['scale']
            and filled['dense']['b'] is tree['dense']['b'])
    return filled, layers.he_normal_init(key, pair), layers.he_normal_init(other_key, pair)

  filled, two, other = jax.device_get(inits(jax.random.key(0), jax.random.key(1)))
  assert filled['conv'].shape == (3, 3, 64, 128) and filled['dense']['w'].shape == (512, 256)
  for w, fan_in in [(filled['conv'], 9 * 64), (filled['dense']['w'], 512)]:
    assert abs(float(w.std()) / math.sqrt(2 / fan_in) - 1) < 0.02
    assert abs(float(w.mean())) < 0.05 * math.sqrt(2 / fan_in)
  np.testing.assert_array_equal(filled['bn']['scale'], tree['bn']['scale'])
  np.testing.assert_array_equal(filled['dense']['b'], tree['dense']['b'])
  # Kernels of one shape are distinct pieces of the draw, and keys give distinct draws.
  assert not np.allclose(two[0], two[1])
  assert not np.allclose(two[0], other[0])


def test_he_normal_init_draws_once_where_the_compiler_keeps_the_barrier():
  # XLA fuses the normal draw's arithmetic (erf_inv's polynomial) into every kernel's slice
  # unless a barrier stops it; XLA:GPU keeps the barrier through fusion (a ViT-S's init
  # compiled for minutes with 74 copies), XLA:CPU drops it first unless told not to.
  # The same bits either way at XLA's default level, as runs compile (at the suite's -O0
  # the two differ by an ulp here and there).
  tree = [layers.kernel(64, 64) for _ in range(6)]
  lowered = jax.jit(lambda key: layers.he_normal_init(key, tree)).lower(jax.random.key(0))
  kept = {'xla_disable_hlo_passes': 'cse_barrier_expander'}
  copies = lambda compiled: sum('constant(1.50140941)' in c  # a coefficient of erf_inv's
                                for c in compiled.as_text().split('\n\n'))
  dropped = lowered.compile(compiler_options=support.XLA_DEFAULT)
  barrier = lowered.compile(compiler_options={**support.XLA_DEFAULT, **kept})
  assert copies(dropped) == 6 and copies(barrier) == 1
  for a, b in zip(dropped(jax.random.key(0)), barrier(jax.random.key(0))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('shape', [(2, 9, 7, 3), (2, 11, 4)])
def test_pools(shape):
  x = _normal(shape)
  rank = len(shape) - 2
  window = (1,) + (2,) * rank + (1,)
  # numpy's 'VALID' windows of 2 at stride 2 (a trailing odd row is dropped).
  views = np.lib.stride_tricks.sliding_window_view(x, window)
  expected = views[(slice(None), *(slice(None, None, 2),) * rank)].max(tuple(range(-rank - 2, 0)))
  max_pooled, avg_pooled = jax.jit(lambda x: (layers.max_pool(x), layers.global_avg_pool(x)))(x)
  np.testing.assert_array_equal(max_pooled, expected)
  np.testing.assert_allclose(avg_pooled, x.mean(tuple(range(1, rank + 1))), rtol=1e-6)


@pytest.mark.parametrize('shape,ksize,stride,padding', [
    # LeNet's 'VALID' 5x5, an odd-sized strided 'SAME', a 1-D strided 'VALID'; the 1x1
    # strided projections are checked in test_conv_impls_share_parameters.
    ((2, 9, 9, 3), 5, 1, 'VALID'), ((2, 10, 7, 2), 3, 2, 'SAME'), ((2, 13, 3), 3, 2, 'VALID')])
def test_patches_conv_matches_xla(shape, ksize, stride, padding):
  x = _normal(shape)
  w = _normal((ksize,) * (len(shape) - 2) + (shape[-1], 6), seed=1)
  patches, xla = jax.jit(lambda x, w: (layers._conv_patches(x, w, stride, padding),
                                       layers._conv_xla(x, w, stride, padding)))(x, w)
  np.testing.assert_allclose(patches, xla, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------- models in action
# Few, small compiled programs: on a busy 2-core CPU each compile costs seconds.

class _Net(NamedTuple):
  model: Model
  x: np.ndarray
  params: Any
  state: Any
  apply: Callable[..., Any]  # jitted model.apply, train static.
  # (params, state) of three members stacked, where the net is the first of them.
  members: Any = None


def _net(name, input_shape, num_classes=3, **fields):
  model = _model(name, num_classes, **fields)
  x = _normal((8, *input_shape))
  params, state = jax.device_get(jax.jit(model.init)(jax.random.key(0), x[:1]))
  return _Net(model, x, params, state, jax.jit(model.apply, static_argnames='train'))


@pytest.fixture(scope='module')
def resnet8():
  """A 1-D ResNet-8 (the cheapest to compile), shared by the tests below: three members
  initialised under vmap (as dist_ens initialises them), the net the first of them."""
  model = _model('resnet', 3, depth=8)
  x = _normal((8, 12, 1))
  init = jax.jit(lambda key: jax.vmap(model.init, in_axes=(0, None))(jax.random.split(key, 3),
                                                                      x[:1]))
  members = jax.device_get(init(jax.random.key(0)))
  params, state = jax.tree.map(lambda a: a[0], members)
  return _Net(model, x, params, state, jax.jit(model.apply, static_argnames='train'), members)


@pytest.fixture(scope='module')
def wrn10():
  """A 1-D WRN-10-1 with dropout."""
  return _net('wide_resnet', (12, 1), depth=10, widen_factor=1, dropout=0.2)


def _conv_same_1d(x, w):
  """numpy's 'SAME' 1-D convolution at stride 1, in float64: x [B, L, C], w [K, C, O]."""
  half = w.shape[0] // 2
  padded = np.pad(x.astype(np.float64), [(0, 0), (half, half), (0, 0)])
  return sum(padded[:, k:k + x.shape[1]] @ w[k].astype(np.float64) for k in range(w.shape[0]))


def test_train_mode_normalises_by_the_batch(resnet8):
  net = resnet8
  logits, new_state = net.apply(net.params, net.state, net.x, train=True)
  # Scaling the stem kernel cannot change train-mode output: its BN divides it out.
  scaled = dict(net.params, stem=3.0 * net.params['stem'])
  np.testing.assert_allclose(net.apply(scaled, net.state, net.x, train=True)[0], logits,
                             rtol=1e-3, atol=1e-4)
  # The stem's running mean moved a tenth of the way to its pre-BN batch mean.
  assert net.params['stem'].shape == (3, 1, 16)  # What _conv_same_1d computes.
  stem_out = _conv_same_1d(net.x, net.params['stem'])
  np.testing.assert_allclose(new_state['stem_bn']['mean'], 0.1 * stem_out.mean((0, 1)),
                             rtol=1e-4, atol=1e-6)
  # Evaluation: running statistics, the state returned as given, deterministic.
  eval_logits, eval_state = net.apply(net.params, new_state, net.x, train=False)
  assert jax.tree.all(jax.tree.map(np.array_equal, eval_state, new_state))
  np.testing.assert_array_equal(net.apply(net.params, new_state, net.x, train=False)[0],
                                eval_logits)
  assert not np.allclose(eval_logits, logits, atol=1e-3)


@pytest.mark.parametrize('name', ['lenet5', 'resnet', 'wide_resnet'])
def test_eval_returns_the_state_it_was_given(name):
  model = _model(name, depth=8 if name == 'resnet' else 10, widen_factor=1)
  x = _spec((2, 40, 1))
  params, state = jax.eval_shape(model.init, jax.random.key(0), x)

  def check(params, state, x):
    logits, same = model.apply(params, state, x, train=False)
    assert same is state  # Checked while tracing: no copy, no update.
    return logits

  jax.eval_shape(check, params, state, x)


def test_dropout_in_models(wrn10):
  net = wrn10
  train = lambda rng: net.apply(net.params, net.state, net.x, train=True, rng=rng)[0]
  a, b = train(jax.random.key(1)), train(jax.random.key(2))
  assert not np.allclose(a, b)
  np.testing.assert_array_equal(train(jax.random.key(1)), a)
  # Evaluation draws no random bits without an rng; given one, it samples its dropout
  # (MC dropout, the model contract of dist_ens.core.model).
  program = lambda train: str(jax.make_jaxpr(lambda rng: net.model.apply(
      net.params, net.state, net.x, train=train, rng=rng))(jax.random.key(1)))
  plain = str(jax.make_jaxpr(lambda x: net.model.apply(net.params, net.state, x,
                                                       train=False)[0])(net.x))
  assert 'random_bits' in program(True) and 'random_bits' in program(False)
  assert 'random_bits' not in plain
  for name in ('lenet5', 'resnet', 'wide_resnet'):
    model = _model(name, depth=8 if name == 'resnet' else 10, dropout=0.3)
    params, state = jax.eval_shape(model.init, jax.random.key(0), _spec((1, 40, 1)))
    with pytest.raises(ValueError, match=r'config.model.dropout=0.3 needs a PRNG key'):
      jax.eval_shape(lambda p, s: model.apply(p, s, net.x, train=True), params, state)


def test_vmap_over_members_matches_each_member(resnet8):
  net = resnet8
  params, state = net.members  # Initialised under vmap.
  assert params['stem'].shape == (3, 3, 1, 16)
  assert not np.allclose(params['stem'][0], params['stem'][1])
  apply = lambda p, s: net.model.apply(p, s, net.x, train=True)
  logits, new_state = jax.device_get(jax.jit(jax.vmap(apply))(params, state))
  assert logits.shape == (3, 8, 3)
  assert not np.allclose(logits[0], logits[1])
  one = jax.tree.map(lambda a: a[2], (params, state))
  ref_logits, ref_state = net.apply(*one, net.x, train=True)  # Compiled already.
  np.testing.assert_allclose(logits[2], ref_logits, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(new_state['blocks'][-1]['bn2']['var'][2],
                             ref_state['blocks'][-1]['bn2']['var'], rtol=1e-4)


def test_conv_impls_share_parameters(resnet8):
  net = resnet8
  xla = _model('resnet', 3, depth=8, conv_impl='xla')
  a, state_a = net.apply(net.params, net.state, net.x, train=True)
  b, state_b = jax.jit(lambda p, s: xla.apply(p, s, net.x, train=True))(net.params, net.state)
  np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-3, atol=1e-5),
               state_a, state_b)


def _train(net, optimizer, steps=15):
  """Losses of `steps` full-batch steps on random labels, all in one program (a scan over
  the steps); asserts finite gradients at each step."""
  y = np.arange(net.x.shape[0]) % 3

  def loss_fn(params, state, rng):
    logits, new_state = net.model.apply(params, state, net.x, train=True, rng=rng)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new_state

  def step(carry, rng):
    params, state, opt_state = carry
    (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, rng)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    finite = jax.tree.reduce(jnp.logical_and, jax.tree.map(lambda g: jnp.isfinite(g).all(), grads))
    return (optax.apply_updates(params, updates), state, opt_state), (loss, finite)

  @jax.jit
  def train(params, state):
    keys = jax.vmap(jax.random.key)(jnp.arange(steps))
    return jax.lax.scan(step, (params, state, optimizer.init(params)), keys)[1]

  losses, finite = jax.device_get(train(net.params, net.state))
  assert finite.shape == (steps,) and finite.all()
  return losses.tolist()


def test_lenet5_trains():
  net = _net('lenet5', (8, 8, 1), dropout=0.1)
  losses = _train(net, optax.sgd(0.05, momentum=0.9))
  assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize('name', ['resnet8', 'wrn10'])
def test_resnets_train(name, request):
  losses = _train(request.getfixturevalue(name), optax.adam(3e-3))
  assert losses[-1] < 0.7 * losses[0], losses
