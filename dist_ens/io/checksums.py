"""The checkpoint checksums: one uint32 per leaf of the state, saved beside a checkpoint and
compared on restore (dist_ens/io/checkpoint.py), since a checkpoint's data files carry none
and orbax reads corrupted bytes back as values without an error.

Each word of a leaf's bits times an odd, position-dependent factor, summed mod 2**32:
computed by numpy for a leaf this process holds whole on CPU devices, else by a small
jitted program, to the same value either way (`_on_host` says which and why).
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dist_ens.parallel import once


def _words(leaf: jax.Array) -> jax.Array:
  """The leaf's bits as a flat vector of uint32 words."""
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    leaf = jax.random.key_data(leaf)
  size = leaf.dtype.itemsize
  if leaf.dtype == jnp.bool_ or size == 1:
    return leaf.astype(jnp.uint32).ravel()
  if size == 2:
    return jax.lax.bitcast_convert_type(leaf, jnp.uint16).astype(jnp.uint32).ravel()
  return jax.lax.bitcast_convert_type(leaf, jnp.uint32).ravel()  # 8 bytes: [..., 2] words.


# The checksum's factors: word i of a leaf is multiplied by (i * _FACTOR) | 1, mod 2**32.
_FACTOR = 2654435761
# Words a host checksum widens and multiplies at a time: 4 MiB of uint32 temporaries,
# whatever the leaf's size.
_HOST_CHUNK_WORDS = 1 << 20


def _checksum(leaf: jax.Array) -> jax.Array:
  # Each word times an odd, position-dependent factor (invertible mod 2**32), summed with
  # wrap-around: any changed word changes the sum, and so does a moved one.
  words = _words(leaf)
  factors = jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(_FACTOR) | jnp.uint32(1)
  return jnp.sum(words * factors, dtype=jnp.uint32)


def _host_words(leaf: jax.Array) -> np.ndarray:
  """_words on the host: the leaf's elements as a flat vector whose items widen to the
  same uint32 words (1- and 2-byte elements as they are, wider ones viewed as words)."""
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    leaf = jax.random.key_data(leaf)  # The same array, no program.
  values = np.asarray(leaf).reshape(-1)
  if values.dtype == np.bool_ or values.dtype.itemsize == 1:
    return values  # astype(uint32) per chunk: numpy's casts are XLA's (int8 sign-extends).
  if values.dtype.itemsize == 2:
    return values.view(np.uint16)
  return values.view(np.uint32)  # 8 bytes: each element's two words, low address first.


def _host_checksum(leaf: jax.Array) -> int:
  """_checksum's value, computed by numpy: uint32 arithmetic wraps mod 2**32 as XLA's
  does and the sum's order does not change it, so the two agree bit for bit."""
  words = _host_words(leaf)
  total = 0
  for start in range(0, words.size, _HOST_CHUNK_WORDS):
    chunk = words[start:start + _HOST_CHUNK_WORDS].astype(np.uint32)  # A copy: ours.
    factors = np.arange(start, start + chunk.size, dtype=np.uint32)
    factors *= np.uint32(_FACTOR)
    factors |= np.uint32(1)
    chunk *= factors
    total += int(chunk.sum(dtype=np.uint32))
  return total % 2**32


def _on_host(leaf: Any) -> bool:
  """Whether `leaf`'s checksum is computed by numpy rather than by a device program.

  On a CPU, when this process holds the whole leaf (always, in a one-process run): there
  the device program reads the same memory numpy does, at about numpy's speed (a 64 MB
  float32 leaf: 0.040 s, numpy 0.036; split 4 x 2 over devices: 0.043, numpy 0.031;
  benchmarks/checksums.py), and each new shape, dtype and sharding costs a compile that
  numpy does not (its first call 0.17-0.21 s for that leaf; 7 compiles, 0.5 s, for the
  tests' 4-member MLP), in every process that saves or restores. Not on an accelerator:
  there the program reads the leaf where it lies at the device's bandwidth and sends back
  4 bytes, where numpy would wait for a
  copy of the whole state to the host (on restore, a copy made for nothing else), then
  sum it at a CPU core's speed. Not a leaf held in part by other processes: only a
  program over all of them can sum it. Not a 1-byte float (float8): its widening to a
  word converts the value, and numpy's conversion is not known to be XLA's. Nor what is
  not a jax.Array (a Python number is an int32 or float32 to jit, an int64 to numpy).
  """
  return (isinstance(leaf, jax.Array) and leaf.is_fully_addressable
          and next(iter(leaf.devices())).platform == 'cpu'
          and not (leaf.dtype.itemsize == 1 and jnp.issubdtype(leaf.dtype, jnp.floating)))


def checksums(tree: Any) -> list[int]:
  """One uint32 per leaf of `tree` (device arrays, any sharding): saved beside a
  checkpoint and compared on restore, since a checkpoint's data files carry no
  checksum and orbax reads corrupted bytes back as values without an error. The same
  values whether numpy or a device program computes them (_on_host says which), so a
  checkpoint restores wherever it was written."""
  leaves = jax.tree.leaves(tree)
  sums = []
  for leaf in leaves:
    if _on_host(leaf):
      sums.append(_host_checksum(leaf))
      continue
    program = _checksum_program(_hashable(once.options_for(once.platform_of(leaf))))
    # Each sum is read before the next program starts: a sharded leaf's sum is a
    # collective, and XLA:CPU's collectives deadlock when many programs over different
    # device groups are queued at once (a resumed 2 x 2 x 2 model-axis run hung in the
    # test suite).
    sums.append(int(program(leaf)))
  return sums


def _hashable(options: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
  return None if options is None else tuple(sorted(options.items()))


@functools.cache
def _checksum_program(options: tuple[tuple[str, Any], ...] | None) -> Any:
  # One small program per leaf's shape, dtype and sharding, not one per tree: every run
  # in a process with a leaf like it (and, through the persistent compilation cache, in
  # other processes) reuses it, where a whole-tree program is new for every model.
  # Integer arithmetic: -O1 gives the same sums, compiled faster (parallel/once.py).
  return jax.jit(_checksum, compiler_options=None if options is None else dict(options))
