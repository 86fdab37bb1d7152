"""Transformer layers as pure functions over explicit parameters, for the built-in
ViT (dist_ens.models.vit) and token models: LayerNorm, multi-head self-attention and
the pre-norm encoder block.

Parameters are nested dicts whose dense layers are {'w': [fan_in, fan_out], 'b':
[fan_out]} (dist_ens.models.layers.dense_params), so a block's paths read
'attn/q/w', 'mlp/fc1/w', ... and sharding rules can name them by regex
(dist_ens.parallel.sharding_rules.by_regex). q, k and v are three dense layers
rather than one packed [hidden, 3 * hidden] kernel: each then splits over a 'model'
axis on its own output dimension, and none of them has a bias of two long axes that
dist_ens.core.model.is_kernel would take for a kernel (weight decay, init_scale).
"""

from typing import Any

import jax
import jax.numpy as jnp

from dist_ens.models import layers

Params = dict[str, Any]


def layer_norm_init(features: int) -> Params:
  """A LayerNorm's {'scale': ones, 'bias': zeros} [features]."""
  return {'scale': jnp.ones((features,), jnp.float32),
          'bias': jnp.zeros((features,), jnp.float32)}


def layer_norm(params: Params, x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """LayerNorm over the last axis, statistics in float32 even for bf16 activations."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mean).mean(-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps)
  return (y * params['scale'] + params['bias']).astype(x.dtype)


def block_init(hidden: int, mlp_dim: int) -> Params:
  """A pre-norm encoder block's params, kernels as layers.kernel() placeholders."""
  return {'ln1': layer_norm_init(hidden),
          'attn': {name: layers.dense_params(hidden, hidden) for name in ('q', 'k', 'v', 'out')},
          'ln2': layer_norm_init(hidden),
          'mlp': {'fc1': layers.dense_params(hidden, mlp_dim),
                  'fc2': layers.dense_params(mlp_dim, hidden)}}


def self_attention(params: Params, x: jax.Array, heads: int,
                   mask: jax.Array | None = None) -> jax.Array:
  """Multi-head self-attention of x [B, N, hidden] -> [B, N, hidden].

  Args:
    params: {'q', 'k', 'v', 'out'} dense layers [hidden, hidden].
    x: the (normalised) tokens.
    heads: the number of heads; hidden must be a multiple of it.
    mask: optional [B or 1, N, N] bool, True where a query may attend to a key (a
      causal mask for a decoder); None attends everywhere.
  """
  batch, tokens, hidden = x.shape
  head_dim = hidden // heads

  def split(name):
    return layers.dense(params[name], x).reshape(batch, tokens, heads, head_dim)

  q, k, v = split('q'), split('k'), split('v')
  logits = jnp.einsum('bqhd,bkhd->bhqk', q, k) / jnp.sqrt(head_dim).astype(x.dtype)
  if mask is not None:
    logits = jnp.where(mask[:, None], logits, jnp.finfo(logits.dtype).min)
  # Softmax in float32: bf16 logits lose the small differences that pick a token.
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
  out = jnp.einsum('bhqk,bkhd->bqhd', weights, v).reshape(batch, tokens, hidden)
  return layers.dense(params['out'], out)


def block(params: Params, x: jax.Array, heads: int, rate: float, *, train: bool,
          rng: jax.Array | None, mask: jax.Array | None = None) -> jax.Array:
  """A pre-norm encoder block: x + attn(LN(x)), then + MLP(LN(.)) with GELU.

  Dropout (rate) acts on the attention's and the MLP's outputs before each residual
  sum, as in ViT; rng (None: no dropout) is split between the two.
  """
  keys = (None, None) if rng is None else tuple(jax.random.split(rng))
  h = self_attention(params['attn'], layer_norm(params['ln1'], x), heads, mask)
  x = x + layers.dropout(keys[0], h, rate, train=train)
  h = jax.nn.gelu(layers.dense(params['mlp']['fc1'], layer_norm(params['ln2'], x)))
  h = layers.dense(params['mlp']['fc2'], h)
  return x + layers.dropout(keys[1], h, rate, train=train)
