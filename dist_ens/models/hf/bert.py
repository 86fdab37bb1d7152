"""BERT-family text encoders with a sequence classifier: BertForSequenceClassification
and RobertaForSequenceClassification, token ids [B, L] -> logits [B, num_labels].

Embeddings (token + absolute position + token type 0) through a LayerNorm; post-
LayerNorm blocks, x = LN(x + attn(x)), x = LN(x + MLP(x)), every token attending to
every other (transformers' default all-ones attention mask); then
  BERT:    the pooler, tanh(dense(first token)), then the classifier;
  RoBERTa: no pooler; its classification head dense -> tanh -> out_proj on the first
           token; positions count from pad_token_id + 1 over non-padding tokens,
           padding tokens take position pad_token_id (transformers' rule).
The classifier is the 'head' subtree (models/heads.py), so an ensemble's members each
start their own (config.ensemble.own) on the shared encoder.

Built for training (config.model.init_from='hf:PATH', `for_text`), two things change:
padding tokens (pad_token_id) are masked out of attention as transformers' attention_mask
from a tokenizer masks them, and config.model.pool picks the features the classifier
reads: 'cls' (the first token's, the class's own) or 'mean' (the mean over non-padding
tokens); what follows (BERT's pooler, RoBERTa's dense layer) is unchanged. `from_hf`
keeps transformers' default call (no mask, 'cls').
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from dist_ens.errors import ConfigError
from dist_ens.models import layers as base_layers, transformer
from dist_ens.models.hf import layers
from dist_ens.models.hf.weights import Family, Weight, linear, norm, num_labels, number
from dist_ens.models.token_transformer import token_ids


@dataclasses.dataclass(frozen=True)
class Bert:
  roberta: bool
  vocab: int
  positions: int
  types: int
  hidden: int
  depth: int
  heads: int
  mlp: int
  eps: float
  act: str
  pad: int
  classes: int
  pool: str = 'cls'  # 'cls' or 'mean' (POOLS)
  mask_padding: bool = False  # padding tokens are masked out of attention


POOLS = ('cls', 'mean')


def _reader(roberta: bool):
  def read(config: Mapping[str, Any], where: str) -> Bert:
    hidden = number(config, where, 'hidden_size')
    heads = number(config, where, 'num_attention_heads')
    if hidden % heads:
      raise ConfigError(f'{where}: config.json has hidden_size={hidden}, not a multiple of '
                        f'num_attention_heads={heads}.')
    kind = config.get('position_embedding_type', 'absolute')
    if kind != 'absolute':
      raise ConfigError(f"{where}: config.json's position_embedding_type={kind!r}; dist_ens "
                        "implements 'absolute' only.")
    act = number(config, where, 'hidden_act', default='gelu')
    layers.activation(act, where)
    return Bert(roberta=roberta, vocab=number(config, where, 'vocab_size'),
                positions=number(config, where, 'max_position_embeddings'),
                types=number(config, where, 'type_vocab_size', default=2), hidden=hidden,
                depth=number(config, where, 'num_hidden_layers'), heads=heads,
                mlp=number(config, where, 'intermediate_size'),
                eps=float(number(config, where, 'layer_norm_eps', default=1e-12)), act=act,
                pad=int(number(config, where, 'pad_token_id', default=1 if roberta else 0)),
                classes=num_labels(config))
  return read


def weights(a: Bert) -> list[Weight]:
  base, d = ('roberta' if a.roberta else 'bert'), a.hidden
  e = f'{base}.embeddings'
  table = [Weight(f'{e}.word_embeddings.weight', (a.vocab, d), 'tokens'),
           Weight(f'{e}.position_embeddings.weight', (a.positions, d), 'pos'),
           Weight(f'{e}.token_type_embeddings.weight', (a.types, d), 'types')]
  table += norm(f'{e}.LayerNorm', 'embed_norm', d)
  for i in range(a.depth):
    m, p = f'{base}.encoder.layer.{i}', f'blocks/{i}'
    for name, ours in (('query', 'q'), ('key', 'k'), ('value', 'v')):
      table += linear(f'{m}.attention.self.{name}', f'{p}/attn/{ours}', d, d)
    table += linear(f'{m}.attention.output.dense', f'{p}/attn/out', d, d)
    table += norm(f'{m}.attention.output.LayerNorm', f'{p}/ln1', d)
    table += linear(f'{m}.intermediate.dense', f'{p}/mlp/fc1', d, a.mlp)
    table += linear(f'{m}.output.dense', f'{p}/mlp/fc2', a.mlp, d)
    table += norm(f'{m}.output.LayerNorm', f'{p}/ln2', d)
  if a.roberta:
    table += linear('classifier.dense', 'head/dense', d, d)
    table += linear('classifier.out_proj', 'head/out', d, a.classes)
  else:
    table += linear(f'{base}.pooler.dense', 'pooler', d, d)
    table += linear('classifier', 'head', d, a.classes)
  return table


def _positions(a: Bert, ids: jnp.ndarray) -> jnp.ndarray:
  if not a.roberta:
    return jnp.arange(ids.shape[1])[None]
  real = (ids != a.pad).astype(jnp.int32)
  return jnp.cumsum(real, axis=1) * real + a.pad


def _pooled(a: Bert, h: jnp.ndarray, ids: jnp.ndarray) -> jnp.ndarray:
  """[B, D]: the first token's features, or the mean over the non-padding tokens."""
  if a.pool == 'cls':
    return h[:, 0]
  real = (ids != a.pad)[..., None]
  count = jnp.maximum(real.sum(axis=1), 1).astype(h.dtype)
  return jnp.where(real, h, 0).sum(axis=1) / count


def make_apply(a: Bert, rate: float):
  act = layers.ACTIVATIONS[a.act]
  head_dim = a.hidden // a.heads

  def apply(params, state, x, *, train=False, rng=None):
    base_layers.check_dropout_rng(rate, train, rng)
    ids = token_ids(x)
    positions = _positions(a, ids)
    if ids.shape[1] + (a.pad + 1 if a.roberta else 0) > a.positions:
      raise ConfigError(f'this encoder takes at most {a.positions} positions; got '
                        f'{ids.shape[1]} tokens.')
    mask = (ids != a.pad)[:, None, :] if a.mask_padding else None  # [B, 1 query, keys]
    h = (jnp.take(params['tokens'], ids, axis=0) + jnp.take(params['pos'], positions, axis=0)
         + params['types'][0])
    h = transformer.layer_norm(params['embed_norm'], h, a.eps)
    keys = layers.dropout_keys(rng, rate, 3 + 2 * a.depth)
    h = base_layers.dropout(keys[0], h, rate, train=train)
    for i, block in enumerate(params['blocks']):
      y = layers.attention(block['attn'], h, heads=a.heads, kv_heads=a.heads,
                           head_dim=head_dim, scale=head_dim ** -0.5, mask=mask)
      h = transformer.layer_norm(block['ln1'], h + base_layers.dropout(keys[1 + 2 * i], y, rate,
                                                                  train=train), a.eps)
      y = layers.dense(block['mlp']['fc2'], act(layers.dense(block['mlp']['fc1'], h)))
      h = transformer.layer_norm(block['ln2'], h + base_layers.dropout(keys[2 + 2 * i], y, rate,
                                                                  train=train), a.eps)
    first = _pooled(a, h, ids)
    if a.roberta:
      first = base_layers.dropout(keys[-2], first, rate, train=train)
      first = jnp.tanh(layers.dense(params['head']['dense'], first))
      first = base_layers.dropout(keys[-1], first, rate, train=train)
      return layers.dense(params['head']['out'], first), state
    pooled = jnp.tanh(layers.dense(params['pooler'], first))
    pooled = base_layers.dropout(keys[-1], pooled, rate, train=train)
    return layers.dense(params['head'], pooled), state

  return apply


def _with_classes(a: Bert, classes: int) -> Bert:
  return dataclasses.replace(a, classes=classes)


def for_text(a: Bert, pool: str | None, where: str) -> Bert:
  """The encoder as training builds it (module doc): padding masked, `pool` (None: 'cls')."""
  pool = 'cls' if pool is None else pool
  if pool not in POOLS:
    raise ConfigError(f'config.model.pool={pool!r} is not a pooling of this encoder '
                      f'({where}); use one of {POOLS}.')
  return dataclasses.replace(a, pool=pool, mask_padding=True)


BERT = Family(prefix='bert.', read=_reader(False), weights=weights, make_apply=make_apply,
              with_classes=_with_classes, for_text=for_text)
ROBERTA = Family(prefix='roberta.', read=_reader(True), weights=weights,
                 make_apply=make_apply, with_classes=_with_classes, for_text=for_text)
