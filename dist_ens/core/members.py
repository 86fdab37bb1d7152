"""How a device runs a function over its block of members: vmapped, or one after another
in a loop of the compiled program (`over_members`)."""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# How a device runs a function over its block of members.
MEMBER_PARALLELISM = ('vmap', 'map')


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
    if _members(args, axes) == {1}:
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
  apart, over the stored state: core.step._vmapped_update.)"""
  vmapped = jax.vmap(fn, in_axes=in_axes)

  def run(*args):
    axes = _axes_of(in_axes, len(args))
    return _one(fn, axes, args) if _members(args, axes) == {1} else vmapped(*args)

  return run


def _members(args, axes) -> set[int]:
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
  (members,) = _members(args, axes)
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
