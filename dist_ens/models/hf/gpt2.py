"""GPT-2 (GPT2LMHeadModel): a decoder over token ids [B, L] -> logits [B, L, vocab].

Learned positions, pre-LayerNorm blocks, a GELU (tanh form, 'gelu_new') MLP of width
n_inner (4 x n_embd unless set), a final LayerNorm and the output projection tied to
the token embedding (lm_head.weight where config.json sets tie_word_embeddings false).

The file's Conv1D weights are stored [in, out] already; the packed c_attn [D, 3D]
becomes three leaves q, k, v [D, D] (so each splits over a 'model' axis on its own).
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from dist_ens.errors import ConfigError
from dist_ens.models import layers as base_layers, transformer
from dist_ens.models.hf import layers
from dist_ens.models.hf.weights import Family, Weight, conv1d, linear, norm, number
from dist_ens.models.token_transformer import token_ids


@dataclasses.dataclass(frozen=True)
class Gpt2:
  vocab: int
  positions: int
  hidden: int
  depth: int
  heads: int
  mlp: int
  eps: float
  act: str
  tied: bool
  scale_by_layer: bool  # scale_attn_by_inverse_layer_idx


def read(config: Mapping[str, Any], where: str) -> Gpt2:
  hidden = number(config, where, 'n_embd', 'hidden_size')
  heads = number(config, where, 'n_head', 'num_attention_heads')
  if hidden % heads:
    raise ConfigError(f'{where}: config.json has n_embd={hidden}, not a multiple of '
                      f'n_head={heads}.')
  if not config.get('scale_attn_weights', True):
    raise ConfigError(f'{where}: config.json sets scale_attn_weights false, which dist_ens '
                      "does not implement (GPT-2's own checkpoints scale).")
  act = number(config, where, 'activation_function', default='gelu_new')
  layers.activation(act, where)
  return Gpt2(vocab=number(config, where, 'vocab_size'),
              positions=number(config, where, 'n_positions', 'max_position_embeddings'),
              hidden=hidden, depth=number(config, where, 'n_layer', 'num_hidden_layers'),
              heads=heads, mlp=number(config, where, 'n_inner', default=4 * hidden),
              eps=float(number(config, where, 'layer_norm_epsilon', default=1e-5)), act=act,
              tied=bool(config.get('tie_word_embeddings', True)),
              scale_by_layer=bool(config.get('scale_attn_by_inverse_layer_idx', False)))


def _split(part: int, hidden: int, is_bias: bool):
  """Cuts q (0), k (1) or v (2) out of c_attn's packed [D, 3D] weight or [3D] bias."""
  cut = slice(part * hidden, (part + 1) * hidden)
  return (lambda a: a[cut]) if is_bias else (lambda a: a[:, cut])


def weights(a: Gpt2) -> list[Weight]:
  d = a.hidden
  table = [Weight('transformer.wte.weight', (a.vocab, d), 'tokens'),
           Weight('transformer.wpe.weight', (a.positions, d), 'pos')]
  for i in range(a.depth):
    h, p = f'transformer.h.{i}', f'blocks/{i}'
    table += norm(f'{h}.ln_1', f'{p}/ln1', d)
    for part, name in enumerate('qkv'):
      table += [Weight(f'{h}.attn.c_attn.weight', (d, 3 * d), f'{p}/attn/{name}/w',
                       _split(part, d, False)),
                Weight(f'{h}.attn.c_attn.bias', (3 * d,), f'{p}/attn/{name}/b',
                       _split(part, d, True), init='zeros')]
    table += conv1d(f'{h}.attn.c_proj', f'{p}/attn/out', d, d)
    table += norm(f'{h}.ln_2', f'{p}/ln2', d)
    table += conv1d(f'{h}.mlp.c_fc', f'{p}/mlp/fc1', d, a.mlp)
    table += conv1d(f'{h}.mlp.c_proj', f'{p}/mlp/fc2', a.mlp, d)
  table += norm('transformer.ln_f', 'norm', d)
  if not a.tied:
    table += linear('lm_head', 'lm_head', d, a.vocab, bias=False)
  return table


def make_apply(a: Gpt2, rate: float):
  act = layers.ACTIVATIONS[a.act]
  head_dim = a.hidden // a.heads

  def apply(params, state, x, *, train=False, rng=None):
    base_layers.check_dropout_rng(rate, train, rng)
    ids = token_ids(x)
    length = ids.shape[1]
    if length > a.positions:
      raise ConfigError(f'this GPT-2 takes at most n_positions={a.positions} tokens; got '
                        f'{length}.')
    h = jnp.take(params['tokens'], ids, axis=0) + params['pos'][:length]
    keys = layers.dropout_keys(rng, rate, 1 + 2 * a.depth)
    h = base_layers.dropout(keys[0], h, rate, train=train)
    mask = layers.causal_mask(length)
    for i, block in enumerate(params['blocks']):
      scale = head_dim ** -0.5 / (i + 1 if a.scale_by_layer else 1)
      y = layers.attention(block['attn'], transformer.layer_norm(block['ln1'], h, a.eps),
                           heads=a.heads, kv_heads=a.heads, head_dim=head_dim, scale=scale,
                           mask=mask)
      h = h + base_layers.dropout(keys[1 + 2 * i], y, rate, train=train)
      y = transformer.layer_norm(block['ln2'], h, a.eps)
      y = layers.dense(block['mlp']['fc2'], act(layers.dense(block['mlp']['fc1'], y)))
      h = h + base_layers.dropout(keys[2 + 2 * i], y, rate, train=train)
    h = transformer.layer_norm(params['norm'], h, a.eps)
    logits = h @ params['tokens'].T if a.tied else layers.dense(params['lm_head'], h)
    return logits, state

  return apply


FAMILY = Family(prefix='transformer.', read=read, weights=weights, make_apply=make_apply)
