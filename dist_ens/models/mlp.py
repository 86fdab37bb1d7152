"""Multi-layer perceptron: flatten, [dense, relu] per hidden width, dense to logits."""

import math

import jax

from dist_ens.core.model import Model
from dist_ens.errors import ConfigError
from dist_ens.models import layers
from dist_ens.models.base import dense_init
from dist_ens.models.spec import ModelSpec


def make_mlp(spec: ModelSpec, num_classes: int) -> Model:
  """MLP with hidden widths `spec.widths`, He-normal init and spec.dropout after
  every hidden layer; no model state. It exposes its last hidden layer (Model.features)."""
  widths = tuple(int(w) for w in spec.widths)
  if not widths or any(w <= 0 for w in widths):
    raise ConfigError(
        f'config.model.widths={spec.widths!r} must be a non-empty list of positive '
        'ints, e.g. (256, 256).')

  def init(rng, sample_x):
    sizes = (math.prod(sample_x.shape[1:]),) + widths + (num_classes,)
    keys = jax.random.split(rng, len(sizes) - 1)
    return [dense_init(k, n_in, n_out) for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:])], {}

  rate = layers.dropout_rate_for(spec.dropout)

  def features(params, state, x, *, train=False, rng=None):
    layers.check_dropout_rng(rate, train, rng)
    keys = [None] * len(widths) if rng is None or not rate else jax.random.split(rng, len(widths))
    h = x.reshape(x.shape[0], -1)
    for layer, key in zip(params[:-1], keys):
      h = layers.dropout(key, jax.nn.relu(h @ layer['w'] + layer['b']), rate, train=train)
    return h @ params[-1]['w'] + params[-1]['b'], h, state

  def apply(params, state, x, *, train=False, rng=None):
    logits, _, state = features(params, state, x, train=train, rng=rng)
    return logits, state

  return Model(init, apply, features=features)
