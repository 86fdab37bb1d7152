"""Batches: a deterministic, resumable order and host-local slices of global arrays.

The order of epoch e is a permutation drawn from (seed, e) alone, so it does not
depend on the number of members, the mesh or the process count; the position
(epoch, index) is all the state there is, and restoring it replays the same batches.
"""

from collections.abc import Iterator
from typing import NamedTuple

import jax
import numpy as np

from dist_ens.data.sources import Split


class IteratorState(NamedTuple):
  epoch: int = 0
  index: int = 0  # Batches already taken from this epoch.


class BatchIterator(Iterator[tuple[np.ndarray, np.ndarray]]):
  """Yields global batches (x, y) of `batch_size`, shuffled per epoch, the remainder dropped."""

  def __init__(self, split: Split, batch_size: int, seed: int,
               state: IteratorState = IteratorState()):
    if batch_size > len(split.y):
      raise ValueError(f'batch_size={batch_size} exceeds the {len(split.y)} training examples.')
    self._split, self._batch_size, self._seed = split, batch_size, seed
    self.batches_per_epoch = len(split.y) // batch_size
    self.state = state
    self._order = self._permutation(state.epoch)

  def _permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self._seed, epoch]).permutation(len(self._split.y))

  def __next__(self) -> tuple[np.ndarray, np.ndarray]:
    epoch, index = self.state
    if index == self.batches_per_epoch:
      epoch, index = epoch + 1, 0
      self._order = self._permutation(epoch)
    rows = self._order[index * self._batch_size:(index + 1) * self._batch_size]
    self.state = IteratorState(epoch, index + 1)
    return self._split.x[rows], self._split.y[rows]


def host_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> slice:
  """The rows (leading axis) of a global array that this process's devices hold."""
  ranges = sorted({(index[0].start or 0, global_shape[0] if index[0].stop is None else index[0].stop)
                   for index in sharding.addressable_devices_indices_map(global_shape).values()})
  for (_, stop), (start, _) in zip(ranges, ranges[1:]):
    if start != stop:
      raise ValueError(f'This process holds rows {ranges} of the batch, which are not one '
                       'contiguous block; lay the mesh out so each host holds one block.')
  return slice(ranges[0][0], ranges[-1][1])


def to_global(batch: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A global array from a batch every host can compute, passing only this host's rows."""
  local = batch[host_rows(sharding, batch.shape)]
  return jax.make_array_from_process_local_data(sharding, local, batch.shape)
