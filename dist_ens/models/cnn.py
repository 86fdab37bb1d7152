"""Convolutional net for 1-D signals [length, channels] and 2-D images [h, w, channels].

Strided convolutions with ReLU, then flatten and one dense layer to logits: the
MNIST-1D reference CNN (3 conv layers of 25 channels, kernels 5/3/3, stride 2),
generalised to 2-D inputs. Inputs always carry a trailing channel axis (the data
pipeline adds it), so the spatial rank is simply len(input_shape) - 1.

`spec.conv_impl` (config.model.conv_impl) picks how each convolution is computed
(see models/layers.py).
"""

import math

import jax
import jax.numpy as jnp

from dist_ens.errors import ConfigError
from dist_ens.core.model import Model
from dist_ens.models.base import dense_init
from dist_ens.models import layers
from dist_ens.models.layers import DIMENSION_NUMBERS, conv_for
from dist_ens.models.spec import ModelSpec


def make_cnn(spec: ModelSpec, num_classes: int) -> Model:
  """CNN with `spec.channels`, `spec.kernel_sizes`, `spec.strides` per layer, and
  spec.dropout on the features before the dense layer (Model.features exposes them)."""
  channels = tuple(int(c) for c in spec.channels)
  kernels = tuple(int(k) for k in spec.kernel_sizes)
  strides = tuple(int(s) for s in spec.strides)
  if not (len(channels) == len(kernels) == len(strides) > 0):
    raise ConfigError(
        'config.model.channels, kernel_sizes and strides need one entry per conv '
        f'layer; got {len(channels)}, {len(kernels)} and {len(strides)}.')
  conv = conv_for(spec.conv_impl)

  def init(rng, sample_x):
    input_shape = sample_x.shape[1:]
    rank = len(input_shape) - 1
    if rank not in DIMENSION_NUMBERS:
      raise ConfigError(
          f'cnn takes [length, channels] or [height, width, channels] inputs; got '
          f'input shape {tuple(input_shape)}.')
    keys = jax.random.split(rng, len(channels) + 1)
    in_ch = input_shape[-1]
    x = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)
    convs = []
    for key, out_ch, k in zip(keys[:-1], channels, kernels):
      fan_in = in_ch * k**rank
      std = math.sqrt(2.0 / fan_in)
      convs.append({'w': std * jax.random.normal(key, (k,) * rank + (in_ch, out_ch)),
                    'b': jnp.zeros((out_ch,))})
      in_ch = out_ch
    features = jax.eval_shape(_features, convs, x)
    head = dense_init(keys[-1], math.prod(features.shape[1:]), num_classes)
    return {'convs': convs, 'head': head}, {}

  def _features(convs, x):
    for layer, stride in zip(convs, strides):
      x = jax.nn.relu(conv(x, layer['w'], stride) + layer['b'])
    return x

  rate = layers.dropout_rate_for(spec.dropout)

  def features(params, state, x, *, train=False, rng=None):
    layers.check_dropout_rng(rate, train, rng)
    h = _features(params['convs'], x)
    h = layers.dropout(rng, h.reshape(h.shape[0], -1), rate, train=train)
    return h @ params['head']['w'] + params['head']['b'], h, state

  def apply(params, state, x, *, train=False, rng=None):
    logits, _, state = features(params, state, x, train=train, rng=rng)
    return logits, state

  return Model(init, apply, features=features)
