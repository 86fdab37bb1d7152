"""The train step: one member's update -> vmap (or a loop) over a device's members ->
shard_map over 'member' -> jit.

How a device runs its block of members is over_members (here, beside the step that
is its reason to be): an ensemble method's own member update (core.hooks) runs its
members with it too, and parallel.strategy picks among its forms.

The step is manual over 'member' only: each device (group) runs its own block of
members, so no collective ever crosses members. Over 'data' it is global-view:
a member's batch is one array sharded over 'data', the loss is the mean over the
whole batch, and XLA inserts the reductions (gradient all-reduce, BatchNorm's
batch statistics) itself. A model therefore needs no axis names, and BatchNorm
and dropout give the same result on any mesh (dropout keys come from (seed,
member, step), and jax's partitionable threefry draws the same bits for a global
shape however it is sharded).

A member's batch may be cut into K micro-batches (StepOptions.micro_batches,
config.train.micro_batches); every result is then the mean of the K micro-batches':
the loss (each micro-batch's mean loss, so the mean over the batch), the accuracy, the
gradients and the model state (each micro-batch starts from the same state, so
BatchNorm's running statistics move by the mean of the micro-batches' statistics).
Micro-batch k's stochastic layers draw from fold_in(key, k).

Two ways to sum them:
  accumulate  (default) a lax.scan over the micro-batches, summed in order: the
              activations of one micro-batch are live at a time. Micro-batch k
              holds examples k, k + K, k + 2K, ... of the batch, so under the
              global view over 'data' each one stays spread over the data devices.
  canonical   (config.reproducible) inside a step that is manual over 'data':
              micro-batch k holds the k-th contiguous block of B/K examples; each
              device computes its own micro-batches one at a time (lax.map) and
              the K results are summed as one balanced binary tree over k, which
              is the same tree however many data devices hold the micro-batches
              (K a power of two, the data axis dividing it). The sum is therefore
              bit-identical on every mesh.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from dist_ens.core import rng as rng_lib
from dist_ens.core.axes import DATA, MEMBER
from dist_ens.core.hooks import MethodHooks
from dist_ens.core.model import Model, with_precision
from dist_ens.core.optim import Optimizer
from dist_ens.core.state import TrainState

PyTree = Any
Hparams = Mapping[str, jax.Array]
# augment(x [B, ...], member, step, index [B]) -> x: per-example draws keyed by (seed,
# member, step, example index), so the same on any mesh (dist_ens.data.augment).
BatchAugment = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
# over_members' forms.
MEMBER_PARALLELISM = ('vmap', 'map')


class StepMetrics(NamedTuple):
  """Per-member metrics of one step on its train batch, each [M]."""
  loss: jax.Array
  metrics: dict[str, jax.Array]  # the task's batch metrics (e.g. accuracy)
  nonfinite: jax.Array  # [M] bool: this step's loss or gradient was not finite.


def _all_finite(tree: PyTree) -> jax.Array:
  """Whether every element of `tree` is finite, read as the finiteness of each leaf's sum.

  A NaN or an infinity anywhere makes the sum NaN or infinite, so nothing non-finite
  passes; a finite leaf fails only if its elements sum beyond the dtype's range (float32:
  3.4e38), where their squares, Adam's second moments, overflow anyway. XLA:CPU lowers a
  float sum to its vectorised reduction kernels, and an `all` of booleans to a plain loop.
  """
  wide = lambda x: jnp.sum(x, dtype=jnp.promote_types(x.dtype, jnp.float32))
  return jnp.all(jnp.stack([jnp.isfinite(wide(x)) for x in jax.tree.leaves(tree)]))


def _zero_where(keep: jax.Array, tree: PyTree) -> PyTree:
  return jax.tree.map(lambda g: jnp.where(keep, jnp.zeros_like(g), g), tree)


@dataclasses.dataclass
class TrainStep:
  """The compiled train step: step(state, hparams, x, y[, index]) -> (state, metrics).

  `hparams` are the per-member hyperparameters ({field: [M]}, sharded like the
  state). `index` (the examples' indices in the training split, shaped like y) is
  passed when `uses_index` (augmentation draws from it). `traces` counts how often
  Python traced the step: 1 for a run.
  """
  fn: Callable[..., tuple[TrainState, StepMetrics]] = dataclasses.field(repr=False)
  uses_index: bool = False
  traces: int = 0

  def __call__(self, state: TrainState, hparams: Hparams, x: jax.Array, y: jax.Array,
               index: jax.Array | None = None):
    if self.uses_index and index is None:
      raise ValueError('This step augments its inputs: pass the examples\' indices '
                       '(data.Batches(..., with_index=True) yields them).')
    batch = (x, y, index) if self.uses_index else (x, y)
    return self.fn(state, hparams, *batch)


class Member(NamedTuple):
  """One member's trained state, every leaf without the member axis; over a device's
  block of members (hooks.members_update), every leaf with it."""
  params: PyTree
  model_state: PyTree
  opt_state: PyTree
  frozen: jax.Array  # bool: the member went non-finite and stopped training


class Batch(NamedTuple):
  """A train batch: inputs, targets and (with augmentation) the examples' indices in the
  training split, shaped like y."""
  x: jax.Array
  y: jax.Array
  index: jax.Array | None = None


def update_axes(batch_axis: int | None) -> tuple[int | None, ...]:
  """vmap's in_axes of update(member, hp, member_id, step, batch): the member's state,
  hyperparameters and id stacked on axis 0, the step shared, and the batch stacked on
  `batch_axis` (each member its own batch) or shared (None)."""
  return (0, 0, 0, None, batch_axis)


class StepOptions(NamedTuple):
  """How one member's update treats its batch (config fields in brackets)."""
  augment: BatchAugment | None = None  # [data.augment]
  precision: str = 'float32'  # what the model computes in  [precision]
  micro_batches: int = 1  # the batch is cut into this many  [train.micro_batches]
  reproducible: bool = False  # bit-identical on any mesh and M  [reproducible]


# --- one member's results on its batch: whole, or in micro-batches --------------------


class Objective(NamedTuple):
  """What a member's batch is scored by, from its task (dist_ens.tasks)."""
  loss: Callable[..., jax.Array]  # (outputs, targets, hparams) -> the mean loss, trained on
  metrics: Callable[..., dict[str, jax.Array]]  # (outputs, targets) -> {name: batch mean}


class BatchResult(NamedTuple):
  """One member's results on one (micro-)batch."""
  loss: jax.Array  # [] the mean loss
  metrics: dict[str, jax.Array]  # {name: []} the task's batch metrics (e.g. accuracy)
  grads: PyTree  # the loss's gradient with respect to the params
  model_state: PyTree  # the model state after this batch


# fn(params, model_state, x, y, key, hparams) -> BatchResult
BatchFn = Callable[..., BatchResult]


def batch_fn(model: Model, objective: Objective) -> BatchFn:
  """The results of one forward and backward pass over the whole batch (x, y)."""

  def run(params, model_state, x, y, key, hp):
    def loss_fn(p):
      logits, new_state = model.apply(p, model_state, x, train=True, rng=key)
      return objective.loss(logits, y, hp), (logits, new_state)

    (value, (logits, new_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return BatchResult(value, objective.metrics(logits, y), grads, new_state)

  return run


def _mean(total: BatchResult, k: int) -> BatchResult:
  """A sum of k results -> their mean (integer state leaves, e.g. counters, floor-divided)."""

  def div(a):
    return a // k if jnp.issubdtype(a.dtype, jnp.integer) else a / k

  return jax.tree.map(div, total)


def _strided(a: jax.Array, k: int) -> jax.Array:
  """[B, ...] -> [k, B/k, ...] with row j of micro-batch i being example j * k + i."""
  return jnp.swapaxes(a.reshape(a.shape[0] // k, k, *a.shape[1:]), 0, 1)


def accumulate(fn: BatchFn, k: int) -> BatchFn:
  """`fn` over k strided micro-batches in a lax.scan; the mean of their results.

  A model-state value that no micro-batch changed is kept as it was, bit for bit (a
  randomized prior's frozen network): the mean of k copies, summed in order, may round.
  """
  if k == 1:
    return fn

  def run(params, model_state, x, y, key, hp):
    def body(carry, chunk):
      total, changed = carry
      i, xi, yi = chunk
      result = fn(params, model_state, xi, yi, jax.random.fold_in(key, i), hp)
      changed = jax.tree.map(lambda c, new, old: c | (new != old), changed,
                             result.model_state, model_state)
      return (jax.tree.map(jnp.add, total, result), changed), None

    shapes = jax.eval_shape(fn, params, model_state, x[:x.shape[0] // k], y[:y.shape[0] // k],
                            key, hp)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    unchanged = jax.tree.map(lambda s: jnp.zeros(s.shape, bool), shapes.model_state)
    (total, changed), _ = jax.lax.scan(body, (zeros, unchanged),
                                       (jnp.arange(k), _strided(x, k), _strided(y, k)))
    mean = _mean(total, k)
    return mean._replace(model_state=jax.tree.map(
        lambda c, new, old: jnp.where(c, new, old), changed, mean.model_state, model_state))

  return run


def tree_sum(tree: PyTree) -> PyTree:
  """Sums every leaf over its leading axis (a power of two) as a balanced binary tree:
  neighbours first ((a0 + a1) + (a2 + a3)), a fixed order whatever the layout."""

  def pairwise(a):
    n = a.shape[0]
    if n & (n - 1):
      raise ValueError(f'tree_sum needs a power-of-two leading axis, got {n}.')
    while a.shape[0] > 1:
      a = a[0::2] + a[1::2]
    return a[0]

  return jax.tree.map(pairwise, tree)


def canonical_split(k: int, data_size: int) -> str | None:
  """Why k micro-batches cannot be summed canonically over `data_size` devices, or None:
  both must be powers of two and `data_size` must divide k (the edge says it as the
  config's fields: run/mesh_layout.py)."""
  if data_size & (data_size - 1):
    return f'a data axis of {data_size} devices is not a power of two'
  if k & (k - 1) or k % data_size:
    return f'{k} micro-batches are not a power of two that {data_size} devices divide'
  return None


def canonical(fn: BatchFn, k: int, data_axis: str, data_size: int) -> BatchFn:
  """`fn` over k contiguous micro-batches, summed in one fixed tree on any data split.

  Runs inside a shard_map that is manual over `data_axis` (of `data_size` devices):
  x and y are this device's block of the member's batch, k / data_size micro-batches.
  """
  why = canonical_split(k, data_size)
  if why is not None:
    raise ValueError(f'canonical sums: {why}.')
  local = k // data_size

  def run(params, model_state, x, y, key, hp):
    first = jax.lax.axis_index(data_axis) * local

    def one(chunk):
      i, xi, yi = chunk
      chunk_key = key if k == 1 else jax.random.fold_in(key, first + i)
      return fn(params, model_state, xi, yi, chunk_key, hp)

    chunks = (jnp.arange(local), x.reshape(local, -1, *x.shape[1:]),
              y.reshape(local, -1, *y.shape[1:]))
    partial = tree_sum(jax.lax.map(one, chunks))
    return _mean(tree_sum(jax.lax.all_gather(partial, data_axis)), k)

  return run


# --- one member's update: its results on its batch, then its optimizer step -----------


def member_results_fn(model: Model, seed: int, objective: Objective,
                      options: StepOptions = StepOptions(),
                      data_size: int = 1) -> Callable[..., BatchResult]:
  """results(params, model_state, hp, member_id, step, batch) for ONE member: its loss,
  batch metrics, gradients and new model state on its Batch (a BatchResult).
  The batch's `index` is read by augmentation only.
  """
  one_batch = batch_fn(with_precision(model, options.precision), objective)
  if options.reproducible:
    batch_results = canonical(one_batch, options.micro_batches, DATA, data_size)
  else:
    batch_results = accumulate(one_batch, options.micro_batches)

  def results(params, model_state, hp, member_id, step, batch: Batch):
    x = batch.x
    if options.augment is not None:
      x = options.augment(x, member_id, step, batch.index)
    return batch_results(params, model_state, x, batch.y,
                         rng_lib.train_key(seed, member_id, step), hp)

  return results


def member_apply_fn(optimizer: Optimizer) -> Callable[..., Any]:
  """apply(member, hp, result) -> (member, StepMetrics) for ONE Member: its optimizer
  step on `result` (member_results_fn's). A member whose loss or gradient is not
  finite is frozen: from then on its optimizer sees zero gradients (its state stays
  finite), its parameters zero updates and its model state is kept. Masking
  gradients and updates, rather than selecting old-vs-new state afterwards, lets XLA
  update the optimizer moments in place; the select made it copy them every step
  (benchmarks/HISTORY.md, "Open work, done or superseded", 3).
  """

  unless = _apply_unless(optimizer)
  return lambda member, hp, result: unless(member, hp, result, _nonfinite(result))


def _nonfinite(result: BatchResult) -> jax.Array:
  return ~(jnp.isfinite(result.loss) & _all_finite(result.grads))


def _apply_unless(optimizer: Optimizer) -> Callable[..., Any]:
  """member_apply_fn's apply with the member's `nonfinite` flag given (_nonfinite(result))."""

  def apply(member: Member, hp, result, nonfinite):
    keep = member.frozen | nonfinite
    updates, opt_state = optimizer(hp).update(_zero_where(keep, result.grads), member.opt_state,
                                              member.params)
    params = optax.apply_updates(member.params, _zero_where(keep, updates))
    model_state = jax.tree.map(lambda old, new: jnp.where(keep, old, new), member.model_state,
                               result.model_state)
    return (Member(params, model_state, opt_state, keep),
            StepMetrics(result.loss, result.metrics, nonfinite))

  return apply


def member_update_fn(model: Model, optimizer: Optimizer, seed: int,
                     objective: Objective,
                     options: StepOptions = StepOptions(), data_size: int = 1) -> Callable[..., Any]:
  """update(member, hp, member_id, step, batch) -> (member, StepMetrics) for ONE Member:
  member_results_fn then member_apply_fn."""
  results = member_results_fn(model, seed, objective, options, data_size)
  apply = member_apply_fn(optimizer)

  def update(member: Member, hp, member_id, step, batch: Batch):
    return apply(member, hp, results(member.params, member.model_state, hp, member_id, step,
                                     batch))

  return update


# --- over_members: a function over a device's members, vmapped or in a loop -----------


def _axes_of(in_axes, count: int) -> tuple[int | None, ...]:
  return (in_axes,) * count if isinstance(in_axes, int) else tuple(in_axes)


def over_members(fn: Callable[..., Any], parallelism: str = 'vmap',
                 in_axes: Sequence[int | None] | int = 0,
                 map_batch_size: int | None = None, in_place: int = 0) -> Callable[..., Any]:
  """`fn` applied to every member of stacked arguments, in one traced program.

  'vmap' batches the members into wider operations (fast for matmuls); 'map' runs
  them one after another in a loop of the compiled program (never a Python loop, so
  compile time does not grow with M): better where all members at once fall out of
  the caches or the vmapped form is a poor kernel. `map_batch_size` > 1 vmaps chunks
  of that many members inside the loop. Arguments whose in_axes entry is None are
  shared by all members; the others are stacked on their leading axis.

  `in_place` = n says that fn's first n results have the structure of its first n
  arguments and replace them (a member's new state): 'map' on a CPU then writes each
  member's results into those arguments' buffers, which a donated step updates where they
  lie, instead of filling new arrays (see _member_loop). 'vmap' ignores it, and so does
  'map' on other platforms (lax.map there).

  Example:
    >>> f = over_members(lambda w, x: w * x, 'map', in_axes=(0, None))
    >>> f(jnp.arange(3.0), 2.0).tolist()
    [0.0, 2.0, 4.0]
  """
  if parallelism not in MEMBER_PARALLELISM:
    raise ValueError(f'member parallelism {parallelism!r}; use one of {MEMBER_PARALLELISM}.')
  if parallelism == 'vmap':
    return _vmap_or_one(fn, in_axes)

  def mapped(*args):
    axes = _axes_of(in_axes, len(args))
    if any(axis not in (0, None) for axis in axes) or any(axis is None for axis in axes[:in_place]):
      raise ValueError(f'map runs over leading axes; in_axes={in_axes}, in_place={in_place}.')
    if _member_sizes(args, axes) == {1}:
      return _one(fn, axes, args)
    # On a CPU the in-place loop (measured there); elsewhere lax.map, as measured on a GPU
    # (where the loop's cond would copy its predicate to the host every member).
    return jax.lax.platform_dependent(
        *args, cpu=lambda *a: _member_loop(fn, axes, map_batch_size or 1, in_place, a),
        default=lambda *a: _lax_map(fn, axes, map_batch_size, a))

  return mapped


def _vmap_or_one(fn, in_axes):
  """jax.vmap(fn), but with one member fn itself, on the member's slices: a device holding
  one member then runs no batched operations. (The train step vmaps its optimizer step
  apart, over the stored state: _vmapped_update.)"""
  vmapped = jax.vmap(fn, in_axes=in_axes)

  def run(*args):
    axes = _axes_of(in_axes, len(args))
    return _one(fn, axes, args) if _member_sizes(args, axes) == {1} else vmapped(*args)

  return run


def _member_sizes(args, axes) -> set[int]:
  """The sizes of the member axes of `args` ({1}: one member)."""
  return {np.shape(leaf)[axis] for a, axis in zip(args, axes) if axis is not None
          for leaf in jax.tree.leaves(a)}


def _one(fn, axes, args):
  """fn on the one member's slices of `args`, its results given a member axis of 1."""
  one = fn(*(a if axis is None else jax.tree.map(lambda v, ax=axis: jnp.squeeze(v, ax), a)
             for a, axis in zip(args, axes)))
  return jax.tree.map(lambda v: jnp.expand_dims(v, 0), one)


def _lax_map(fn, axes, chunk, args):
  """fn over the members of `args` with lax.map (chunks of `chunk` vmapped members)."""
  per_member = tuple(a for a, axis in zip(args, axes) if axis is not None)

  def one(members_args):
    it = iter(members_args)
    return fn(*(next(it) if axis is not None else a for a, axis in zip(args, axes)))

  return jax.lax.map(one, per_member, batch_size=chunk)


def _member_loop(fn, axes, chunk, in_place, args):
  """fn over the members of `args`, `chunk` at a time, in a fori_loop whose carry is the
  stacked results: each chunk's results are written into it with a dynamic update.

  Results that replace arguments (`in_place`) start from those arguments, so that the
  loop updates the state's own buffers; the rest start as zeros. Each chunk's work runs
  inside a lax.cond, whose branch reads the chunk's slices itself: XLA does not fuse
  across the conditional, so the chunk's new state is computed whole before it is
  written back. Without it XLA:CPU fused the optimizer's arithmetic into the writes,
  which then read moments already overwritten, and it copied the whole stacked state
  every iteration (benchmarks/HISTORY.md, "Members one at a time, in place"). The cond's
  other branch, taken only for a negative start that never occurs, keeps the chunk as it is.
  """
  (members,) = _member_sizes(args, axes)
  chunk = max(1, min(chunk, members))
  body_fn = fn if chunk == 1 else jax.vmap(fn, in_axes=axes)

  def take(tree, start, size):
    cut = lambda a: jax.lax.dynamic_slice_in_dim(a, start, size)
    return jax.tree.map((lambda a: cut(a)[0]) if chunk == 1 else cut, tree)

  def apply(ops, start, size):
    return body_fn(*(a if axis is None else take(a, start, size) for a, axis in zip(ops, axes)))

  shapes = jax.eval_shape(lambda *a: apply(a, 0, chunk), *args)  # One chunk's results.

  def write(outs, start, size, operands):
    def keep(ops):
      resize = (lambda s: s.shape) if chunk == 1 else (lambda s: (size, *s.shape[1:]))
      zeros = jax.tree.map(lambda s: jnp.zeros(resize(s), s.dtype), shapes)
      if not in_place:
        return zeros
      return (*(take(a, start, size) for a in ops[:in_place]), *zeros[in_place:])

    new = jax.lax.cond(start >= 0, lambda ops: apply(ops, start, size), keep, operands)
    widen = (lambda v: v[None]) if chunk == 1 else (lambda v: v)
    return jax.tree.map(lambda o, v: jax.lax.dynamic_update_slice_in_dim(o, widen(v), start, 0),
                        outs, new)

  operands = lambda outs: (*outs[:in_place], *args[in_place:]) if in_place else args
  outs = _initial_results(shapes, args[:in_place], members, chunk)
  outs = jax.lax.fori_loop(0, members // chunk,
                           lambda i, outs: write(outs, i * chunk, chunk, operands(outs)), outs)
  if members % chunk:  # The last, smaller chunk.
    rest = members % chunk
    outs = write(outs, members - rest, rest, operands(outs))
  return outs


def _initial_results(shapes, replaced: Sequence[Any], members: int, chunk: int):
  """The loop's carry before the first member: the arguments that results replace, and
  zeros for the other results (shapes: one chunk's results)."""
  widen = (lambda s: (members, *s.shape)) if chunk == 1 else (lambda s: (members, *s.shape[1:]))
  stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct(widen(s), s.dtype), shapes)
  for k, arg in enumerate(replaced):
    want = jax.tree.map(lambda z: (z.shape, z.dtype), stacked[k])
    have = jax.tree.map(lambda a: (a.shape, a.dtype), arg)
    if want != have:
      raise ValueError(f'in_place: result {k} is {want}, not like argument {k}: {have}.')
  zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
  if not replaced:
    return zeros(stacked)
  return (*replaced, *(zeros(t) for t in stacked[len(replaced):]))


# --- a device's members' update, then the step: shard_map over 'member', jit ----------


# The new Member replaces the first argument, the member's state: 'map' writes it back into
# the donated state's buffers (over_members' in_place counts such leading arguments).
_NEW_MEMBER = 1


def _members_update(model, optimizer, seed, objective, options, data_size, parallelism,
                    map_batch_size, batch_axis, hooks):
  """update(members, hp, member_ids, step, batch) -> (members, StepMetrics) over a device's
  block of members (a Member whose leaves are [m, ...]).

  Reproducible mode runs each member's whole update (forward, backward, optimizer)
  one member at a time ('map'): one fixed per-member program whatever the block's
  size. Vmapping even the elementwise optimizer step is not enough: XLA simplifies
  `m / broadcast(1 - b1**t)` differently at member widths 1 and M (measured: 3e-8 after
  one Adam step), whereas a member-shaped body compiles alike everywhere.
  """
  if hooks.members_update is not None:  # BatchEnsemble (reproducible mode refused), own.
    return hooks.members_update(
        member_results_fn(model, seed, objective, options, data_size), member_apply_fn(optimizer),
        optimizer, 'map' if options.reproducible else parallelism, batch_axis,
        None if options.reproducible else map_batch_size)
  if options.reproducible or parallelism != 'vmap':
    return over_members(member_update_fn(model, optimizer, seed, objective, options, data_size),
                        'map' if options.reproducible else parallelism,
                        in_axes=update_axes(batch_axis),
                        map_batch_size=None if options.reproducible else map_batch_size,
                        in_place=_NEW_MEMBER)
  return _vmapped_update(member_results_fn(model, seed, objective, options, data_size),
                         _apply_unless(optimizer), batch_axis)


def _vmapped_update(results, apply, batch_axis):
  """The 'vmap' form: every member's forward and backward pass (and its non-finite flag)
  vmapped by over_members, then the optimizer step vmapped over the state as it is
  stored. Both are one vmap of the whole update where a device holds several members;
  where it holds one, over_members runs the member's own forward and backward pass on its
  slices (no batched operations) while the optimizer still steps the stored [1, ...] state.

  Squeezing the state too made XLA:CPU fuse the new optimizer moments into both their own
  outputs and the parameters' update, recomputing them there from the old moments, which
  it then copied every step, which made a one-member step slower than a Python loop of
  plain per-member updates (BENCHMARKS.md, "Today's figures").
  """

  def checked(params, model_state, hp, member_id, step, batch):
    result = results(params, model_state, hp, member_id, step, batch)
    return result, _nonfinite(result)

  member_results = over_members(checked, 'vmap', in_axes=(0, 0) + update_axes(batch_axis)[1:])

  def update(members: Member, hp, member_ids, step, batch: Batch):
    result, nonfinite = member_results(members.params, members.model_state, hp, member_ids,
                                       step, batch)
    return jax.vmap(apply)(members, hp, result, nonfinite)

  return update


def _state_update(members_update, hooks: MethodHooks, reproducible: bool):
  """update(state, hparams, member_ids, batch) -> (state, metrics) for a device's
  block of members: every member's update (_members_update), then what the ensemble
  method collects from the new parameters (nothing for independent members)."""
  collect = None
  if hooks.collect is not None:
    collect = over_members(hooks.collect, 'map' if reproducible else 'vmap',
                           in_axes=(0, 0, 0, None))

  def update(state, hparams, member_ids, batch: Batch):
    members, metrics = members_update(
        Member(state.params, state.model_state, state.opt_state, state.frozen), hparams,
        member_ids, state.step, batch)
    step = state.step + 1
    collected = state.method_state if collect is None else collect(
        state.method_state, members.params, members.model_state, step)
    return TrainState(**members._asdict(), step=step, method_state=collected), metrics

  return update


def _manual_only(spec: P, manual: set[str]) -> P:
  """`spec` with the axes shard_map leaves automatic dropped: inside, a leaf split over
  'model' is one global-view array, and XLA gathers what each member's update needs."""
  keep = lambda entry: entry if entry is None or entry in manual else (
      tuple(a for a in entry if a in manual) or None if isinstance(entry, tuple) else None)
  return P(*(keep(e) for e in spec))


def _specs(abstract_state: TrainState, per_member_batches: bool, steps_per_call: int,
           manual_data: bool, manual: set[str]):
  """How shard_map's manual axes split the state (as its shardings say), the batch and
  the metrics."""
  batch_axes = (MEMBER,) if per_member_batches else ()
  if manual_data:
    batch_axes += (DATA,)
  batch_spec, metrics_spec = P(*batch_axes), P(MEMBER)
  if steps_per_call > 1:
    batch_spec, metrics_spec = P(None, *batch_spec), P(None, MEMBER)
  state_specs = jax.tree.map(lambda leaf: _manual_only(leaf.sharding.spec, manual),
                             abstract_state)
  return state_specs, batch_spec, metrics_spec


def _layout(mesh: Mesh, abstract_state: TrainState, per_member_batches: bool,
            steps_per_call: int, reproducible: bool):
  """(shard_map's manual axes, (state, batch, metrics specs)).

  Manual over 'member' only; 'data' (and 'model', which splits each member's leaves)
  stays global-view inside (see the module doc). With one device on 'data' both
  views are the same computation; the manual form then compiles to the program
  dist_ens 0.1 ran, bit for bit. Reproducible mode is manual over 'data' too: it
  orders the cross-device sums itself.
  """
  manual_data = reproducible and mesh.shape[DATA] > 1
  manual = {MEMBER, DATA} if mesh.shape[DATA] == 1 or manual_data else {MEMBER}
  return manual, _specs(abstract_state, per_member_batches, steps_per_call, manual_data,
                        manual)


def _local_step(update, steps_per_call: int, first_member: int = 0):
  """step(state, hparams, *batch) on one device group's members: `update` once, or
  steps_per_call times in a lax.scan over the batches' leading axis. Members are keyed
  by their ids, first_member + their index in the state."""

  def local_step(state, hparams, *batch):
    local_members = state.frozen.shape[0]
    member_ids = jax.lax.axis_index(MEMBER) * local_members + jnp.arange(local_members)
    if first_member:
      member_ids = member_ids + first_member

    def one_step(state, arrays):
      return update(state, hparams, member_ids, Batch(*arrays))

    if steps_per_call == 1:
      return one_step(state, batch)
    return jax.lax.scan(one_step, state, batch)

  return local_step


def make_train_step(model: Model, optimizer: Optimizer, mesh: Mesh, abstract_state: TrainState,
                    *, objective: Objective, seed: int = 0,
                    per_member_batches: bool = False, member_parallelism: str = 'vmap',
                    map_batch_size: int | None = None, steps_per_call: int = 1,
                    options: StepOptions = StepOptions(),
                    hooks: MethodHooks = MethodHooks(), first_member: int = 0) -> TrainStep:
  """Builds the jitted, sharded step; the input state is donated.

  Args:
    model, optimizer, seed, objective: what one member's update is made of (the
      objective: the task's loss and batch metrics, an Objective).
    mesh: the ('member', 'data'[, 'model']) mesh.
    abstract_state: the state's shapes, carrying their shardings (parallel.layout).
    per_member_batches: x, y are [M, B, ...] (each member its own batch, sharded
      over ('member', 'data')); otherwise [B, ...], shared by all members.
    member_parallelism: 'vmap' or 'map', how each device runs its members
      (over_members), map_batch_size members at a time for 'map'.
    steps_per_call: K > 1 runs K steps per call in a lax.scan: x and y get a
      leading axis of K batches and every metric one of K steps ([K, M]). The host
      then dispatches once per K steps, which small models on accelerators need.
    options: augmentation, precision, micro-batches and reproducible mode. With
      augmentation the step takes a third batch array, the examples' indices
      (shaped like y). Reproducible mode runs each member and each micro-batch at
      one fixed shape ('map' over members, manual over 'data'; canonical).
    hooks: the ensemble method's (core.hooks: its member update, what it collects
      after every step); the default: independent members, nothing collected.
    first_member: the id of the state's first member (a member group's place in the
      ensemble): its rng, augmentation and dropout are keyed by first_member + index.
  """
  if not isinstance(steps_per_call, int) or steps_per_call < 1:
    raise ValueError(f'steps_per_call={steps_per_call!r} must be an int >= 1.')
  update = _state_update(
      _members_update(model, optimizer, seed, objective, options, mesh.shape[DATA],
                      member_parallelism, map_batch_size, 0 if per_member_batches else None,
                      hooks),
      hooks, options.reproducible)

  local_step = _local_step(update, steps_per_call, first_member)
  manual, (specs, batch_spec, metrics_spec) = _layout(
      mesh, abstract_state, per_member_batches, steps_per_call, options.reproducible)
  step = TrainStep(fn=None, uses_index=options.augment is not None)

  def traced(state, hparams, *batch):
    step.traces += 1
    # check_vma=False: a model's own collective over a vmapped axis (Equinox's
    # BatchNorm, axis_name='batch') trips jax 0.10's varying-axes check.
    return jax.shard_map(
        local_step, mesh=mesh, axis_names=manual, check_vma=False,
        in_specs=(specs, P(MEMBER)) + (batch_spec,) * len(batch),
        out_specs=(specs, metrics_spec))(state, hparams, *batch)

  # The new state keeps the layout's shardings: over an automatic axis ('model') XLA
  # would otherwise pick the outputs' own, and the next call would compile again.
  state_shardings = jax.tree.map(lambda leaf: leaf.sharding, abstract_state)
  step.fn = jax.jit(traced, donate_argnums=0, out_shardings=(state_shardings, None))
  return step
