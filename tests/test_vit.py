"""The built-in ViT (dist_ens.models.vit): shapes, init, training, dropout, members
stacked under vmap, its tensor-parallel rules on a ('member', 'data', 'model') mesh, and
its configs (configs/digits_vit.py trains two steps; cifar10_vit_ti.py is only built)."""

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dist_ens
from dist_ens.run import mesh_layout
from dist_ens.config import specs
from dist_ens.run import assemble
from dist_ens.config import checks, loading
from dist_ens.core.axes import DATA, MEMBER, MODEL
from dist_ens.errors import ConfigError
from dist_ens.models import get_model
from dist_ens.models.vit import VIT_RULES, make_vit, patchify
from dist_ens.parallel import sharding_rules as sr
from dist_ens.parallel.layout import Layout
from model_specs import model_spec

TINY = dict(name='vit', patch_size=2, hidden=32, depth=2, heads=4, mlp_dim=64)


def _model(num_classes=10, **overrides):
  return get_model(model_spec(**{**TINY, **overrides}), num_classes)


# Inputs are drawn in numpy, shapes are traced (jax.eval_shape), and what runs is jitted
# (init, apply, the loss): eagerly, each op of a ViT compiles a program of its own.
def _x(batch=4, shape=(8, 8, 1), seed=0):
  return np.random.default_rng(seed).standard_normal((batch, *shape)).astype(np.float32)


def _apply(model):
  return jax.jit(model.apply, static_argnames=('train',))


@pytest.fixture(scope='module')
def tiny():
  """(model, its jitted init, its jitted apply, params and state from key 0): the TINY
  ViT that the tests below share, each program compiled once."""
  model = _model()
  init = jax.jit(model.init)
  params, state = jax.device_get(init(jax.random.key(0), _x(1)))
  return model, init, _apply(model), params, state


def test_shapes_and_param_tree():
  model = _model()
  params, state = jax.eval_shape(model.init, jax.random.key(0), _x(1))
  assert state == {}
  assert params['embed']['w'].shape == (2 * 2 * 1, 32)
  assert params['pos'].shape == (16, 32)  # 8x8 in patches of 2, mean pooling
  assert len(params['blocks']) == 2
  assert params['blocks'][0]['attn']['q']['w'].shape == (32, 32)
  assert params['blocks'][0]['mlp']['fc1']['w'].shape == (32, 64)
  assert params['head']['w'].shape == (32, 10)
  logits, _ = jax.eval_shape(lambda p, s, x: model.apply(p, s, x, train=False), params, state,
                             _x(5))
  assert logits.shape == (5, 10) and logits.dtype == jnp.float32
  cls_params, _ = jax.eval_shape(_model(pool='cls').init, jax.random.key(0), _x(1))
  assert cls_params['pos'].shape == (17, 32) and cls_params['cls'].shape == (1, 32)
  one_d, _ = jax.eval_shape(_model(patch_size=4).init, jax.random.key(0), _x(1, (40, 1)))
  assert one_d['pos'].shape == (10, 32)  # a 1-D signal of 40 in patches of 4


def test_patchify_keeps_each_patch_together_in_row_major_order():
  x = np.arange(16.0, dtype=np.float32).reshape(1, 4, 4, 1)
  patches = np.asarray(jax.jit(patchify, static_argnums=1)(x, 2))
  assert patches.shape == (1, 4, 4)
  np.testing.assert_array_equal(patches[0, 0], [0, 1, 4, 5])
  np.testing.assert_array_equal(patches[0, 1], [2, 3, 6, 7])
  np.testing.assert_array_equal(patches[0, 3], [10, 11, 14, 15])


def test_init_is_deterministic_per_key(tiny):
  _, init, _, _, _ = tiny
  a, _ = init(jax.random.key(1), _x(1))
  b, _ = init(jax.random.key(1), _x(1))
  c, _ = init(jax.random.key(2), _x(1))
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert not np.allclose(a['blocks'][0]['attn']['q']['w'], c['blocks'][0]['attn']['q']['w'])
  assert not np.allclose(a['pos'], c['pos'])
  std = float(np.std(np.asarray(a['blocks'][1]['mlp']['fc2']['w'])))
  assert 0.8 < std * np.sqrt(64) < 1.2  # LeCun normal: std sqrt(1 / fan_in)


def test_sgd_steps_reduce_the_loss_on_a_tiny_task():
  model = _model(num_classes=2)
  x = _x(32, seed=3)
  y = (x[:, :4].mean(axis=(1, 2, 3)) > 0).astype(np.int32)  # readable from the top rows

  def loss(params):
    logits, _ = model.apply(params, {}, x, train=True)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

  def step(params, _):  # (the new parameters, the loss of `params`)
    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), value

  @jax.jit  # init and the steps in one program
  def train(key):
    params, state = model.init(key, x[:1])
    assert state == {}
    # The 16th step's loss is that of the parameters after 15 steps.
    return jax.lax.scan(step, params, length=16)[1]

  losses = np.asarray(train(jax.random.key(0)))
  assert losses[-1] < 0.7 * losses[0], losses


def test_dropout_only_in_train_mode(tiny):
  model = _model(dropout=0.3)
  _, _, no_dropout_apply, params, state = tiny  # Dropout adds no parameters.
  x = _x(4)
  apply = _apply(model)
  eval_a, _ = apply(params, state, x, train=False)
  eval_b, _ = apply(params, state, x, train=False)
  np.testing.assert_array_equal(eval_a, eval_b)
  train_a, _ = apply(params, state, x, train=True, rng=jax.random.key(1))
  train_b, _ = apply(params, state, x, train=True, rng=jax.random.key(2))
  assert not np.allclose(train_a, train_b)
  assert not np.allclose(train_a, eval_a)
  with pytest.raises(ValueError, match='needs a PRNG key'):
    model.apply(params, state, x, train=True)
  np.testing.assert_array_equal(
      no_dropout_apply(params, state, x, train=True, rng=jax.random.key(1))[0], eval_a)


def test_vmap_over_stacked_members_matches_each_member_alone(tiny):
  model, _, apply, _, _ = tiny
  x = _x(4)

  @jax.jit
  def members(key):
    params, state = jax.vmap(model.init, in_axes=(0, None))(jax.random.split(key, 3), x[:1])
    return params, jax.vmap(lambda p, s: model.apply(p, s, x, train=False))(params, state)[0]

  stacked, logits = jax.device_get(members(jax.random.key(0)))
  assert stacked['blocks'][0]['attn']['q']['w'].shape == (3, 32, 32)
  assert logits.shape == (3, 4, 10)
  for m in range(3):
    alone, _ = apply(jax.tree.map(lambda a, m=m: a[m], stacked), {}, x, train=False)
    np.testing.assert_allclose(logits[m], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('field, value, message', [
    ('heads', 5, 'multiple of config.model.heads=5'),
    ('depth', 0, 'depth=0 must be an int >= 1'),
    ('pool', 'max', "pool='max' is not known"),
])
def test_config_errors(field, value, message):
  with pytest.raises(ConfigError, match=message):
    _model(**{field: value})


def test_patch_size_must_divide_the_input():
  with pytest.raises(ConfigError, match='patch_size=3 must divide'):
    _model(patch_size=3).init(jax.random.key(0), _x(1))


def test_vit_rules_shard_blocks_tensor_parallel_and_the_rest_by_fsdp(tiny):
  model = make_vit(model_spec(**TINY), 10)
  init = jax.vmap(lambda k: model.init(k, _x(1))[0])
  keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 2))
  abstract = {'params': jax.eval_shape(init, keys)}
  sizes = {MEMBER: 2, DATA: 1, MODEL: 4}
  rule = sr.by_regex(VIT_RULES, default=sr.fsdp(axis_size=4, min_size=256), axis_sizes=sizes)
  layout = Layout(axes=(MEMBER, DATA, MODEL), rule=rule)
  specs = layout.state_specs(abstract)['params']
  block = specs['blocks'][1]
  assert block['attn']['q']['w'] == P(MEMBER, None, MODEL)
  assert block['attn']['q']['b'] == P(MEMBER, MODEL)
  assert block['attn']['out']['w'] == P(MEMBER, MODEL, None)
  assert block['mlp']['fc1']['w'] == P(MEMBER, None, MODEL)
  assert block['mlp']['fc2']['w'] == P(MEMBER, MODEL, None)
  assert block['ln1']['scale'] == P(MEMBER)
  assert specs['pos'] == P(MEMBER, None, MODEL)  # [16, 32]: the fsdp default
  mesh = jax.make_mesh((2, 1, 4), (MEMBER, DATA, MODEL),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  params = jax.jit(lambda key: init(jax.random.split(key, 2)),
                   out_shardings=layout.state_shardings(abstract, mesh)['params'])(
                       jax.random.key(0))
  fc2 = params['blocks'][0]['mlp']['fc2']['w']
  assert fc2.sharding.shard_shape(fc2.shape) == (1, 16, 32)
  x = _x(4)
  forward = jax.jit(jax.vmap(lambda p: model.apply(p, {}, x, train=False)[0]))
  # The members split over 'model' compute what each computes whole on one device (the
  # shared program of the TINY ViT).
  split, whole = np.asarray(forward(params)), jax.device_get(params)
  apply = tiny[2]
  for m in range(2):
    alone, _ = apply(jax.tree.map(lambda a, m=m: a[m], whole), {}, x, train=False)
    np.testing.assert_allclose(split[m], alone, rtol=1e-5, atol=1e-5)


CONFIGS = Path(__file__).resolve().parents[1] / 'configs'


@pytest.mark.parametrize('name, sample, params', [
    ('digits_vit.py', (1, 8, 8, 1), 136_010),
    ('cifar10_vit_ti.py', (1, 32, 32, 3), 5_362_378),  # ViT-Ti: 5.4M
])
def test_configs_load_validate_and_build_at_full_size(name, sample, params):
  config = loading.load_config(CONFIGS / name)
  checks.validate(config)
  model = get_model(specs.model_spec(config), 10)
  abstract, _ = jax.eval_shape(model.init, jax.random.key(0),
                               jax.ShapeDtypeStruct(sample, jnp.float32))
  assert sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract)) == params


def test_digits_vit_trains_through_dist_ens(tmp_path):
  config = loading.load_config(CONFIGS / 'digits_vit.py')
  # Shrunk for a CPU test; data, optimizer, dropout and the model family are the config's.
  config.num_members, config.mesh.member, config.model.depth = 2, 1, 1
  config.train.steps, config.train.log_every, config.checkpoint.every = 2, 2, 2
  config.optim.warmup_steps = 1
  final = dist_ens.train(config, str(tmp_path), devices=jax.devices()[:1])
  assert final['step'] == 2 and not final['frozen_members']
  assert len(final['members']['accuracy']) == 2


def test_digits_vit_splits_its_blocks_by_vit_rules_on_a_model_axis():
  """Its docstring promises VIT_RULES' tensor-parallel split, not FSDP's (issue 45 item 9)."""
  config = loading.load_config(CONFIGS / 'digits_vit.py')
  config.mesh.member, config.mesh.data, config.mesh.model = 4, 1, 2
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config), (8, 8, 1), 10)
  block = parts.abstract_state.params['blocks'][0]
  assert block['attn']['out']['w'].sharding.spec == P(MEMBER, MODEL, None)  # FSDP: columns.
  assert block['mlp']['fc1']['b'].sharding.spec == P(MEMBER, MODEL)  # FSDP: whole (small).
