"""Llama (LlamaForCausalLM): a decoder over token ids [B, L] -> logits [B, L, vocab].

No position table: rotary positions (rope_theta) on queries and keys; RMSNorm before
each sublayer and at the end; grouped-query attention (num_key_value_heads key/value
heads, head_dim from config.json or hidden / heads); a SwiGLU MLP, down(act(gate(x)) *
up(x)); the output projection lm_head, or the token embedding where config.json sets
tie_word_embeddings. Biases where attention_bias / mlp_bias say.

Rotary scaling variants (rope_type other than 'default': llama3, yarn, linear,
dynamic) are refused in one line rather than computed differently.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from dist_ens.errors import ConfigError
from dist_ens.models import layers as base_layers
from dist_ens.models.hf import layers
from dist_ens.models.hf.weights import Family, Weight, linear, norm, number
from dist_ens.models.token_transformer import token_ids


@dataclasses.dataclass(frozen=True)
class Llama:
  vocab: int
  hidden: int
  depth: int
  heads: int
  kv_heads: int
  head_dim: int
  mlp: int
  eps: float
  theta: float
  act: str
  tied: bool
  attention_bias: bool
  mlp_bias: bool


def _rope_theta(config: Mapping[str, Any], where: str) -> float:
  """rope_theta from config.json: transformers 5's rope_parameters, or the older
  rope_theta and rope_scaling fields."""
  rope = config.get('rope_parameters') or config.get('rope_scaling') or {}
  kind = rope.get('rope_type', rope.get('type', 'default'))
  if kind != 'default':
    raise ConfigError(f"{where}: config.json's rotary positions are of type {kind!r}; "
                      "dist_ens implements only 'default' (rope_theta).")
  return float(rope.get('rope_theta') or config.get('rope_theta') or 10000.0)


def read(config: Mapping[str, Any], where: str) -> Llama:
  hidden = number(config, where, 'hidden_size')
  heads = number(config, where, 'num_attention_heads')
  kv_heads = number(config, where, 'num_key_value_heads', default=heads)
  if heads % kv_heads:
    raise ConfigError(f'{where}: config.json has num_attention_heads={heads}, not a '
                      f'multiple of num_key_value_heads={kv_heads}.')
  act = number(config, where, 'hidden_act', default='silu')
  layers.activation(act, where)
  return Llama(vocab=number(config, where, 'vocab_size'), hidden=hidden,
               depth=number(config, where, 'num_hidden_layers'), heads=heads,
               kv_heads=kv_heads,
               head_dim=number(config, where, 'head_dim', default=hidden // heads),
               mlp=number(config, where, 'intermediate_size'),
               eps=float(number(config, where, 'rms_norm_eps', default=1e-6)),
               theta=_rope_theta(config, where), act=act,
               tied=bool(config.get('tie_word_embeddings', False)),
               attention_bias=bool(config.get('attention_bias', False)),
               mlp_bias=bool(config.get('mlp_bias', False)))


def weights(a: Llama) -> list[Weight]:
  d, q_width, kv_width = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
  table = [Weight('model.embed_tokens.weight', (a.vocab, d), 'tokens')]
  for i in range(a.depth):
    m, p = f'model.layers.{i}', f'blocks/{i}'
    table += norm(f'{m}.input_layernorm', f'{p}/ln1', d, bias=False)
    table += linear(f'{m}.self_attn.q_proj', f'{p}/attn/q', d, q_width, a.attention_bias)
    table += linear(f'{m}.self_attn.k_proj', f'{p}/attn/k', d, kv_width, a.attention_bias)
    table += linear(f'{m}.self_attn.v_proj', f'{p}/attn/v', d, kv_width, a.attention_bias)
    table += linear(f'{m}.self_attn.o_proj', f'{p}/attn/out', q_width, d, a.attention_bias)
    table += norm(f'{m}.post_attention_layernorm', f'{p}/ln2', d, bias=False)
    table += linear(f'{m}.mlp.gate_proj', f'{p}/mlp/gate', d, a.mlp, a.mlp_bias)
    table += linear(f'{m}.mlp.up_proj', f'{p}/mlp/up', d, a.mlp, a.mlp_bias)
    table += linear(f'{m}.mlp.down_proj', f'{p}/mlp/down', a.mlp, d, a.mlp_bias)
  table += norm('model.norm', 'norm', d, bias=False)
  if not a.tied:
    table += linear('lm_head', 'lm_head', d, a.vocab, bias=False)
  return table


def make_apply(a: Llama, rate: float):
  act = layers.ACTIVATIONS[a.act]

  def apply(params, state, x, *, train=False, rng=None):
    base_layers.check_dropout_rng(rate, train, rng)
    ids = token_ids(x)
    length = ids.shape[1]
    h = jnp.take(params['tokens'], ids, axis=0)
    rope = layers.rotary(jnp.arange(length), a.head_dim, a.theta)
    mask = layers.causal_mask(length)
    keys = layers.dropout_keys(rng, rate, 2 * a.depth)
    for i, block in enumerate(params['blocks']):
      y = layers.attention(block['attn'], layers.rms_norm(block['ln1'], h, a.eps),
                           heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                           scale=a.head_dim ** -0.5, mask=mask, rope=rope)
      h = h + base_layers.dropout(keys[2 * i], y, rate, train=train)
      y = layers.rms_norm(block['ln2'], h, a.eps)
      mlp = block['mlp']
      y = layers.dense(mlp['down'], act(layers.dense(mlp['gate'], y)) * layers.dense(mlp['up'], y))
      h = h + base_layers.dropout(keys[2 * i + 1], y, rate, train=train)
    h = layers.rms_norm(params['norm'], h, a.eps)
    logits = h @ params['tokens'].T if a.tied else layers.dense(params['lm_head'], h)
    return logits, state

  return apply


FAMILY = Family(prefix='model.', read=read, weights=weights, make_apply=make_apply)
