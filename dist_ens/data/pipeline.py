"""Batches: a deterministic, resumable order and host-local slices of global arrays.

Which examples a step sees depends only on (seed, member order, member, epoch,
position), never on the number of members, the mesh or the process count. The
position (epoch, index) is all the state there is: restoring it replays the same
batches. Each process reads only the examples its own devices hold.

Member orders (config.data.member_order):
  'shared'     every member sees the same batch, a permutation of epoch e drawn
               from (seed, e); the batch is [B, ...], sharded over 'data'.
  'shuffled'   member i has its own permutation per epoch, from (seed, i, e).
  'bootstrap'  member i trains on its own resample with replacement of the train
               split, drawn once from (seed, i), visited in a fresh order per epoch.
The last two give [M, B, ...] batches sharded over ('member', 'data'); their indices are
integer hashes sorted (data/orders.py), which resident data derives on an accelerator.

With member pools (config.data.member_split, data/member_split.py) member i draws only
from its own pool of indices: 'shared' gives the members of one pool the same batches
(an order drawn from (seed, pool), so not from the member), 'shuffled' and 'bootstrap'
as above but over the pool; batches are then always [M, B, ...].
"""

import math
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dist_ens.data import grain_loader, orders
from dist_ens.data.sources import Source

MEMBER_ORDERS = ('shared', 'shuffled', 'bootstrap')
# The stream tag of the pools' shared orders (data/orders.py tags the per-member ones).
_POOL_SHARED = 4


class IteratorState(NamedTuple):
  epoch: int = 0
  index: int = 0  # Batches already taken from this epoch.


class Order:
  """The example indices of every batch, for one member order."""

  def __init__(self, kind: str, num_examples: int, batch_size: int, seed: int,
               pools: Sequence[np.ndarray] | None = None,
               member_pool: Sequence[int] | None = None):
    """`pools`: source index sets; member i draws from pools[member_pool[i]] (None: every
    member from all examples). An epoch is then one pass over the smallest pool."""
    if kind not in MEMBER_ORDERS:
      raise ValueError(f'config.data.member_order={kind!r}; use one of {MEMBER_ORDERS}.')
    self._pools = None if pools is None else [np.asarray(p) for p in pools]
    self._member_pool = None if pools is None else list(member_pool)
    self.examples_per_epoch = num_examples if pools is None else min(map(len, self._pools))
    if batch_size > self.examples_per_epoch:
      raise ValueError(f'batch_size={batch_size} exceeds the {self.examples_per_epoch} '
                       'training examples' + ('' if pools is None else ' of a member\'s pool') + '.')
    self.kind, self._n, self._batch_size, self._seed = kind, num_examples, batch_size, seed
    # The remainder is dropped.
    self.batches_per_epoch = self.examples_per_epoch // batch_size
    self._cache: dict[tuple[int, tuple[int, int] | None], np.ndarray] = {}

  @property
  def per_member(self) -> bool:
    return self.kind != 'shared' or self._pools is not None

  @property
  def pooled(self) -> bool:
    """Whether members draw from member pools (config.data.member_split)."""
    return self._pools is not None

  @property
  def batch_size(self) -> int:
    return self._batch_size

  @property
  def seed(self) -> int:
    return self._seed

  def _epoch_order(self, epoch: int, members: range | None) -> np.ndarray:
    """[n] for the shared order (members None), else [len(members), examples_per_epoch
    or more]: the epoch's example indices in order."""
    key = (epoch, None if members is None else (members.start, members.stop))
    if key not in self._cache:
      # Batches are read in order, so earlier epochs are not read again (a resume that
      # goes back draws them again): at most the epochs one item spans stay, M x n each.
      self._cache = {k: v for k, v in self._cache.items() if k[0] >= epoch}
      self._cache[key] = self._draw(epoch, members)
    return self._cache[key]

  def _draw(self, epoch: int, members: range | None) -> np.ndarray:
    seed = self._seed
    if members is None:  # 'shared' without pools: numpy's draw from (seed, epoch).
      return np.random.default_rng([seed, epoch]).permutation(self._n)
    if self._pools is None:
      return orders.host_block(self.kind, seed, np.arange(members.start, members.stop),
                               epoch, self._n)
    rows = []
    for member in members:
      pool_id = self._member_pool[member]
      pool = self._pools[pool_id]
      if self.kind == 'shared':  # One order per pool, whichever of its members asks.
        order = pool[np.random.default_rng([seed, _POOL_SHARED, pool_id, epoch])
                     .permutation(len(pool))]
      else:
        order = pool[orders.host_block(self.kind, seed, [member], epoch, len(pool))[0]]
      rows.append(order[:self.examples_per_epoch])
    return np.stack(rows)

  def indices(self, state: IteratorState, members: range | None = None) -> np.ndarray:
    """Indices of the batch at `state`: [B] for 'shared', else [len(members), B]."""
    rows = slice(state.index * self._batch_size, (state.index + 1) * self._batch_size)
    if not self.per_member:
      return self._epoch_order(state.epoch, None)[rows]
    return self._epoch_order(state.epoch, members)[:, rows]

  def advance(self, state: IteratorState) -> IteratorState:
    """The position after taking the batch at `state` (rolling over to the next epoch)."""
    if state.index + 1 == self.batches_per_epoch:
      return IteratorState(state.epoch + 1, 0)
    return IteratorState(state.epoch, state.index + 1)

  def normalize(self, state: IteratorState) -> IteratorState:
    # A position saved at the end of an epoch is the start of the next one.
    return IteratorState(state.epoch + 1, 0) if state.index >= self.batches_per_epoch else state

  def skip(self, state: IteratorState, batches: int) -> IteratorState:
    """The position `batches` batches after `state` (advance, that many times)."""
    index = state.index + batches
    return IteratorState(state.epoch + index // self.batches_per_epoch,
                         index % self.batches_per_epoch)

  def __getstate__(self) -> dict[str, Any]:
    # Pickled into grain's worker processes (data/grain_loader.py): the epoch orders are
    # drawn again there from the same seeds; the cache may hold M of them.
    return {**self.__dict__, '_cache': {}}


class BatchIterator(Iterator[tuple[np.ndarray, np.ndarray]]):
  """Whole shared batches (x, y) in host memory; for tests, tools and benchmarks."""

  def __init__(self, source: Source, batch_size: int, seed: int,
               state: IteratorState = IteratorState()):
    self._source = source
    self._order = Order('shared', source.num_examples, batch_size, seed)
    self.batches_per_epoch = self._order.batches_per_epoch
    self.state = self._order.normalize(state)

  def __next__(self) -> tuple[np.ndarray, np.ndarray]:
    batch = self._source.read(self._order.indices(self.state))
    self.state = self._order.advance(self.state)
    return batch


def host_block(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...], axes: int,
               devices: Sequence[jax.Device] | None = None) -> tuple[slice, ...]:
  """The block of the first `axes` axes of a global array that a process holds.

  Args:
    devices: the process's devices; default: this process's (addressable) ones.

  Raises:
    ValueError: if the process's devices hold a set of rows that is not one block.
  """
  index_map = sharding.devices_indices_map(global_shape)
  mine = set(sharding.addressable_devices if devices is None else devices)
  indices = [index for device, index in index_map.items() if device in mine]
  block = []
  for axis in range(axes):
    size = global_shape[axis]
    ranges = sorted({(index[axis].start or 0, size if index[axis].stop is None else index[axis].stop)
                     for index in indices})
    for (_, stop), (start, _) in zip(ranges, ranges[1:]):
      if start != stop:
        raise ValueError(f'This process holds {ranges} of axis {axis} of the batch, which is '
                         'not one contiguous block; lay the mesh out so each host holds one.')
    block.append(slice(ranges[0][0], ranges[-1][1]))
  return tuple(block)


def local_indices(order: Order, state: IteratorState, block: tuple[slice, ...]) -> np.ndarray:
  """The example indices of one process's block of the batch at `state`.

  [rows] for a shared order (block = (rows,)), [members, rows] for a per-member
  one (block = (members, rows)): only the process's own members are generated.
  """
  if not order.per_member:
    return order.indices(state)[block[0]]
  members = range(block[0].start, block[0].stop)
  return order.indices(state, members)[:, block[1]]


def host_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> slice:
  """The rows (leading axis) of a global array that this process's devices hold."""
  return host_block(sharding, global_shape, 1)[0]


def to_global(batch: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A global array from a batch every host can compute, passing only this host's rows."""
  local = batch[host_rows(sharding, batch.shape)]
  return jax.make_array_from_process_local_data(sharding, local, batch.shape)


class HostReader(NamedTuple):
  """One process's block of the item at a position, read into host memory.

  What the thread pipeline does in its thread, and grain's worker processes in theirs
  (data/grain_loader.py, config.data.loader='grain'): the same function of the same
  position, so both give the same arrays bit for bit. It is pickled into those workers.
  """
  source: Source
  order: Order
  block: tuple[slice, ...]  # host_block of the batch: (rows,) or (members, rows)
  steps: int = 1  # K consecutive batches per item, stacked on a leading axis when K > 1
  member_scale: Any = None  # see Batches
  with_index: bool = False

  def indices(self, state: IteratorState) -> np.ndarray:
    """The block's example indices at `state`: [(K,) (members,) rows]."""
    blocks = []
    for _ in range(self.steps):  # K consecutive batches: one read, one transfer.
      blocks.append(local_indices(self.order, state, self.block))
      state = self.order.advance(state)
    return np.stack(blocks) if self.steps > 1 else blocks[0]

  def __call__(self, state: IteratorState) -> tuple[np.ndarray, ...]:
    """(x, y) of the item at `state`, and its indices (int32, shaped like y's leading
    axes) with `with_index`."""
    local = self.indices(state)
    x, y = self.source.read(local.reshape(-1))
    x = x.reshape(*local.shape, *x.shape[1:])
    y = y.reshape(*local.shape, *y.shape[1:])  # [N, D] targets keep their D
    if self.member_scale is not None:  # [(K,) members, rows, ...]: this block's members.
      x_mean, x_std, y_mean, y_std = (a[self.block[0]][:, None] for a in self.member_scale)
      x = ((x - x_mean) / x_std).astype(np.float32)
      y = ((y - y_mean) / y_std).astype(np.float32)
    return (x, y, local.astype(np.int32)) if self.with_index else (x, y)


class PipelineStats(NamedTuple):
  examples: int  # Examples this process read.
  busy_seconds: float  # Time spent reading, preprocessing and transferring them.


class Batches:
  """Global (x, y) batch arrays for the train step, prefetched in a background thread.

  Each process reads only its block of every batch: its rows of the 'data' axis
  and, for per-member orders, its members. `state` is the position after the last
  batch handed out (what a checkpoint must save), however far prefetching has run.
  With `steps_per_call` = K > 1 each item holds K consecutive batches stacked on a
  new leading axis ([K, B, ...] or [K, M, B, ...]), for a step that runs K steps.
  With `with_index` each item is (x, y, index): index (int32, shaped like y) holds
  the examples' indices in the source, from which augmentation draws.
  With `member_scale` (a per-member order only: x_mean, x_std, y_mean, y_std each with a
  leading [M] axis) each member's rows are standardised with its own statistics as they
  are read, on the host: the step and its one compiled program do not change, and a
  member's values depend on its member index alone, not on the mesh or the process.
  A resident source (data/resident.py) gives the same items, gathered on the devices.
  With `loader='grain'` (config.data.loader; a TFDS source only) grain's `workers`
  worker processes read and decode the items (data/grain_loader.py); the items, their
  order and `state` are the same as with the default 'threads'.
  """

  def __init__(self, source: Source, order: Order, mesh: Mesh, num_members: int,
               state: IteratorState = IteratorState(), prefetch: int = 2,
               steps_per_call: int = 1, with_index: bool = False,
               member_scale: Any = None, loader: str = 'threads', workers: int = 0):
    if member_scale is not None and not order.per_member:
      raise ValueError('Batches(member_scale=...) needs a per-member order.')
    self._order = order
    self.state = order.normalize(state)
    self._steps = steps_per_call
    batch = order.batch_size
    if order.per_member:
      spec, probe = P('member', 'data'), (num_members, batch)
    else:
      spec, probe = P('data'), (batch,)
    block = host_block(NamedSharding(mesh, spec), probe, len(probe))
    if steps_per_call > 1:
      spec, probe = P(None, *spec), (steps_per_call, *probe)
    self.sharding = NamedSharding(mesh, spec)
    self._global_lead = probe
    self._reader = HostReader(source, order, block, steps_per_call, member_scale, with_index)
    # A resident split (data/resident.py: config.data.resident) gathers each batch on the
    # devices from the same indices: only they cross from the host.
    # With a per-member order the devices derive the indices too (Gather.derived).
    self._gather = (source.gatherer(mesh, self.sharding, probe, member_scale, with_index,
                                    order) if hasattr(source, 'gatherer') else None)
    self._block_size = steps_per_call * math.prod(s.stop - s.start for s in block)
    if loader not in grain_loader.LOADERS:
      raise ValueError(f'Batches(loader={loader!r}): use one of {grain_loader.LOADERS}.')
    # With grain, its worker processes read the items from self.state on, in order (a
    # resident split reads none).
    self._reads = (grain_loader.Reads(self._reader, self.state, workers)
                   if loader == 'grain' and self._gather is None else None)
    self._examples, self._busy = 0, 0.0
    self._queue: queue.Queue = queue.Queue(maxsize=max(prefetch, 1))
    self._stop = threading.Event()
    self._thread = None
    if prefetch > 0:
      self._thread = threading.Thread(target=self._produce, args=(self.state,), daemon=True)
      self._thread.start()
    else:
      self._next_state = self.state

  def _make(self, state: IteratorState) -> tuple[tuple[jax.Array, ...], IteratorState]:
    """The item at `state` (K batches stacked when K > 1) and the state after it."""
    start = time.perf_counter()
    after = self._order.skip(state, self._steps)
    if self._gather is not None:
      arrays = (self._gather.derived(state) if self._gather.derives
                else self._gather(self._reader.indices(state)))
      self._examples += self._block_size
      self._busy += time.perf_counter() - start
      return arrays, after
    batch = self._reader(state) if self._reads is None else next(self._reads)
    lead = batch[1].shape[:len(self._global_lead)]  # the block's (K,) (members,) rows
    arrays = tuple(jax.make_array_from_process_local_data(
        self.sharding, a, self._global_lead + a.shape[len(lead):]) for a in batch)
    self._examples += math.prod(lead)
    self._busy += time.perf_counter() - start
    return arrays, after

  def _produce(self, state: IteratorState) -> None:
    try:
      while not self._stop.is_set():
        item = self._make(state)
        state = item[1]
        while not self._stop.is_set():
          try:
            self._queue.put(item, timeout=0.1)
            break
          except queue.Full:
            continue
    except BaseException as e:  # pylint: disable=broad-except  # Re-raised in __next__.
      self._queue.put(e)

  def __iter__(self):
    return self

  def __next__(self) -> tuple[jax.Array, ...]:
    if self._thread is None:
      arrays, self._next_state = self._make(self._next_state)
      self.state = self._next_state
      return arrays
    item = self._queue.get()
    if isinstance(item, BaseException):
      raise item
    arrays, self.state = item
    return arrays

  @property
  def stats(self) -> PipelineStats:
    return PipelineStats(self._examples, self._busy)

  def close(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=10)
    if self._reads is not None:
      self._reads.close()
