"""Per-member orders as integer arithmetic: the same indices from numpy on the host and
from jax.numpy on the devices.

'shuffled' and 'bootstrap' give every member its own order each epoch. Drawing those with
numpy's generators, one seeded generator per member and epoch, costs the host ~0.1-0.2 ms a
member an epoch, which bound whole runs on a GPU whose step is faster (BENCHMARKS.md, "On a
GPU"). Here an order is a sort of counter-based hashes instead:

  key(seed, stream, member, epoch)  a 32-bit key absorbing each word in turn,
  hash(key, j)                      32 bits for position j of the split,
  'shuffled'  member i's epoch-e permutation of n: the j in [0, n) sorted by
              hash(key(seed, SHUFFLED, i, e), j), ties (equal hashes) by j;
  'bootstrap' member i's bag, drawn once: bag[j] = hash(key(seed, DRAW, i, 0), j) mod n,
              visited in epoch e in the permutation above with stream ORDER.

Every step is uint32 arithmetic (wrapping multiplies, shifts, xors) and a sort with a total
order, so numpy and XLA on any backend give the same indices bit for bit: the host pipeline
computes them in numpy (`host_block`), resident data on its devices once an epoch
(`device_block`, data/resident.py), and the batches are the same. A member's row depends on
(seed, member, epoch) and n alone, never on which block of members is asked for.

The mixing function is lowbias32 (C. Wellons' hash-prospector: two multiply-xorshift
rounds, a bijection of uint32 with low avalanche bias); a permutation is the argsort of n
such hashes, the standard way to shuffle with a counter-based generator.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SHUFFLED, BOOTSTRAP_DRAW, BOOTSTRAP_ORDER = 1, 2, 3
_MUL1, _MUL2, _WEYL = 0x7FEB352D, 0x846CA68B, 0x9E3779B9
_LOW32 = 0xFFFFFFFF


def _mix(h: Any, xp: Any) -> Any:
  """lowbias32 on a uint32 array."""
  h = h ^ (h >> 16)
  h = h * xp.uint32(_MUL1)
  h = h ^ (h >> 15)
  h = h * xp.uint32(_MUL2)
  return h ^ (h >> 16)


def _absorb(h: Any, word: Any, xp: Any) -> Any:
  """The key after taking in one uint32 word (array or scalar array)."""
  return _mix(h ^ _mix(word + xp.uint32(_WEYL), xp), xp)


def _keys(seed: int, stream: int, members: Any, epoch: Any, xp: Any) -> Any:
  """[M] uint32 keys of (seed, stream, member, epoch); `members` [M] and `epoch` uint32."""
  h = xp.zeros((1,), xp.uint32)
  for word in (seed & _LOW32, (seed >> 32) & _LOW32, stream):
    h = _absorb(h, xp.full((1,), word, xp.uint32), xp)
  return _absorb(_absorb(h, members, xp), epoch, xp)


def _hashes(keys: Any, n: int, xp: Any) -> Any:
  """[M, n] uint32: hash(key, j) for each member's key and each position j < n."""
  positions = _mix(xp.arange(n, dtype=xp.uint32) + xp.uint32(_WEYL), xp)
  return _mix(keys[:, None] ^ positions[None, :], xp)


def _orders(kind: str, seed: int, members: Any, epoch: Any, n: int, xp: Any,
            argsort: Callable[[Any], Any]) -> Any:
  """[M, n]: each member's epoch order (see the module docstring)."""
  stream = SHUFFLED if kind == 'shuffled' else BOOTSTRAP_ORDER
  order = argsort(_hashes(_keys(seed, stream, members, epoch, xp), n, xp))
  if kind == 'shuffled':
    return order
  draw_keys = _keys(seed, BOOTSTRAP_DRAW, members, xp.zeros_like(epoch), xp)
  bags = (_hashes(draw_keys, n, xp) % xp.uint32(n)).astype(order.dtype)
  return xp.take_along_axis(bags, order, axis=1)


def _host_argsort(h: np.ndarray) -> np.ndarray:
  # Hash and position in one uint64 key: the keys are unique, so any sort gives the total
  # order. In place: the host's cost is this sort and the hashing, nothing else.
  keyed = h.astype(np.uint64)
  keyed <<= np.uint64(32)
  keyed |= np.arange(h.shape[-1], dtype=np.uint64)
  keyed.sort(axis=-1)
  keyed &= np.uint64(_LOW32)
  return keyed.view(np.int64)


def host_block(kind: str, seed: int, members: np.ndarray, epoch: int, n: int) -> np.ndarray:
  """[len(members), n] indices (int64): each member's order in `epoch` (numpy, the host)."""
  members = np.asarray(members, np.uint32)
  return _orders(kind, seed, members, np.full((1,), epoch, np.uint32), n, np, _host_argsort)


def device_block(kind: str, seed: int, members: Any, epoch: Any, n: int) -> Any:
  """The same as host_block, traced by JAX: `members` [M] and `epoch` scalar integer arrays;
  int32 [M, n]. Call it inside jit (the sort is XLA's, keyed by (hash, position))."""
  def argsort(h):
    positions = jax.lax.broadcasted_iota(jnp.int32, h.shape, h.ndim - 1)
    return jax.lax.sort((h, positions), dimension=h.ndim - 1, num_keys=2)[1]

  members = jnp.asarray(members).astype(jnp.uint32)
  epoch = jnp.reshape(jnp.asarray(epoch).astype(jnp.uint32), (1,))
  return _orders(kind, seed, members, epoch, n, jnp, argsort)
