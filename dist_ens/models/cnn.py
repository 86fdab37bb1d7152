"""Convolutional net for 1-D signals [length, channels] and 2-D images [h, w, channels].

Strided convolutions with ReLU, then flatten and one dense layer to logits: the
MNIST-1D reference CNN (3 conv layers of 25 channels, kernels 5/3/3, stride 2),
generalised to 2-D inputs. Inputs always carry a trailing channel axis (the data
pipeline adds it), so the spatial rank is simply len(input_shape) - 1.

`config.conv_impl` picks how each convolution is computed; all give the same
result (to float32 rounding) from the same parameters, so checkpoints are shared:
  'xla'      lax.conv_general_dilated. Under dist_ens's vmap over members the
             kernels are batched, which turns every convolution into a grouped one
             (feature_group_count=M), 1.5-3.2x slower than 'patches' on a 2-core CPU
             and 2.7-7.6x on an H100 for the CNNs of BENCHMARKS.md.
  'patches'  im2col by strided slicing: the k^rank shifted, strided views of the
             padded input concatenated along channels, times the kernel reshaped to
             [k^rank * in_ch, out_ch]: one dot, which vmap turns into a batched
             dot (and, for the first layer's shared batch, one wide dot).
  'auto'     dist_ens's choice: 'patches' (faster on every backend measured, see
             BENCHMARKS.md; 'xla' stays for layers too big for k^rank x activations).
"""

import itertools
import math

import jax
import jax.numpy as jnp
import ml_collections

from dist_ens.errors import ConfigError
from dist_ens.models.base import Model, dense_init, init_scale_picker

# Spatial rank -> (input, kernel, output) layouts for lax.conv_general_dilated.
_DIMENSION_NUMBERS = {1: ('NWC', 'WIO', 'NWC'), 2: ('NHWC', 'HWIO', 'NHWC')}
CONV_IMPLS = ('auto', 'xla', 'patches')


def _conv_xla(x, w, stride):
  rank = w.ndim - 2
  return jax.lax.conv_general_dilated(
      x, w, window_strides=(stride,) * rank, padding='SAME',
      dimension_numbers=_DIMENSION_NUMBERS[rank])


def _conv_patches(x, w, stride):
  """_conv_xla as slices + one dot: x [B, *spatial, in_ch], w [*k, in_ch, out_ch]."""
  rank = w.ndim - 2
  ksize, (in_ch, out_ch) = w.shape[:rank], w.shape[rank:]
  strides = (stride,) * rank
  # 'SAME' exactly as lax pads it for this stride; the output has ceil(n / stride).
  pads = jax.lax.padtype_to_pads(x.shape[1:1 + rank], ksize, strides, 'SAME')
  out = [-(-n // stride) for n in x.shape[1:1 + rank]]
  x = jnp.pad(x, [(0, 0), *pads, (0, 0)])
  patches = []
  # Offsets in row-major order, the order of w's [*k, in_ch] -> [k^rank * in_ch] reshape.
  for offset in itertools.product(*(range(k) for k in ksize)):
    limit = [x.shape[0]] + [o + (n - 1) * stride + 1 for o, n in zip(offset, out)] + [in_ch]
    patches.append(jax.lax.slice(x, (0, *offset, 0), limit, (1, *strides, 1)))
  return jnp.concatenate(patches, axis=-1) @ w.reshape(-1, out_ch)


_CONVS = {'xla': _conv_xla, 'patches': _conv_patches}


def make_cnn(config: ml_collections.ConfigDict, num_classes: int) -> Model:
  """CNN with `config.channels`, `config.kernel_sizes`, `config.strides` per layer."""
  channels = tuple(int(c) for c in config.channels)
  kernels = tuple(int(k) for k in config.kernel_sizes)
  strides = tuple(int(s) for s in config.strides)
  if not (len(channels) == len(kernels) == len(strides) > 0):
    raise ConfigError(
        'config.model.channels, kernel_sizes and strides need one entry per conv '
        f'layer; got {len(channels)}, {len(kernels)} and {len(strides)}.')
  conv_impl = config.get('conv_impl', 'auto')
  if conv_impl not in CONV_IMPLS:
    raise ConfigError(f'config.model.conv_impl={conv_impl!r} is not known; use one of '
                      f'{list(CONV_IMPLS)}.')
  if conv_impl == 'auto':
    conv_impl = 'patches'
  conv = _CONVS[conv_impl]
  pick_scale = init_scale_picker(config)

  def init(rng, input_shape, init_scale=None):
    init_scale = pick_scale(init_scale)
    rank = len(input_shape) - 1
    if rank not in _DIMENSION_NUMBERS:
      raise ConfigError(
          f'cnn takes [length, channels] or [height, width, channels] inputs; got '
          f'input shape {tuple(input_shape)}.')
    keys = jax.random.split(rng, len(channels) + 1)
    in_ch = input_shape[-1]
    x = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)
    convs = []
    for key, out_ch, k in zip(keys[:-1], channels, kernels):
      fan_in = in_ch * k**rank
      std = init_scale * math.sqrt(2.0 / fan_in)
      convs.append({'w': std * jax.random.normal(key, (k,) * rank + (in_ch, out_ch)),
                    'b': jnp.zeros((out_ch,))})
      in_ch = out_ch
    features = jax.eval_shape(_features, convs, x)
    head = dense_init(keys[-1], math.prod(features.shape[1:]), num_classes, init_scale)
    return {'convs': convs, 'head': head}

  def _features(convs, x):
    for layer, stride in zip(convs, strides):
      x = jax.nn.relu(conv(x, layer['w'], stride) + layer['b'])
    return x

  def apply(params, x, train=False, rng=None):
    del train, rng  # Deterministic model.
    h = _features(params['convs'], x)
    return h.reshape(h.shape[0], -1) @ params['head']['w'] + params['head']['b']

  return Model(init, apply)
