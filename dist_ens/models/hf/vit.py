"""ViT (ViTForImageClassification, the google/vit-* layout): images [B, H, W, C] in
dist_ens's NHWC (transformers takes NCHW pixel_values) -> logits [B, num_labels].

The patch convolution (kernel = stride = patch_size) as one dense layer over
flattened patches (models/vit.patchify; the conv weight [D, C, p, p] becomes
[p * p * C, D]), a class token first, learned positions for image_size x image_size
inputs, pre-LayerNorm blocks with an exact (erf) GELU, a final LayerNorm and the
classifier ('head') on the class token.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from dist_ens.errors import ConfigError
from dist_ens.models import layers as base_layers, transformer
from dist_ens.models.hf import layers
from dist_ens.models.hf.weights import Family, Weight, linear, norm, num_labels, number
from dist_ens.models.vit import patchify


@dataclasses.dataclass(frozen=True)
class Vit:
  image: int
  patch: int
  channels: int
  hidden: int
  depth: int
  heads: int
  mlp: int
  eps: float
  act: str
  qkv_bias: bool
  classes: int


def read(config: Mapping[str, Any], where: str) -> Vit:
  hidden = number(config, where, 'hidden_size')
  heads = number(config, where, 'num_attention_heads')
  image, patch = number(config, where, 'image_size'), number(config, where, 'patch_size')
  if hidden % heads or image % patch:
    raise ConfigError(f'{where}: config.json needs hidden_size ({hidden}) a multiple of '
                      f'num_attention_heads ({heads}) and image_size ({image}) of '
                      f'patch_size ({patch}).')
  act = number(config, where, 'hidden_act', default='gelu')
  layers.activation(act, where)
  return Vit(image=image, patch=patch, channels=number(config, where, 'num_channels',
                                                       default=3),
             hidden=hidden, depth=number(config, where, 'num_hidden_layers'), heads=heads,
             mlp=number(config, where, 'intermediate_size'),
             eps=float(number(config, where, 'layer_norm_eps', default=1e-12)), act=act,
             qkv_bias=bool(config.get('qkv_bias', True)), classes=num_labels(config))


def _patch_kernel(a):
  """conv weight [D, C, p, p] -> dense [p * p * C, D] in patchify's (row, col, channel)
  order."""
  return a.transpose(2, 3, 1, 0).reshape(-1, a.shape[0])


def weights(a: Vit) -> list[Weight]:
  d, tokens = a.hidden, (a.image // a.patch) ** 2 + 1
  e = 'vit.embeddings'
  table = [Weight(f'{e}.cls_token', (1, 1, d), 'cls', lambda t: t.reshape(1, d)),
           Weight(f'{e}.position_embeddings', (1, tokens, d), 'pos',
                  lambda t: t.reshape(tokens, d)),
           Weight(f'{e}.patch_embeddings.projection.weight', (d, a.channels, a.patch, a.patch),
                  'embed/w', _patch_kernel),
           Weight(f'{e}.patch_embeddings.projection.bias', (d,), 'embed/b', init='zeros')]
  for i in range(a.depth):
    m, p = f'vit.encoder.layer.{i}', f'blocks/{i}'
    table += norm(f'{m}.layernorm_before', f'{p}/ln1', d)
    for name, ours in (('query', 'q'), ('key', 'k'), ('value', 'v')):
      table += linear(f'{m}.attention.attention.{name}', f'{p}/attn/{ours}', d, d, a.qkv_bias)
    table += linear(f'{m}.attention.output.dense', f'{p}/attn/out', d, d)
    table += norm(f'{m}.layernorm_after', f'{p}/ln2', d)
    table += linear(f'{m}.intermediate.dense', f'{p}/mlp/fc1', d, a.mlp)
    table += linear(f'{m}.output.dense', f'{p}/mlp/fc2', a.mlp, d)
  table += norm('vit.layernorm', 'norm', d)
  table += linear('classifier', 'head', d, a.classes)
  return table


def make_apply(a: Vit, rate: float):
  act = layers.ACTIVATIONS[a.act]
  head_dim = a.hidden // a.heads

  def apply(params, state, x, *, train=False, rng=None):
    base_layers.check_dropout_rng(rate, train, rng)
    if x.ndim != 4 or x.shape[1:] != (a.image, a.image, a.channels):
      raise ConfigError(f'this ViT takes images [batch, {a.image}, {a.image}, {a.channels}] '
                        f'(NHWC, config.json\'s image_size and num_channels); got '
                        f'{tuple(x.shape)}.')
    h = layers.dense(params['embed'], patchify(x, a.patch))
    cls = jnp.broadcast_to(params['cls'], (h.shape[0], 1, a.hidden)).astype(h.dtype)
    h = jnp.concatenate([cls, h], axis=1) + params['pos']
    keys = layers.dropout_keys(rng, rate, 1 + 2 * a.depth)
    h = base_layers.dropout(keys[0], h, rate, train=train)
    for i, block in enumerate(params['blocks']):
      y = layers.attention(block['attn'], transformer.layer_norm(block['ln1'], h, a.eps),
                           heads=a.heads, kv_heads=a.heads, head_dim=head_dim,
                           scale=head_dim ** -0.5)
      h = h + base_layers.dropout(keys[1 + 2 * i], y, rate, train=train)
      y = transformer.layer_norm(block['ln2'], h, a.eps)
      y = layers.dense(block['mlp']['fc2'], act(layers.dense(block['mlp']['fc1'], y)))
      h = h + base_layers.dropout(keys[2 + 2 * i], y, rate, train=train)
    h = transformer.layer_norm(params['norm'], h, a.eps)
    return layers.dense(params['head'], h[:, 0]), state

  return apply


FAMILY = Family(prefix='vit.', read=read, weights=weights, make_apply=make_apply,
                with_classes=lambda a, n: dataclasses.replace(a, classes=n))
