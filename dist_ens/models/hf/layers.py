"""The pieces the Hugging Face architectures share, as pure functions over explicit
params, written to give transformers' own outputs to float32 rounding: RMSNorm with the
checkpoint's epsilon (LayerNorm is models.transformer's, with torch's biased variance),
the activations config.json names, rotary positions (Llama's halves, not interleaved
pairs) and attention with grouped key/value heads.

Dense layers are {'w': [fan_in, fan_out], 'b': [fan_out]} as in dist_ens.models.layers
(the file's torch Linear weights, [out, in], are transposed on loading), so the
attention's and MLP's paths ('attn/q/w', 'mlp/fc1/w') match the ViT's tensor-parallel
rules (models/vit.py, VIT_RULES).
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dist_ens.errors import ConfigError

Params = dict[str, Any]

# config.json's hidden_act / activation_function -> the function transformers applies.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    'gelu': functools.partial(jax.nn.gelu, approximate=False),  # erf, as torch's default
    'gelu_new': functools.partial(jax.nn.gelu, approximate=True),  # GPT-2's tanh form
    'gelu_pytorch_tanh': functools.partial(jax.nn.gelu, approximate=True),
    'relu': jax.nn.relu,
    'silu': jax.nn.silu,
    'swish': jax.nn.silu,
}


def activation(name: str, where: str) -> Callable[[jax.Array], jax.Array]:
  if name not in ACTIVATIONS:
    raise ConfigError(f'{where}: config.json names the activation {name!r}, which dist_ens '
                      f'does not implement ({", ".join(ACTIVATIONS)}).')
  return ACTIVATIONS[name]


def dense(params: Params, x: jax.Array) -> jax.Array:
  """x @ w (+ b where the layer has a bias)."""
  y = x @ params['w']
  return y + params['b'] if 'b' in params else y


def rms_norm(params: Params, x: jax.Array, eps: float) -> jax.Array:
  """Llama's RMSNorm: x / rms(x) in float32, cast back, then times the scale."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
  return params['scale'] * y.astype(x.dtype)


def rotary(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) [N, head_dim] of rotary positions, frequencies computed in float32 as
  transformers computes them."""
  exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  inv_freq = 1.0 / (jnp.float32(theta) ** exponents)
  freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None]
  angles = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, N, H, head_dim] rotated: x * cos + rotate_half(x) * sin."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[:, None].astype(x.dtype) + rotated * sin[:, None].astype(x.dtype)


def attention(params: Params, x: jax.Array, *, heads: int, kv_heads: int, head_dim: int,
              scale: float, mask: jax.Array | None = None,
              rope: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
  """Self-attention of x [B, N, D] -> [B, N, D] through params 'q', 'k', 'v', 'out'.

  Args:
    heads, kv_heads: query heads and key/value heads; query head h reads key/value
      head h // (heads // kv_heads) (grouped-query attention; equal: multi-head).
    scale: multiplies the logits (1 / sqrt(head_dim) in every family here).
    mask: [1 or B, N, N] bool, True where a query may attend to a key; None: all.
    rope: (cos, sin) from rotary(), applied to queries and keys.
  """
  batch, tokens, _ = x.shape
  q = dense(params['q'], x).reshape(batch, tokens, heads, head_dim)
  k = dense(params['k'], x).reshape(batch, tokens, kv_heads, head_dim)
  v = dense(params['v'], x).reshape(batch, tokens, kv_heads, head_dim)
  if rope is not None:
    q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
  groups = heads // kv_heads
  q = q.reshape(batch, tokens, kv_heads, groups, head_dim)
  logits = jnp.einsum('bqhgd,bkhd->bhgqk', q, k) * jnp.asarray(scale, x.dtype)
  if mask is not None:
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(logits.dtype).min)
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
  out = jnp.einsum('bhgqk,bkhd->bqhgd', weights, v).reshape(batch, tokens, heads * head_dim)
  return dense(params['out'], out)


def causal_mask(tokens: int) -> jax.Array:
  return jnp.tril(jnp.ones((1, tokens, tokens), bool))


def dropout_keys(rng: jax.Array | None, rate: float, count: int) -> list[jax.Array | None]:
  """`count` keys for dropout sites, or Nones where no dropout is drawn."""
  if rng is None or not rate:
    return [None] * count
  return list(jax.random.split(rng, count))
