"""Layers the built-in models share: convolutions (lax.conv or patches + one matmul).

`conv_for(config)` picks how each convolution is computed (config.model.conv_impl);
all give the same result (to float32 rounding) from the same parameters, so
checkpoints are shared:
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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections

from dist_ens.errors import ConfigError

# Spatial rank -> (input, kernel, output) layouts for lax.conv_general_dilated.
DIMENSION_NUMBERS = {1: ('NWC', 'WIO', 'NWC'), 2: ('NHWC', 'HWIO', 'NHWC')}
CONV_IMPLS = ('auto', 'xla', 'patches')


def _conv_xla(x, w, stride):
  rank = w.ndim - 2
  return jax.lax.conv_general_dilated(
      x, w, window_strides=(stride,) * rank, padding='SAME',
      dimension_numbers=DIMENSION_NUMBERS[rank])


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


def conv_for(config: ml_collections.ConfigDict) -> Callable[[jax.Array, jax.Array, int], jax.Array]:
  """conv(x, w, stride) with 'SAME' padding, as config.conv_impl names (see above)."""
  conv_impl = config.get('conv_impl', 'auto')
  if conv_impl not in CONV_IMPLS:
    raise ConfigError(f'config.model.conv_impl={conv_impl!r} is not known; use one of '
                      f'{list(CONV_IMPLS)}.')
  return _CONVS['patches' if conv_impl == 'auto' else conv_impl]
