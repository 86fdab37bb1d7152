"""A small transformer over token inputs [B, L] (or [B, L, 1]) of integer ids: a token
embedding, a learned position embedding, pre-norm blocks (dist_ens.models.transformer),
a final LayerNorm and a dense classifier of the sequence.

Reads from the ModelSpec (None takes the default in brackets, DEFAULTS):
  vocab_size (256)  ids lie in [0, vocab_size).
  hidden (128), depth (4), heads (4), mlp_dim (512): as in dist_ens.models.vit.
  causal (False)    False: an encoder, every token attends everywhere, classified by
                    the mean over tokens. True: a decoder, each token attends to itself
                    and those before it, classified by the last token's features (the
                    only one that has seen the whole sequence).
  pool (None)       what is classified: None takes 'last' for a decoder and 'mean' for
                    an encoder; 'tokens' gives every position its own outputs [B, L, C]
                    (next-token prediction with config.task='token_classification').
  dropout           after the embedding and on each attention and MLP output.

Inputs should arrive as integers. A float array of ids (today's data pipeline casts
inputs to float32) is converted to int32 first, exact for ids below 2^24 (below 256
under config.precision='bfloat16', which casts float inputs to bf16); ids outside
[0, vocab_size) are clipped by the embedding lookup (jnp.take's default), not checked.
No model state.

Sharding over 'model': TOKEN_RULES are models.vit.VIT_RULES for the blocks plus the
token embedding split on its hidden dimension, so a lookup gathers rows locally.
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dist_ens.core.axes import MODEL
from dist_ens.core.model import Model
from dist_ens.errors import ConfigError
from dist_ens.models import layers, transformer
from dist_ens.models.spec import ModelSpec
from dist_ens.models.vit import VIT_RULES

TOKEN_RULES: tuple[tuple[str, P], ...] = ((r'tokens$', P(None, MODEL)), *VIT_RULES)
# The model's defaults for the spec's Optional fields (None), here only.
DEFAULTS = {'vocab_size': 256, 'hidden': 128, 'depth': 4, 'heads': 4, 'mlp_dim': 512,
            'causal': False, 'pool': None}
POOLS = ('mean', 'last', 'tokens')


def _read_spec(spec: ModelSpec) -> dict[str, int | bool]:
  """The model's fields (see the module doc), defaulted and checked."""
  fields = {name: DEFAULTS[name] if getattr(spec, name) is None else getattr(spec, name)
            for name in DEFAULTS}
  for name in ('vocab_size', 'hidden', 'depth', 'heads', 'mlp_dim'):
    value = fields[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ConfigError(f'config.model.{name}={value!r} must be an int >= 1 for the '
                        f'token_transformer, e.g. {DEFAULTS[name]}.')
  if fields['hidden'] % fields['heads']:
    raise ConfigError(f"config.model.hidden={fields['hidden']} must be a multiple of "
                      f"config.model.heads={fields['heads']}.")
  fields['causal'] = bool(fields['causal'])
  if fields['pool'] is None:
    fields['pool'] = 'last' if fields['causal'] else 'mean'
  if fields['pool'] not in POOLS:
    raise ConfigError(f"config.model.pool={fields['pool']!r} is not known to the "
                      f'token_transformer; use one of {POOLS}.')
  return fields


def token_ids(x: jax.Array) -> jax.Array:
  """[B, L] or [B, L, 1] inputs as int32 ids [B, L] (see the module doc on floats)."""
  if x.ndim == 3 and x.shape[-1] == 1:
    x = x[..., 0]
  if x.ndim != 2:
    raise ConfigError('the token_transformer takes token ids [batch, length] (or [batch, '
                      f'length, 1]); got inputs of shape {tuple(x.shape)}.')
  return x if jnp.issubdtype(x.dtype, jnp.integer) else x.astype(jnp.int32)


def make_token_transformer(spec: ModelSpec, num_classes: int) -> Model:
  """An encoder or decoder over tokens, as the module doc describes.

  Example:
    >>> spec = ModelSpec(name='token_transformer', factory='', kwargs={}, widths=(),
    ...                  channels=(), kernel_sizes=(), strides=(), conv_impl='auto',
    ...                  dropout=0.0, vocab_size=16)
    >>> model = make_token_transformer(spec, 2)
    >>> params, state = model.init(jax.random.key(0), jnp.zeros((1, 12), jnp.int32))
    >>> model.apply(params, state, jnp.ones((3, 12), jnp.int32), train=False)[0].shape
    (3, 2)
  """
  f = _read_spec(spec)
  rate = layers.dropout_rate_for(spec.dropout)

  def init(rng, sample_x):
    length = token_ids(sample_x).shape[1]
    tree = {'blocks': [transformer.block_init(f['hidden'], f['mlp_dim'])
                       for _ in range(f['depth'])],
            'norm': transformer.layer_norm_init(f['hidden']),
            'head': layers.dense_params(f['hidden'], num_classes)}
    k_kernels, k_tokens, k_pos = jax.random.split(rng, 3)
    is_placeholder = jax.tree.map(lambda a: isinstance(a, jax.ShapeDtypeStruct), tree)
    # LeCun normal, as the ViT's kernels (dist_ens.models.vit says why).
    params = jax.tree.map(lambda a, k: a * math.sqrt(0.5) if k else a,
                          layers.he_normal_init(k_kernels, tree), is_placeholder)
    params['tokens'] = 0.02 * jax.random.normal(k_tokens, (f['vocab_size'], f['hidden']))
    params['pos'] = 0.02 * jax.random.normal(k_pos, (length, f['hidden']), jnp.float32)
    return params, {}

  def apply(params, state, x, *, train=False, rng=None):
    layers.check_dropout_rng(rate, train, rng)
    ids = token_ids(x)
    h = jnp.take(params['tokens'], ids, axis=0, mode='clip') + params['pos']
    mask = jnp.tril(jnp.ones((1, ids.shape[1], ids.shape[1]), bool)) if f['causal'] else None
    keys = ([None] * (f['depth'] + 1) if rng is None or not rate
            else list(jax.random.split(rng, f['depth'] + 1)))
    h = layers.dropout(keys[0], h, rate, train=train)
    for block, key in zip(params['blocks'], keys[1:]):
      h = transformer.block(block, h, f['heads'], rate, train=train, rng=key, mask=mask)
    h = transformer.layer_norm(params['norm'], h)
    if f['pool'] != 'tokens':
      h = h[:, -1] if f['pool'] == 'last' else h.mean(axis=1)
    return layers.dense(params['head'], h), state

  return Model(init, apply)
