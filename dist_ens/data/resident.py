"""Resident data: the training split on the devices once, each batch gathered there.

config.data.resident = 'auto' (the default), True or False. When the training split fits
config.data.resident_budget_mb, run_data.build_data wraps it in a ResidentSource; data.Batches
(pipeline.py) then sends each step only the int32 indices its host block of the batch holds
(Order and local_indices, exactly as the host pipeline computes them) and gathers x and y on
the devices by those indices, in one small compiled program whose outputs carry the host
pipeline's shardings. So the batches are the host pipeline's bit for bit, for every member
order, member pool, steps per call and process count (a gather copies values), the data
position (IteratorState) is the same, and augmentation, which happens in the step, is
unchanged.

Layout (first cut): the whole split is replicated on every device of the mesh, so a gather
needs no communication whatever the order (any example can land on any device, on any
member). The cost is the split's bytes on every device (and on every process, which reads
it once); sharding it over 'data' would divide that by the data axis at the price of a
collective per step, left for later.

Per-member standardisation (member_scale: config.data.member_split with a standardising
task) stays bit-identical: the host computes, in numpy as the host pipeline does per batch,
one standardised copy of the split per distinct set of statistics (one per member split,
S), element by element the same arithmetic; each member gathers from its split's copy. The
budget counts those S copies.

The source must read row by row ( read(indices)[i] depends on indices[i] alone), as every
Source here does: the split is read once, whole, and never again for training.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dist_ens.data import orders
from dist_ens.data.sources import Source
from dist_ens.errors import ConfigError

SETTINGS = ('auto', True, False)
FIELD = 'config.data.resident'
BUDGET_FIELD = 'config.data.resident_budget_mb'
_MB = 2 ** 20


def split_bytes(source: Source) -> int:
  """The bytes of one copy of the whole split as the pipeline reads it (x and y)."""
  n = source.num_examples
  if not n:
    return 0
  x, y = source.read(np.arange(1))
  return n * (np.asarray(x).nbytes + np.asarray(y).nbytes)


class ResidentSource:
  """A training split that data.Batches gathers on the devices.

  It reads like `source` (every other reader of the training split, held-out evaluation,
  distillation or noise fits, sees no difference); `copies` and `bytes_per_device` are the
  decision's figures (bytes_per_device: what each device holds).
  """

  def __init__(self, source: Source, copies: int = 1, bytes_per_device: int | None = None,
               derive_orders: bool | str = 'auto'):
    """`derive_orders`: whether the devices derive per-member orders themselves (Gather);
    'auto': on accelerators, not on CPU devices, where XLA's sort of an epoch's orders
    takes 9-25x numpy's (65 against 3.9 ms at M = 64, n = 4,000; benchmarks/order_draws.py)
    and the host sends indices as cheaply. The batches are the same either way."""
    self.source, self.copies, self.derive_orders = source, copies, derive_orders
    self.bytes_per_device = (copies * split_bytes(source) if bytes_per_device is None
                             else bytes_per_device)
    self._placed: tuple[Any, tuple[jax.Array, ...]] | None = None

  @property
  def num_examples(self) -> int:
    return self.source.num_examples

  def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return self.source.read(indices)

  def gatherer(self, mesh: Mesh, sharding: NamedSharding, global_lead: tuple[int, ...],
               member_scale: Any = None, with_index: bool = False,
               order: Any = None) -> 'Gather':
    """What data.Batches calls with each host block of indices, or with positions where
    `order` (a data.Order) is per member without pools and the devices derive orders (see
    Gather and derive_orders)."""
    copy_of, arrays = self._place(mesh, member_scale)
    copy = None
    if copy_of is not None:  # [M] int32, each member's copy, sharded like its members.
      member_sharding = NamedSharding(mesh, P(sharding.spec[-2]))
      copy = jax.make_array_from_callback(copy_of.shape, member_sharding,
                                          lambda index: copy_of[index])
    derive = (self.derive_orders if isinstance(self.derive_orders, bool)
              else mesh.devices.flat[0].platform != 'cpu')
    return Gather(mesh, sharding, global_lead, arrays, copy, with_index,
                  order if derive else None)

  def _place(self, mesh: Mesh, member_scale: Any) -> tuple[np.ndarray | None,
                                                           tuple[jax.Array, ...]]:
    """(each member's copy or None, (x, y) replicated on every device of `mesh`), made
    once per mesh and member_scale (the last one is kept: a run builds one pipeline)."""
    scale = None if member_scale is None else tuple(np.asarray(a) for a in member_scale)
    key = (mesh, None if scale is None else tuple((a.dtype.str, a.shape, a.tobytes())
                                                   for a in scale))
    if self._placed is not None and self._placed[0] == key:
      return self._placed[1]
    self._placed = None  # Free the old copy before the new one is made.
    x, y = self.source.read(np.arange(self.num_examples))
    x, y = np.asarray(x), np.asarray(y)
    copy_of = None
    if scale is not None:
      x, y, copy_of = _standardised_copies(x, y, scale)
    replicated = NamedSharding(mesh, P())
    arrays = tuple(jax.make_array_from_callback(a.shape, replicated, lambda index, a=a: a[index])
                   for a in (x, y))
    self._placed = (key, (copy_of, arrays))
    return self._placed[1]


def _standardised_copies(x: np.ndarray, y: np.ndarray, scale: tuple[np.ndarray, ...]
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
  """The split standardised once per distinct member statistics: ([C, N, ...] x and y,
  [M] each member's copy), or ([N, ...], [N, ...], None) where every member shares one.

  The arithmetic is the host pipeline's (pipeline.Batches._make), element by element:
  ((x - x_mean) / x_std).astype(float32) on the same dtypes, so each value is the same.
  """
  x_mean, x_std, y_mean, y_std = scale
  keys = [b''.join(a[m].tobytes() for a in scale) for m in range(len(x_mean))]
  first: dict[bytes, int] = {}
  for m, key in enumerate(keys):
    first.setdefault(key, m)
  copy_of = np.asarray([list(first).index(k) for k in keys], np.int32)
  xs = [((x - x_mean[m]) / x_std[m]).astype(np.float32) for m in first.values()]
  ys = [((y - y_mean[m]) / y_std[m]).astype(np.float32) for m in first.values()]
  if len(xs) == 1:
    return xs[0], ys[0], None
  return np.stack(xs), np.stack(ys), copy_of


class Gather:
  """Host blocks of indices, or positions, -> the global (x, y[, index]) arrays of the host
  pipeline.

  Called with this process's block of the batch's indices ([rows], [members, rows], or
  either with K stacked steps first), it sends them as int32 and gathers on each device
  its own rows from its resident copy: no communication. In one process the indices go
  to the compiled gather as a numpy array (the jit's own transfer, its fastest path);
  across processes as the global array of every process's block.

  With a per-member order ('shuffled' or 'bootstrap', no member pools) `derived` sends
  only positions: each device derives its members' epoch orders once an epoch
  (data/orders.py's device_block, the host's indices bit for bit) and slices each step's
  rows from them, so the host draws nothing. A call of K steps passes the orders of every
  epoch it may span ((K - 1) // batches_per_epoch + 2 of them); those and one more stay on
  the devices, int32 [members, n] each, outside config.data.resident_budget_mb (CIFAR-10:
  0.2 MB a member an epoch, beside the split's 614 MB of float32 images).
  """

  def __init__(self, mesh: Mesh, sharding: NamedSharding, global_lead: tuple[int, ...],
               arrays: tuple[jax.Array, jax.Array], copy: jax.Array | None,
               with_index: bool, order: Any = None):
    self._mesh, self._sharding, self._lead = mesh, sharding, global_lead
    self._arrays = arrays + (() if copy is None else (copy,))
    self._one_process = jax.process_count() == 1
    spec = sharding.spec
    member_axis = len(global_lead) - 2  # With copies the order is per member: [(K,) M, B].

    def take(x, y, *rest):
      index = rest[-1]
      if len(rest) == 1:
        out = x[index], y[index]
      else:
        shape = [1] * index.ndim
        shape[member_axis] = -1
        which = rest[0].reshape(shape)
        out = x[which, index], y[which, index]
      return out + ((index,) if with_index else ())

    specs = (P(), P()) + (() if copy is None else (P(spec[member_axis]),))
    outs = (spec,) * (3 if with_index else 2)
    self._take = self._jit(take, specs + (spec,), outs)
    self._order = order if order is not None and order.per_member and not order.pooled else None
    if self._order is None:
      return
    self._epochs: dict[int, jax.Array] = {}
    self._steps = global_lead[0] if len(global_lead) == 3 else 1
    kind, seed, n = self._order.kind, self._order.seed, self._order.examples_per_epoch
    per_device = global_lead[-2] // mesh.shape['member']
    rows = global_lead[-1] // mesh.shape['data']

    def epoch_orders(epoch):  # [M, n] sharded over 'member': each device its members'.
      first = jax.lax.axis_index('member') * per_device
      return orders.device_block(kind, seed, first + jnp.arange(per_device), epoch, n)

    # A call's K steps span at most this many epochs: each is passed, the last repeated.
    self._spans = (self._steps - 1) // self._order.batches_per_epoch + 2

    def take_derived(x, y, *rest):
      copies, epochs = rest[:-self._spans - 2], rest[-self._spans - 2:-2]
      which, start = rest[-2:]
      offset = jax.lax.axis_index('data') * rows

      def step_rows(epoch, row):  # [members, rows] of one step from its epoch's orders
        pick = lambda o: jax.lax.dynamic_slice_in_dim(o, row + offset, rows, axis=1)
        out = pick(epochs[0])
        for e in range(1, len(epochs)):
          out = jnp.where(epoch == e, pick(epochs[e]), out)
        return out

      index = jax.vmap(step_rows)(which, start)
      return take(x, y, *copies, index if self._steps > 1 else index[0])

    by_member = P('member', None)
    self._epoch_orders = self._jit(epoch_orders, (P(),), by_member)
    self._take_derived = self._jit(take_derived,
                                   specs + (by_member,) * self._spans + (P(), P()), outs)

  def _jit(self, f, in_specs, out_specs):
    named = lambda s: NamedSharding(self._mesh, s)
    return jax.jit(jax.shard_map(f, mesh=self._mesh, in_specs=in_specs, out_specs=out_specs),
                   in_shardings=tuple(named(s) for s in in_specs),
                   out_shardings=jax.tree.map(named, out_specs))

  def _global(self, value: np.ndarray, sharding: NamedSharding, shape) -> Any:
    """`value` (this process's block) as the jit's input: itself in one process."""
    if self._one_process:
      return value
    return jax.make_array_from_process_local_data(sharding, value, shape)

  def __call__(self, local: np.ndarray) -> tuple[jax.Array, ...]:
    index = self._global(np.asarray(local, np.int32), self._sharding, self._lead)
    return self._take(*self._arrays, index)

  @property
  def derives(self) -> bool:
    """Whether `derived` can serve this pipeline's items (a per-member order, no pools)."""
    return self._order is not None

  def derived(self, state: Any) -> tuple[jax.Array, ...]:
    """The item whose first step is at `state` (an IteratorState), from the orders derived
    on the devices."""
    positions = [state]
    for _ in range(self._steps - 1):
      positions.append(self._order.advance(positions[-1]))
    first = state.epoch
    which = np.asarray([p.epoch - first for p in positions], np.int32)
    start = np.asarray([p.index * self._order.batch_size for p in positions], np.int32)
    epochs = [self._orders_of(first + min(e, int(which[-1]))) for e in range(self._spans)]
    replicated = NamedSharding(self._mesh, P())
    return self._take_derived(*self._arrays, *epochs,
                              self._global(which, replicated, which.shape),
                              self._global(start, replicated, start.shape))

  def _orders_of(self, epoch: int) -> jax.Array:
    """The devices' [M, n] orders of `epoch`, derived once (a call's span and one more are
    kept)."""
    if epoch not in self._epochs:
      if len(self._epochs) > self._spans:
        del self._epochs[min(self._epochs)]
      value = np.asarray(epoch, np.int32)
      self._epochs[epoch] = self._epoch_orders(
          self._global(value, NamedSharding(self._mesh, P()), ()))
    return self._epochs[epoch]


def choose(setting: Any, budget_mb: float, source: Source, copies: int = 1) -> Source:
  """`source` as the run's training split: a ResidentSource where config.data.resident
  (`setting`) and the budget say so, else `source` itself (the host pipeline).

  Args:
    copies: the copies of the split each device would hold (the member splits' standardised
      copies, else 1).

  Raises:
    ConfigError: a setting other than 'auto', True or False, or True for a split that
      does not fit the budget (one line naming the field and the bytes).
  """
  if not is_setting(setting):
    raise ConfigError(f"{FIELD}={setting!r}; use 'auto', True or False.")
  if setting is False or isinstance(source, ResidentSource):
    return source
  need = copies * split_bytes(source)
  budget = int(budget_mb * _MB)
  what = (f'the training split takes {need} bytes ({need / _MB:.1f} MB'
          + (f', {copies} standardised copies' if copies > 1 else '') + ') on every device')
  if need > budget:
    if setting is True:
      raise ConfigError(f'{FIELD}=True but {what}, over {BUDGET_FIELD}={budget_mb:g} '
                        f'({budget} bytes); raise the budget or set {FIELD}=\'auto\'.')
    logging.info('host input pipeline: %s, over %s=%g', what, BUDGET_FIELD, budget_mb)
    return source
  logging.info('resident data: %s (%s=%g)', what, BUDGET_FIELD, budget_mb)
  return ResidentSource(source, copies, need)


def is_setting(value: Any) -> bool:
  """Whether `value` is one of SETTINGS (True and False themselves, not 1 or 0)."""
  return any(value is s or (isinstance(s, str) and value == s) for s in SETTINGS)


def is_resident(source: Source) -> bool:
  return isinstance(source, ResidentSource)


__all__ = ['SETTINGS', 'Gather', 'ResidentSource', 'choose', 'is_resident', 'split_bytes']
