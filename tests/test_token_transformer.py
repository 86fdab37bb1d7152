"""The built-in token transformer (dist_ens.models.token_transformer): int32 ids stay
integers, encoder and causal decoder, training on a tiny task, its sharding rules."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dist_ens
from dist_ens import data
from dist_ens.core.axes import MEMBER, MODEL
from dist_ens.errors import ConfigError
from dist_ens.models import get_model, transformer
from dist_ens.models.token_transformer import TOKEN_RULES, token_ids
from dist_ens.parallel import sharding_rules as sr
from dist_ens.parallel.layout import Layout
from model_specs import model_spec

TINY = dict(name='token_transformer', vocab_size=16, hidden=32, depth=2, heads=4, mlp_dim=64)


def _model(num_classes=2, **overrides):
  return get_model(model_spec(**{**TINY, **overrides}), num_classes)


def _ids(batch=8, length=12, seed=0):
  # Drawn by numpy: jax.random would compile a threefry program for each shape.
  return jnp.asarray(np.random.default_rng(seed).integers(0, 16, (batch, length)), jnp.int32)


def test_int_ids_are_looked_up_and_float_ids_converted():
  assert token_ids(_ids()).dtype == jnp.int32
  np.testing.assert_array_equal(token_ids(_ids().astype(jnp.float32)[..., None]), _ids())
  model = _model()
  # Jitted (one compile per input dtype): eager, the transformer runs op by op.
  params, state = jax.jit(model.init)(jax.random.key(0), _ids(1))
  assert params['tokens'].shape == (16, 32) and params['pos'].shape == (12, 32)
  apply = jax.jit(lambda p, x: model.apply(p, state, x, train=False)[0])
  logits = apply(params, _ids())
  assert logits.shape == (8, 2) and logits.dtype == jnp.float32
  as_float = apply(params, _ids().astype(jnp.float32))
  np.testing.assert_array_equal(logits, as_float)
  with pytest.raises(ConfigError, match=r'token ids \[batch, length\]'):
    model.init(jax.random.key(0), jnp.zeros((1, 4, 4, 1)))
  with pytest.raises(ConfigError, match='vocab_size=0'):
    _model(vocab_size=0)


def test_causal_mask_hides_later_tokens():
  rng = np.random.default_rng(1)  # numpy draws: no threefry program per shape
  params = jax.tree.map(
      lambda a: rng.normal(size=a.shape).astype(np.float32)
      if isinstance(a, jax.ShapeDtypeStruct) else a, transformer.block_init(32, 64))
  x = rng.normal(size=(1, 6, 32)).astype(np.float32)
  changed = x.copy()
  changed[:, 4:] = 0.0
  mask = jnp.tril(jnp.ones((1, 6, 6), bool))
  # Jitted (two compiles: with and without the mask): eager, attention runs op by op.
  attention = jax.jit(lambda x, mask: transformer.self_attention(params['attn'], x, 4, mask))
  out = attention(x, mask)
  out_changed = attention(changed, mask)
  np.testing.assert_allclose(out[:, :4], out_changed[:, :4], rtol=1e-6, atol=1e-6)
  assert not np.allclose(out[:, 4:], out_changed[:, 4:])
  full = attention(changed, None)
  assert not np.allclose(full[:, :4], out_changed[:, :4])


@pytest.mark.parametrize('causal', [False, True])
def test_sgd_steps_reduce_the_loss(causal):
  model = _model(causal=causal)
  ids = _ids(32, seed=3)
  y = (ids == 3).any(axis=1).astype(jnp.int32)  # does token 3 occur?
  params, state = jax.jit(model.init)(jax.random.key(0), ids[:1])

  def loss(p):
    logits, _ = model.apply(p, state, ids, train=True)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

  @jax.jit
  def step(p):
    value, grads = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), value

  params, first = step(params)
  for _ in range(20):
    params, _ = step(params)
  _, last = step(params)  # the loss after 21 steps (the step's program: no other compile)
  assert float(last) < 0.8 * float(first)


def test_token_rules_split_the_embedding_and_blocks():
  model = _model()
  init = jax.vmap(lambda k: model.init(k, _ids(1))[0])
  abstract = {'params': jax.eval_shape(init, jax.random.split(jax.random.key(0), 2))}
  rule = sr.by_regex(TOKEN_RULES, axis_sizes={MEMBER: 2, MODEL: 4})
  specs = Layout(axes=(MEMBER, MODEL), rule=rule).state_specs(abstract)['params']
  assert specs['tokens'] == P(MEMBER, None, MODEL)
  assert specs['blocks'][0]['attn']['k']['w'] == P(MEMBER, None, MODEL)
  assert specs['blocks'][0]['mlp']['fc2']['w'] == P(MEMBER, MODEL, None)
  assert specs['pos'] == P(MEMBER)


def _int_only_model(num_classes=2):
  """A plain model that fails to trace unless its inputs arrive as integers."""
  def init(rng, x):
    return {'table': 0.1 * jax.random.normal(rng, (5000, num_classes))}, {}

  def apply(params, state, x, *, train=False, rng=None):
    del train, rng
    assert jnp.issubdtype(x.dtype, jnp.integer), f'token ids arrived as {x.dtype}'
    return params['table'][x].mean(axis=1), state

  return dist_ens.Model(init, apply)


def test_int32_token_inputs_reach_the_model_as_integers(tmp_path):
  """Through from_arrays, the input pipeline, the bfloat16 step, evaluation and predict,
  ids stay int32: ids above 256 would not survive bfloat16, above 2^24 not float32."""
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 5000, (320, 12)).astype(np.int64)
  y = (ids[:, 0] > 4095).astype(np.int32)  # needs the exact id: bf16 rounds 4097 to 4096
  dataset = data.from_arrays(ids[:256], y[:256], ids[256:], y[256:])
  assert dataset.train.x.dtype == np.int32
  config = dist_ens.load_config(Path(__file__).parent.parent / 'configs' / 'default.py')
  config.model.factory, config.precision = 'test_token_transformer:_int_only_model', 'bfloat16'
  config.num_members, config.data.batch_size = 2, 32
  config.train.steps, config.train.log_every, config.train.eval_every = 10, 5, 0
  config.checkpoint.every, config.writers = 10, ('jsonl',)
  dist_ens.train(config, str(tmp_path), dataset=dataset)
  out = dist_ens.Ensemble.load(str(tmp_path)).predict(ids[256:], preprocessed=True)
  assert out.probs.shape == (64, 2)
  config.eval.shift = 'gaussian_noise:1'
  with pytest.raises(ConfigError, match='integer token inputs'):
    dist_ens.train(config, str(tmp_path / 'shift'), dataset=dataset)
