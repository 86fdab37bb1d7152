"""The corruption families of dist_ens.data.corruptions: per-example functions fn(key,
x, level) on inputs in [0, 1] ([L, C] signals or [H, W, C] images), with their five
severities' levels. Filters are fixed-order sums of shifted copies, so a corrupted example
is the same bits whatever batch or sharding it sits in."""

import itertools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.ndimage import map_coordinates

Corruption = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

# Spatial parameters are given in pixels of a 32-pixel side (CIFAR's).
_REFERENCE_SIDE = 32.0
# Points along a motion-blur line and zoom factors averaged by zoom_blur.
_MOTION_SAMPLES = 9
_ZOOM_SAMPLES = 8
_ELASTIC_SMOOTHING = 2.0  # pixels at 32, the correlation length of the displacement


class Family(NamedTuple):
  """A corruption family: its per-example function and parameters."""
  fn: Corruption
  levels: tuple[float, ...]  # severities 1..5, moving away from `identity`
  identity: float  # the level at which fn is the identity (severity 0)
  spatial_rank: tuple[int, ...] = (1, 2)  # example ranks (1-D, 2-D) it applies to
  channels: int | None = None  # the channel count it needs (3: colour), None: any


def _scale(x: jax.Array) -> float:
  """Pixels of this example per pixel of a 32-pixel side, at least 1 (static).

  Never below 1: on 8 x 8 digits a 32-pixel-relative blur would be a no-op.
  """
  return max(1.0, min(x.shape[:-1]) / _REFERENCE_SIDE)


def _offsets(radius: int, rank: int) -> np.ndarray:
  """Every offset in [-radius, radius]^rank, [(2 radius + 1)^rank, rank] float32."""
  steps = range(-radius, radius + 1)
  return np.array(list(itertools.product(steps, repeat=rank)), np.float32).reshape(-1, rank)


def _shift_filter(x: jax.Array, radius: int, weights: jax.Array,
                  axes: Sequence[int]) -> jax.Array:
  """Normalised sum over offsets o (`_offsets(radius, len(axes))`) of weights[o] * x[. + o].

  x is edge-padded. An explicit sum of shifted copies, in a fixed order, rather than a
  convolution: per-element arithmetic that cannot depend on the batch's shape.
  """
  # Materialised once, before use: if XLA fused the weights' exp into the sum, its
  # vectorised and scalar exp (which differ in the last bit) would be picked by shape.
  weights = jax.lax.optimization_barrier(weights / jnp.sum(weights))
  pad = [(radius, radius) if a in axes else (0, 0) for a in range(x.ndim)]
  padded = jnp.pad(x, pad, mode='edge')
  total = jnp.zeros_like(x)
  for k, offset in enumerate(_offsets(radius, len(axes)).astype(int)):
    start = [0] * x.ndim
    for a, o in zip(axes, offset):
      start[a] = radius + int(o)
    window = jax.lax.slice(padded, start, [s + n for s, n in zip(start, x.shape)])
    total = total + weights[k] * window
  return total


def _gaussian_filter(x: jax.Array, sigma: jax.Array, max_sigma: float) -> jax.Array:
  """Separable Gaussian blur over x's spatial axes; sigma (pixels) may be traced."""
  radius = max(1, math.ceil(3 * max_sigma))
  # The tiny term keeps sigma = 0 finite: every offset but 0 then weighs exp(-inf) = 0.
  weights = jnp.exp(-_offsets(radius, 1)[:, 0]**2 / (2 * sigma**2 + 1e-12))
  for axis in range(x.ndim - 1):
    x = _shift_filter(x, radius, weights, [axis])
  return x


def _spatial_mean(x: jax.Array) -> jax.Array:
  """Mean over x's spatial axes (all but the last), keepdims, in a fixed order.

  Halves are added pairwise (a fixed tree of elementwise adds): an XLA reduce may
  order its sum by the batch's shape and layout, and then the bits would depend on it.
  """
  count = math.prod(x.shape[:-1])
  for axis in range(x.ndim - 1):
    while x.shape[axis] > 1:
      if x.shape[axis] % 2:  # an exact zero makes the length even
        x = jnp.concatenate([x, jnp.zeros_like(jax.lax.slice_in_dim(x, 0, 1, axis=axis))], axis)
      half = x.shape[axis] // 2
      x = jax.lax.slice_in_dim(x, 0, half, axis=axis) + jax.lax.slice_in_dim(x, half, 2 * half,
                                                                              axis=axis)
  return x / count


def _sample(x: jax.Array, coords: jax.Array) -> jax.Array:
  """x [*spatial, C] read at float positions coords [rank, *spatial] (bilinear, edge)."""
  one = lambda channel: map_coordinates(channel, list(coords), order=1, mode='nearest')
  return jax.vmap(one, in_axes=-1, out_axes=-1)(x)


def _grid(x: jax.Array) -> jax.Array:
  """Integer positions of x's spatial grid, [rank, *spatial] float32."""
  return jnp.stack(jnp.meshgrid(*[jnp.arange(n, dtype=jnp.float32) for n in x.shape[:-1]],
                                indexing='ij'))


# --- noise ------------------------------------------------------------------------

def gaussian_noise(key: jax.Array, x: jax.Array, std: jax.Array) -> jax.Array:
  """x + N(0, std^2), independently per value."""
  return x + std * jax.random.normal(key, x.shape, x.dtype)


def shot_noise(key: jax.Array, x: jax.Array, quantum: jax.Array) -> jax.Array:
  """Poisson(x / quantum) * quantum: photon noise with 1 / quantum photons at x = 1."""
  safe = jnp.where(quantum > 0, quantum, 1.0)  # quantum 0 (no noise) must not divide
  photons = jax.random.poisson(key, jnp.maximum(x, 0.0) / safe, x.shape)
  return jnp.where(quantum > 0, photons.astype(x.dtype) * safe, x)


def impulse_noise(key: jax.Array, x: jax.Array, amount: jax.Array) -> jax.Array:
  """Salt and pepper: a fraction `amount` of values set to 0 or 1 (half each)."""
  u = jax.random.uniform(key, x.shape, x.dtype)
  return jnp.where(u < amount / 2, 0.0, jnp.where(u > 1 - amount / 2, 1.0, x))


def speckle_noise(key: jax.Array, x: jax.Array, std: jax.Array) -> jax.Array:
  """x + x * N(0, std^2): multiplicative noise."""
  return x + x * std * jax.random.normal(key, x.shape, x.dtype)


# --- blur -------------------------------------------------------------------------

def gaussian_blur(key: jax.Array, x: jax.Array, sigma: jax.Array) -> jax.Array:
  """Gaussian blur of std `sigma` pixels (at 32) along every spatial axis."""
  del key
  s = _scale(x)
  return _gaussian_filter(x, sigma * s, _FAMILY_MAX['gaussian_blur'] * s)


def defocus_blur(key: jax.Array, x: jax.Array, radius: jax.Array) -> jax.Array:
  """Mean over a disk (a segment in 1-D) of `radius` pixels beyond the centre pixel.

  An offset at distance d weighs clip(radius + 1 - d, 0, 1): a one-pixel linear edge,
  so the kernel grows continuously with the radius; radius 0 is the centre alone.
  """
  del key
  r = radius * _scale(x)
  reach, rank = math.ceil(_FAMILY_MAX['defocus_blur'] * _scale(x) + 1), x.ndim - 1
  distance = np.sqrt(np.sum(_offsets(reach, rank)**2, axis=1))
  return _shift_filter(x, reach, jnp.clip(r + 1 - distance, 0.0, 1.0), list(range(rank)))


def motion_blur(key: jax.Array, x: jax.Array, length: jax.Array) -> jax.Array:
  """Mean of x along a centred line of `length` pixels at a random angle in [-45, 45] deg."""
  angle = jax.random.uniform(key, (), minval=-jnp.pi / 4, maxval=jnp.pi / 4)
  step = jnp.stack([jnp.sin(angle), jnp.cos(angle)]) * length * _scale(x)
  grid, total = _grid(x), jnp.zeros_like(x)
  for t in np.linspace(-0.5, 0.5, _MOTION_SAMPLES):
    total = total + _sample(x, grid + t * step[:, None, None])
  return total / _MOTION_SAMPLES


def zoom_blur(key: jax.Array, x: jax.Array, zoom: jax.Array) -> jax.Array:
  """Mean of x magnified about its centre by factors evenly spaced in [1, 1 + zoom]."""
  del key
  grid = _grid(x)
  centre = jnp.asarray([(n - 1) / 2 for n in x.shape[:-1]], jnp.float32).reshape(
      (-1,) + (1,) * (x.ndim - 1))
  total = jnp.zeros_like(x)
  for k in range(_ZOOM_SAMPLES):
    factor = 1 + zoom * k / (_ZOOM_SAMPLES - 1)
    total = total + _sample(x, centre + (grid - centre) / factor)
  return total / _ZOOM_SAMPLES


# --- digital ----------------------------------------------------------------------

def contrast(key: jax.Array, x: jax.Array, factor: jax.Array) -> jax.Array:
  """Each channel's deviation from its mean over the example scaled by `factor`."""
  del key
  mean = _spatial_mean(x)
  return (x - mean) * factor + mean


def brightness(key: jax.Array, x: jax.Array, shift: jax.Array) -> jax.Array:
  """HSV value V = max over channels raised by `shift` (clipped to 1), hue and saturation kept.

  Scaling all channels by V' / V keeps H and S; a black pixel (V = 0) becomes grey V'.
  With one channel this is x + shift.
  """
  del key
  value = jnp.max(x, axis=-1, keepdims=True)
  new = jnp.clip(value + shift, 0.0, 1.0)
  positive = value > 0
  return jnp.where(positive, x * (new / jnp.where(positive, value, 1.0)), new)


def saturate(key: jax.Array, x: jax.Array, factor: jax.Array) -> jax.Array:
  """HSV saturation S multiplied by `factor` (clipped to 1), hue and value kept.

  A channel is V - V * S * g(hue), so scaling S scales each channel's distance to V.
  """
  del key
  value, low = jnp.max(x, -1, keepdims=True), jnp.min(x, -1, keepdims=True)
  sat = jnp.where(value > 0, (value - low) / jnp.where(value > 0, value, 1.0), 0.0)
  new = jnp.clip(sat * factor, 0.0, 1.0)
  ratio = jnp.where(sat > 0, new / jnp.where(sat > 0, sat, 1.0), 1.0)
  return value - (value - x) * ratio


def _box_resample(n: int, keep: jax.Array) -> jax.Array:
  """[n, n] matrix of a box downsample of an axis to n * keep pixels and back up.

  Block j covers [j / keep, (j + 1) / keep); a block's value is the mean of the
  pixels it overlaps, weighted by overlap, and a pixel's value the overlap-weighted
  mean of its blocks (PIL's BOX resize both ways, at a fractional size). It moves
  continuously with `keep`; keep = 1 gives the identity.
  """
  pos = jnp.arange(n, dtype=jnp.float32)
  start, end = pos[:, None] / keep, (pos[:, None] + 1) / keep  # blocks j (rows)
  overlap = jnp.clip(jnp.minimum(end, pos[None] + 1) - jnp.maximum(start, pos[None]), 0.0, None)
  block_mean = overlap / jnp.maximum(jnp.sum(overlap, axis=1, keepdims=True), 1e-12)
  # A pixel's overlaps with the blocks sum to 1: the blocks tile [0, n / keep) >= [0, n).
  return overlap.T @ block_mean


def pixelate(key: jax.Array, x: jax.Array, keep: jax.Array) -> jax.Array:
  """Each axis box-downsampled to `keep` of its length and box-upsampled back.

  The resampling is an n x n matrix (`_box_resample`) summed term by term along the
  axis (n = its length), so `keep` may be traced and the sum's order is fixed.
  """
  del key
  for axis in range(x.ndim - 1):
    n = x.shape[axis]
    # Built once from the scalar keep, apart from the per-example sum (see _shift_filter).
    mix = jax.lax.optimization_barrier(_box_resample(n, keep))
    shape = [1] * x.ndim
    shape[axis] = n
    total = jnp.zeros_like(x)
    for j in range(n):
      total = total + mix[:, j].reshape(shape) * jax.lax.slice_in_dim(x, j, j + 1, axis=axis)
    x = total
  return x


def elastic_transform(key: jax.Array, x: jax.Array, displacement: jax.Array) -> jax.Array:
  """x resampled along a smooth random displacement field of `displacement` pixels RMS."""
  s, rank = _scale(x), x.ndim - 1
  field = jax.random.normal(key, (*x.shape[:-1], rank), x.dtype)
  field = _gaussian_filter(field, jnp.asarray(_ELASTIC_SMOOTHING * s), _ELASTIC_SMOOTHING * s)
  field = field / jnp.sqrt(_spatial_mean(field**2) + 1e-12)
  return _sample(x, _grid(x) + displacement * s * jnp.moveaxis(field, -1, 0))


# name -> family. The ORDER gives corruption ids; keys use the name, not the id.
CORRUPTION_TABLE: dict[str, Family] = {
    'gaussian_noise': Family(gaussian_noise, (0.04, 0.06, 0.08, 0.09, 0.10), 0.0),
    'shot_noise': Family(shot_noise, (1 / 500, 1 / 250, 1 / 100, 1 / 75, 1 / 50), 0.0),
    'impulse_noise': Family(impulse_noise, (0.01, 0.02, 0.03, 0.05, 0.07), 0.0),
    'speckle_noise': Family(speckle_noise, (0.06, 0.10, 0.12, 0.16, 0.20), 0.0),
    'gaussian_blur': Family(gaussian_blur, (0.4, 0.6, 0.7, 0.8, 1.0), 0.0),
    'defocus_blur': Family(defocus_blur, (0.25, 0.5, 0.75, 1.0, 1.5), 0.0),
    'motion_blur': Family(motion_blur, (2.0, 3.0, 4.0, 6.0, 8.0), 0.0, spatial_rank=(2,)),
    'zoom_blur': Family(zoom_blur, (0.06, 0.11, 0.16, 0.21, 0.26), 0.0),
    'contrast': Family(contrast, (0.75, 0.5, 0.4, 0.3, 0.15), 1.0),
    'brightness': Family(brightness, (0.05, 0.1, 0.15, 0.2, 0.3), 0.0),
    'saturate': Family(saturate, (1.5, 2.0, 2.5, 3.5, 5.0), 1.0, channels=3),
    'pixelate': Family(pixelate, (0.95, 0.9, 0.85, 0.75, 0.65), 1.0),
    'elastic_transform': Family(elastic_transform, (0.5, 1.0, 1.5, 2.0, 2.5), 0.0),
}
CORRUPTIONS: tuple[str, ...] = tuple(CORRUPTION_TABLE)
# The largest level of a spatial family fixes its filter's static radius.
_FAMILY_MAX = {name: max(f.levels) for name, f in CORRUPTION_TABLE.items()}
