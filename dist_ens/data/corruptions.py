"""Corruptions of the -C benchmarks (CIFAR-10-C style), computed on device from any test set.

A corruption is `fn(key, x, level) -> x'` for ONE example x in [0, 1] units
([H, W, C] images or [L, C] signals) and a scalar parameter `level`; CORRUPTION_TABLE
gives each family its 5 severity levels and the level at which it is the identity
(severity 0). `corrupt_batch` applies one (corruption, severity) to a batch. Both are
DATA (traced int arrays, dispatched with lax.switch), so one jitted function serves
every corruption x severity: a shift evaluation adds one compiled program, not 65.

Keys. Example i's key is fold_in(... fold_in(key(seed), stream), tag(corruption),
severity), index_i) (`corruption_keys`): it depends on (seed, corruption, severity,
example index) only, never on the batch, its sharding or the members, so every
member and every mesh sees the same corrupted examples. The corruption enters by a
tag derived from its NAME, so adding a family does not change the others' draws.
All arithmetic is per example and elementwise (blurs are explicit sums of shifted
copies, not convolutions or matmuls whose summation order XLA may pick by batch
shape), so the bits do not depend on the batch layout either.

Value range. Families are defined on [0, 1] like the -C benchmarks: `corrupt_batch`
maps x from `value_range` (lo, hi) to [0, 1], corrupts, clips to [0, 1] (as the
benchmarks' uint8 images are) and maps back. Pass the range of the RAW data (before
standardisation), e.g. (0, 1) for images, the training inputs' min and max for
MNIST-1D.

Parameters are CIFAR-10-C's where the family is the same; spatial ones (blur sigma,
disk radius, motion length, elastic displacement) are in pixels of a 32-pixel input
and scale with the example's smaller spatial side / 32 when that is larger than 1
(smaller inputs keep CIFAR's pixel values, else low severities would do nothing).
Differences from the benchmark, so that each family has ONE parameter monotone in
severity:
  defocus_blur   a disk with a one-pixel linear edge (no separate alias blur).
  motion_blur    a centred line of `level` pixels at an angle uniform in [-45, 45]
                 degrees per example (Wand's one-sided kernel is not reproduced).
  saturate       saturation (HSV S) multiplied by the level; -C's severities 1-2
                 desaturate and 3-5 saturate, here every severity saturates.
  pixelate       box resize of each axis to `level` of its length and back, at a
                 fractional size (-C rounds the size to whole pixels, so on small
                 inputs neighbouring severities can coincide). Below about 28
                 pixels the damage of neighbouring severities can still cross
                 over (block edges fall differently), though `level` is monotone.
  elastic        a smooth random displacement field of `level` pixels RMS (no affine
                 part); on 1-D signals it is a time warp.
Not here: JPEG (a faithful one needs YCbCr, chroma subsampling, 8x8 DCT blocks,
quantisation tables scaled by quality and rounding: a page of code whose fidelity to
libjpeg we could not test without an encoder, so not "short"); glass blur (a
sequential pixel-swap loop); fog, frost, snow, spatter (frost needs image files; the
others are long procedural generators).

Shapes. motion_blur needs two spatial axes (a direction) and saturate three
channels (colour); `resolve(..., example_shape)` and `corrupt_batch` with a concrete
id refuse them with an error naming them. Every other family has a 1-D form (noise
per value, blurs and pixelate along the axis, contrast, brightness, elastic as a
time warp). Under jit with a traced id, an inapplicable family returns NaN.

Example:
  >>> pairs = resolve(['gaussian_noise:3', 'contrast'])      # 1 + 5 (name, severity)
  >>> step = jax.jit(corrupt_batch)                            # compiled once
  >>> for name, severity in pairs:
  ...   x_c = step(x, index, corruption_id(name), severity, 0)
"""

import zlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dist_ens.data.corruption_families import CORRUPTION_TABLE, CORRUPTIONS
from dist_ens.errors import ConfigError

NUM_SEVERITIES = 5
# Folded into the seed first, so corruption keys never coincide with keys other parts
# of dist_ens derive from the same seed (ASCII 'cor').
_CORRUPT_STREAM = 0x636F72

# [corruption, severity 0..5] -> level: indexed by the traced ids inside corrupt_batch.
_LEVELS = np.array([(f.identity, *f.levels) for f in CORRUPTION_TABLE.values()], np.float32)
# A stable 31-bit tag per NAME, folded into the keys instead of the table position.
_TAGS = np.array([zlib.crc32(n.encode()) & 0x7FFFFFFF for n in CORRUPTIONS], np.uint32)


def refusal(name: str, example_shape: Sequence[int]) -> str | None:
  """Why corruption `name` does not apply to examples of `example_shape`, or None if it does.

  Args:
    name: a key of CORRUPTION_TABLE.
    example_shape: one example's shape: [H, W, C], [L, C] or [L].
  """
  family = CORRUPTION_TABLE[name]
  shape = _channels_last(example_shape)
  if len(shape) - 1 not in family.spatial_rank:
    return (f'{name} needs {family.spatial_rank[0]}-D spatial inputs ([H, W, C]); '
            f'got {tuple(example_shape)}')
  if family.channels is not None and shape[-1] != family.channels:
    return f'{name} needs {family.channels} channels (colour); got {tuple(example_shape)}'
  return None


def _channels_last(example_shape: Sequence[int]) -> tuple[int, ...]:
  """[L] -> [L, 1]; [L, C] and [H, W, C] unchanged; anything else refused."""
  shape = tuple(int(n) for n in example_shape)
  if len(shape) == 1:
    return shape + (1,)
  if len(shape) not in (2, 3):
    raise ConfigError(f'corruptions take examples [H, W, C], [L, C] or [L]; got {shape}.')
  return shape


def corruption_id(name: str) -> int:
  """The id of corruption `name` for corrupt_batch (its position in CORRUPTIONS)."""
  if name not in CORRUPTION_TABLE:
    raise ConfigError(f'unknown corruption {name!r}; valid names: {", ".join(CORRUPTIONS)}.')
  return CORRUPTIONS.index(name)


def _parse(item: str) -> list[tuple[str, int]]:
  """'name' -> its 5 severities; 'name:k' -> [(name, k)]; 'name:j-k' -> severities j..k."""
  name, _, severity = item.partition(':')
  corruption_id(name)  # raises for an unknown name
  if not severity:
    return [(name, s) for s in range(1, NUM_SEVERITIES + 1)]
  first, _, last = severity.partition('-')
  last = last or first
  if not (first.isdigit() and last.isdigit()
          and 0 <= int(first) <= int(last) <= NUM_SEVERITIES):
    raise ConfigError(f'corruption {item!r}: severity must be an integer 0..{NUM_SEVERITIES} '
                      f"or a range such as '{name}:1-{NUM_SEVERITIES}'.")
  return [(name, s) for s in range(int(first), int(last) + 1)]


def resolve(spec: str | Sequence[str], example_shape: Sequence[int] | None = None
            ) -> list[tuple[str, int]]:
  """The (name, severity) pairs a config names, in order, without duplicates.

  Example:
    >>> resolve(['gaussian_noise:3', 'contrast'])[:2]
    [('gaussian_noise', 3), ('contrast', 1)]

  Args:
    spec: 'all' (every family that applies, severities 1..5), or names, each
      'name' (severities 1..5), 'name:k' (severity k in 0..5) or 'name:j-k'
      (severities j..k); a single string may list them separated by commas.
    example_shape: one example's shape. If given, 'all' keeps the families that apply
      to it and a named family that does not is refused.

  Raises:
    ConfigError: an unknown name (the error lists the valid ones), a bad severity, or
      a family that does not apply to example_shape (the error names it and why).
  """
  items = spec.split(',') if isinstance(spec, str) else list(spec)
  items = [item.strip() for item in items if item.strip()]
  if items == ['all']:
    names = [n for n in CORRUPTIONS
             if example_shape is None or refusal(n, example_shape) is None]
    items = list(names)
  pairs = [pair for item in items for pair in _parse(item)]
  if example_shape is not None:
    refused = sorted({r for name, _ in pairs if (r := refusal(name, example_shape))})
    if refused:
      raise ConfigError('corruptions that do not apply: ' + '; '.join(refused) + '.')
  return list(dict.fromkeys(pairs))


def corruption_keys(seed: int | jax.Array, corruption: int | jax.Array,
                    severity: int | jax.Array, example_index: jax.Array) -> jax.Array:
  """PRNG keys of examples, one per entry of `example_index` (same shape).

  Args:
    seed: the evaluation's seed.
    corruption: the corruption id (may be traced); its NAME's tag is folded in.
    severity: the severity 0..5 (may be traced).
    example_index: the examples' indices in the test set.

  Returns:
    Typed keys fold_in(fold_in(fold_in(fold_in(key(seed), stream), tag), severity), index).
  """
  key = jax.random.fold_in(jax.random.key(seed), _CORRUPT_STREAM)
  key = jax.random.fold_in(key, jnp.asarray(_TAGS)[corruption])
  key = jax.random.fold_in(key, jnp.asarray(severity, jnp.uint32))
  index = jnp.asarray(example_index)
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(index.reshape(-1))
  return keys.reshape(index.shape)


def _branch(name: str, example_shape: tuple[int, ...]) -> Callable:
  """The switch branch of one family: vmapped over the batch, or NaN where it is refused."""
  if refusal(name, example_shape) is not None:
    return lambda keys, u, level: jnp.full_like(u, jnp.nan)
  fn = CORRUPTION_TABLE[name].fn
  return lambda keys, u, level: jax.vmap(fn, in_axes=(0, 0, None))(keys, u, level)


def corrupt_batch(x: jax.Array, example_index: jax.Array, corruption: int | jax.Array,
                  severity: int | jax.Array, seed: int | jax.Array,
                  value_range: tuple[float, float] = (0.0, 1.0),
                  families: Sequence[int] | None = None) -> jax.Array:
  """Corruption `corruption` at `severity` applied to every example of x.

  Args:
    x: [B, H, W, C], [B, L, C] or [B, L] raw inputs (before standardisation).
    example_index: [B] the examples' indices in the test set (they pick the keys).
    corruption: a corruption id (`corruption_id(name)`); an int or a traced int array.
    severity: 0 (x itself, bitwise) .. 5; an int or a traced int array. Traced ids
      and severities are not range-checked on device (lax.switch clamps the id, a
      negative severity indexes from the end), so check them with `resolve` first.
    seed: the evaluation's seed.
    value_range: (lo, hi) of the raw data, mapped to the families' [0, 1].
    families: the corruption ids a traced `corruption` can take (None: every family).
      The program holds a branch for each of these only: each branch is a large
      program of its own to compile, and a run evaluates the few eval.shift names.
      A concrete id needs only its own. Each branch gives the bits it gives among all;
      a traced id outside `families` gives NaN (not another family's output).

  Returns:
    The corrupted batch, x's shape and dtype, clipped to value_range. NaN if the
    family does not apply to x's examples and the id is traced (a concrete id raises).
  """
  shape = _channels_last(x.shape[1:])
  traced = isinstance(corruption, jax.core.Tracer)
  if not traced:
    if reason := refusal(CORRUPTIONS[int(corruption)], shape):
      raise ConfigError(f'corruption does not apply: {reason}.')
  if example_index.shape != x.shape[:1]:
    raise ValueError(f'corrupt_batch needs one index per example: index {example_index.shape}, '
                     f'batch {x.shape}.')
  lo, hi = value_range
  u = (x.reshape(x.shape[:1] + shape).astype(jnp.float32) - lo) / (hi - lo)
  level = jnp.asarray(_LEVELS)[corruption, severity]
  keys = corruption_keys(seed, corruption, severity, example_index)
  if not traced:
    families = (int(corruption),)
  ids = tuple(range(len(CORRUPTIONS))) if families is None else tuple(sorted(set(families)))
  position = np.zeros(len(CORRUPTIONS), np.int32)  # corruption id -> its branch
  position[list(ids)] = np.arange(len(ids))
  out = jax.lax.switch(jnp.asarray(position)[corruption],
                       [_branch(CORRUPTIONS[i], shape) for i in ids], keys, u, level)
  out = (lo + jnp.clip(out, 0.0, 1.0) * (hi - lo)).reshape(x.shape).astype(x.dtype)
  if traced and len(ids) < len(CORRUPTIONS):
    out = jnp.where(jnp.isin(corruption, jnp.asarray(ids)), out, jnp.nan)
  # Severity 0 is x itself, bitwise: no rescaling round trip, no clip.
  return jnp.where(severity == 0, x, out)
