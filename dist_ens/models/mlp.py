"""Multi-layer perceptron: flatten, [dense, relu] per hidden width, dense to logits."""

import math

import jax
import jax.numpy as jnp
import ml_collections

from dist_ens.errors import ConfigError
from dist_ens.models.base import Model, dense_init, init_scale_picker


def make_mlp(config: ml_collections.ConfigDict, num_classes: int) -> Model:
  """MLP with hidden widths `config.widths` and He init times `config.init_scale`."""
  widths = tuple(int(w) for w in config.widths)
  if not widths or any(w <= 0 for w in widths):
    raise ConfigError(
        f'config.model.widths={config.widths!r} must be a non-empty list of positive '
        'ints, e.g. (256, 256).')
  pick_scale = init_scale_picker(config)

  def init(rng, input_shape, init_scale=None):
    init_scale = pick_scale(init_scale)
    sizes = (math.prod(input_shape),) + widths + (num_classes,)
    keys = jax.random.split(rng, len(sizes) - 1)
    return [dense_init(k, n_in, n_out, init_scale)
            for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:])]

  def apply(params, x, train=False, rng=None):
    del train, rng  # Deterministic model.
    h = x.reshape(x.shape[0], -1)
    for layer in params[:-1]:
      h = jax.nn.relu(h @ layer['w'] + layer['b'])
    return h @ params[-1]['w'] + params[-1]['b']

  return Model(init, apply)
