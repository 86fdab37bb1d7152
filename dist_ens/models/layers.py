"""Layers the built-in models share, as pure functions over explicit parameters.

Convolutions (lax.conv or patches + one matmul), He-normal kernel init, dense,
BatchNorm (params and running statistics kept apart, for the (params, state)
contract of dist_ens.core.model), dropout and pooling. All take inputs
[B, *spatial, channels] with one or two spatial axes.

`conv_for(conv_impl)` picks how each convolution is computed (config.model.conv_impl);
all give the same result (to float32 rounding) from the same parameters, so
checkpoints are shared:
  'xla'      lax.conv_general_dilated. Under dist_ens's vmap over members the
             kernels are batched, which turns every convolution into a grouped one
             (feature_group_count=M), a slow kernel on CPUs and GPUs alike
             (BENCHMARKS.md, "Convolutions as patches").
  'patches'  im2col by strided slicing: the k^rank shifted, strided views of the
             padded input concatenated along channels, times the kernel reshaped to
             [k^rank * in_ch, out_ch]: one dot, which vmap turns into a batched
             dot (and, for the first layer's shared batch, one wide dot).
  'auto'     dist_ens's choice: 'patches' (faster on every backend measured, same
             section; 'xla' stays for layers too big for k^rank x activations).

A kernel may also be a `Factored` value, W read by each example as W o (s r^T) without
forming it (rank-1 BNNs, ensembles/rank1.py): conv() and `x @ kernel` (dense(), and the
models that write their dense layers as a matmul) then compute ((x o s) W) o r. A plain
array kernel takes the same code as without it.
"""

import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dist_ens.errors import ConfigError

# Spatial rank -> (input, kernel, output) layouts for lax.conv_general_dilated.
DIMENSION_NUMBERS = {1: ('NWC', 'WIO', 'NWC'), 2: ('NHWC', 'HWIO', 'NHWC')}
CONV_IMPLS = ('auto', 'xla', 'patches')


def _conv_xla(x, w, stride, padding='SAME'):
  rank = w.ndim - 2
  return jax.lax.conv_general_dilated(
      x, w, window_strides=(stride,) * rank, padding=padding,
      dimension_numbers=DIMENSION_NUMBERS[rank])


def _conv_patches(x, w, stride, padding='SAME'):
  """_conv_xla as slices + one dot: x [B, *spatial, in_ch], w [*k, in_ch, out_ch]."""
  rank = w.ndim - 2
  ksize, (in_ch, out_ch) = w.shape[:rank], w.shape[rank:]
  strides = (stride,) * rank
  # Padded exactly as lax pads for this stride ('SAME': the output has ceil(n / stride)).
  pads = jax.lax.padtype_to_pads(x.shape[1:1 + rank], ksize, strides, padding)
  x = jnp.pad(x, [(0, 0), *pads, (0, 0)])
  out = [(n - k) // stride + 1 for n, k in zip(x.shape[1:1 + rank], ksize)]
  patches = []
  # Offsets in row-major order, the order of w's [*k, in_ch] -> [k^rank * in_ch] reshape.
  for offset in itertools.product(*(range(k) for k in ksize)):
    limit = [x.shape[0]] + [o + (n - 1) * stride + 1 for o, n in zip(offset, out)] + [in_ch]
    patches.append(jax.lax.slice(x, (0, *offset, 0), limit, (1, *strides, 1)))
  return jnp.concatenate(patches, axis=-1) @ w.reshape(-1, out_ch)


def _per_example(x: jax.Array, v: jax.Array) -> jax.Array:
  """x [N, ..., C] times v [N, C] over its last axis, each example its own row of v."""
  return x * v.reshape(v.shape[0], *(1,) * (x.ndim - 2), v.shape[-1]).astype(x.dtype)


class Factored(NamedTuple):
  """A kernel W [..., in, out] that example n reads as W o (s[n] r[n]^T): a layer computes
  ((x o s) W) o r, the same numbers without an [N, ..., in, out] kernel per example."""
  w: jax.Array
  s: jax.Array  # [N, in]
  r: jax.Array  # [N, out]

  # numpy's `x @ kernel` would read the tuple as an array; this leaves it to __rmatmul__.
  __array_ufunc__ = None

  def through(self, linear: Callable[[jax.Array, jax.Array], jax.Array],
              x: jax.Array) -> jax.Array:
    """linear(x o s, W) o r, for linear(x, w) a dense or conv layer's kernel product."""
    return _per_example(linear(_per_example(x, self.s), self.w), self.r)

  def __rmatmul__(self, x: jax.Array) -> jax.Array:  # x @ kernel, as dense layers write it
    return self.through(jnp.matmul, x)


def _reading_factored(impl: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """The conv `impl`, also taking a Factored kernel."""
  def conv(x, w, stride, padding='SAME'):
    if isinstance(w, Factored):
      return w.through(lambda h, kernel: impl(h, kernel, stride, padding), x)
    return impl(x, w, stride, padding)
  return conv


_CONVS = {name: _reading_factored(impl)
          for name, impl in (('xla', _conv_xla), ('patches', _conv_patches))}


def conv_for(conv_impl: str) -> Callable[..., jax.Array]:
  """conv(x, w, stride, padding='SAME'), as conv_impl (config.model.conv_impl) names
  (see above).

  padding is 'SAME' or 'VALID'; w a kernel array or a Factored one.
  """
  if conv_impl not in CONV_IMPLS:
    raise ConfigError(f'config.model.conv_impl={conv_impl!r} is not known; use one of '
                      f'{list(CONV_IMPLS)}.')
  return _CONVS['patches' if conv_impl == 'auto' else conv_impl]


def spatial_rank(sample_x: jax.Array, name: str) -> int:
  """1 for [B, L, C] inputs, 2 for [B, H, W, C]; a ConfigError otherwise."""
  rank = sample_x.ndim - 2
  if rank not in DIMENSION_NUMBERS:
    raise ConfigError(f'{name} takes inputs [batch, length, channels] or [batch, height, '
                      f'width, channels]; got a sample of shape {tuple(sample_x.shape)}.')
  return rank


def dropout_rate_for(rate: float) -> float:
  """config.model.dropout, checked to lie in [0, 1)."""
  if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0.0 <= rate < 1.0:
    raise ConfigError(f'config.model.dropout={rate!r} must be a number in [0, 1), '
                      'e.g. 0.0 (off) or 0.3.')
  return float(rate)


def check_dropout_rng(rate: float, train: bool, rng: jax.Array | None) -> None:
  """A clear error, before tracing the layers, when training with dropout lacks a key."""
  if train and rate > 0.0 and rng is None:
    raise ValueError(f'config.model.dropout={rate} needs a PRNG key in training: call '
                     'apply(params, state, x, train=True, rng=key).')


def kernel(*shape: int) -> jax.ShapeDtypeStruct:
  """A placeholder for a He-normal kernel of `shape`, filled by he_normal_init.

  Conv kernels are [*k, in_ch, out_ch], dense ones [fan_in, fan_out]: fan_in is
  the product of all but the last axis. The kernel only: a conv that feeds a
  BatchNorm must have no bias (BatchNorm removes it, so its true gradient is zero
  and Adam would turn rounding noise into updates); other layers add their own.
  """
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def conv_kernel(ksize: int, rank: int, in_ch: int, out_ch: int) -> jax.ShapeDtypeStruct:
  """kernel() of a conv: [*(ksize,) * rank, in_ch, out_ch]."""
  return kernel(*(ksize,) * rank, in_ch, out_ch)


def dense_params(fan_in: int, fan_out: int) -> dict[str, jax.Array | jax.ShapeDtypeStruct]:
  """A dense layer's {'w': kernel(fan_in, fan_out), 'b': zeros}."""
  return {'w': kernel(fan_in, fan_out), 'b': jnp.zeros((fan_out,), jnp.float32)}


def he_normal_init(rng: jax.Array, tree: Any) -> Any:
  """`tree` with every kernel() placeholder drawn He-normal: std sqrt(2 / fan_in).

  All kernels come from ONE normal draw, cut into pieces: XLA compiles every
  random.normal of a new shape on its own, which made a ResNet's init many times slower
  to compile on a CPU (benchmarks/HISTORY.md, "Figures that lived in code comments").
  """
  leaves, treedef = jax.tree.flatten(tree)
  shapes = [leaf.shape for leaf in leaves if isinstance(leaf, jax.ShapeDtypeStruct)]
  sizes = [math.prod(shape) for shape in shapes]
  z = jax.random.normal(rng, (sum(sizes),), jnp.float32)
  # The draw in one buffer, its pieces sliced from it: without the barrier XLA fuses the
  # draw's arithmetic into every kernel's slice, a copy per kernel (74 for a ViT-S), and
  # XLA:GPU compiled that for minutes (BENCHMARKS.md, "MFU of real-sized members").
  # XLA:GPU keeps the barrier through fusion; XLA:CPU drops it first (the same program).
  z = jax.lax.optimization_barrier(z)
  kernels, start = [], 0
  for shape, size in zip(shapes, sizes):
    fan_in = math.prod(shape[:-1])
    kernels.append(math.sqrt(2.0 / fan_in) * z[start:start + size].reshape(shape))
    start += size
  kernels = iter(kernels)
  return treedef.unflatten([next(kernels) if isinstance(leaf, jax.ShapeDtypeStruct) else leaf
                            for leaf in leaves])


def dense(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """x [..., fan_in] @ w + b (w an array or a Factored kernel)."""
  return x @ params['w'] + params['b']


def batch_norm_init(channels: int) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """(params, state) of a BatchNorm: scale 1 and bias 0; running mean 0 and var 1."""
  params = {'scale': jnp.ones((channels,), jnp.float32),
            'bias': jnp.zeros((channels,), jnp.float32)}
  state = {'mean': jnp.zeros((channels,), jnp.float32),
           'var': jnp.ones((channels,), jnp.float32)}
  return params, state


def batch_norm(params: dict[str, jax.Array], state: dict[str, jax.Array], x: jax.Array, *,
               train: bool, momentum: float = 0.9,
               eps: float = 1e-5) -> tuple[jax.Array, dict[str, jax.Array]]:
  """BatchNorm over all axes but the last (channels), as flax.linen.BatchNorm.

  Args:
    params: {'scale', 'bias'} [channels].
    state: running {'mean', 'var'} [channels].
    x: [B, *spatial, channels].
    train: normalise by this batch's mean and (biased) variance and return the
      running statistics moved toward them (ra = momentum * ra + (1 - momentum) *
      batch); else normalise by the running statistics and return `state` itself.
    momentum: weight of the old running statistics.
    eps: added to the variance.

  Returns:
    (y, new_state), y of x's shape and dtype.
  """
  if train:
    axes = tuple(range(x.ndim - 1))
    # Statistics in float32 even for low-precision activations.
    x32 = x.astype(jnp.float32)
    mean = x32.mean(axes)
    var = jnp.square(x32 - mean).mean(axes)
    # The running statistics are bookkeeping, not part of the loss's graph.
    seen = jax.lax.stop_gradient((mean, var))
    new_state = {'mean': momentum * state['mean'] + (1 - momentum) * seen[0],
                 'var': momentum * state['var'] + (1 - momentum) * seen[1]}
  else:
    mean, var, new_state = state['mean'], state['var'], state
  y = (x - mean) * (jax.lax.rsqrt(var + eps) * params['scale']) + params['bias']
  return y.astype(x.dtype), new_state


def dropout(rng: jax.Array | None, x: jax.Array, rate: float, *, train: bool) -> jax.Array:
  """Zeroes each entry with probability `rate` and scales the rest by 1 / (1 - rate).

  Samples in training (which needs rng) and, as the model contract's MC dropout, in
  evaluation when given an rng (dist_ens.core.model); the identity in evaluation
  without one, or when rate == 0.
  """
  if rate == 0.0 or (not train and rng is None):
    return x
  if rng is None:
    raise ValueError(f'dropout with rate {rate} needs a PRNG key in training: call '
                     'apply(..., train=True, rng=key).')
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def global_avg_pool(x: jax.Array) -> jax.Array:
  """[B, *spatial, C] -> [B, C]: the mean over the spatial axes."""
  return x.mean(axis=tuple(range(1, x.ndim - 1)))


def max_pool(x: jax.Array, window: int = 2) -> jax.Array:
  """Non-overlapping max pool (stride = window, 'VALID') over every spatial axis.

  A reshape and a max rather than lax.reduce_window: plain ops that vmap and
  differentiate without select-and-scatter.
  """
  spatial = x.shape[1:-1]
  # Drop the trailing rows a full window does not cover ('VALID').
  x = x[(slice(None), *(slice(0, n // window * window) for n in spatial))]
  split = [d for n in spatial for d in (n // window, window)]
  x = x.reshape(x.shape[0], *split, x.shape[-1])
  return x.max(axis=tuple(range(2, 2 * len(spatial) + 1, 2)))
