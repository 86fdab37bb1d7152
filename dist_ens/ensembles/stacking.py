"""Stacked ensembles: M member pytrees held as one pytree with a leading member axis.

A Python list of parameter pytrees ("list of structs") cannot be vmapped: vmap maps
over the leaves of whatever it is given, so a list of M trees is just a bigger tree.
Stacking turns it into a struct of arrays, where every leaf has shape [M, ...] and
`jax.vmap(f)(stacked)` runs `f` once per member in one program.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def stack(members: Sequence[PyTree]) -> PyTree:
  """Stacks M pytrees of identical structure into one with a leading member axis.

  Example:
    >>> a = {'w': jnp.zeros((2, 3))}
    >>> b = {'w': jnp.ones((2, 3))}
    >>> stack([a, b])['w'].shape
    (2, 2, 3)

  Args:
    members: a non-empty sequence of pytrees with the same structure, and the same
      shape and dtype at every leaf.

  Returns:
    One pytree of that structure whose leaves have shape [M, *leaf_shape].

  Raises:
    ValueError: if `members` is empty or the members differ; the message names
      the first differing path.
  """
  if not members:
    raise ValueError('stack() needs at least one member, got an empty sequence.')
  first_paths, first_def = jax.tree_util.tree_flatten_with_path(members[0])
  for i, member in enumerate(members[1:], start=1):
    paths, treedef = jax.tree_util.tree_flatten_with_path(member)
    if treedef != first_def:
      raise ValueError(
          f'stack(): member {i} has a different structure from member 0 '
          f'{_first_structure_difference(members[0], member)}.')
    for (path, leaf), (_, ref) in zip(paths, first_paths):
      if np.shape(leaf) != np.shape(ref) or jnp.result_type(leaf) != jnp.result_type(ref):
        raise ValueError(
            f'stack(): member {i} differs from member 0 at '
            f'{jax.tree_util.keystr(path)}: {jnp.result_type(leaf)}{list(np.shape(leaf))} '
            f'vs {jnp.result_type(ref)}{list(np.shape(ref))}.')
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *members)


def unstack(tree: PyTree) -> list[PyTree]:
  """Inverse of `stack`: splits the leading member axis into a list of M pytrees."""
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    raise ValueError('unstack() got a pytree with no leaves.')
  sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(
        'unstack(): every leaf needs the same leading member axis; got leading '
        f'sizes {sorted(map(str, sizes))}.')
  (num_members,) = sizes
  return [treedef.unflatten([leaf[i] for leaf in leaves]) for i in range(num_members)]


def num_members(tree: PyTree) -> int:
  """The size of the leading member axis of a stacked pytree."""
  return jax.tree.leaves(tree)[0].shape[0]


def _first_structure_difference(a: PyTree, b: PyTree) -> str:
  """Describes where two pytree structures first diverge, for error messages."""
  pa = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(a)[0]]
  pb = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(b)[0]]
  for x, y in zip(pa, pb):
    if x != y:
      return f'(first differing path: {x} in member 0 vs {y})'
  if len(pa) != len(pb):
    longer, name = (pa, 'member 0') if len(pa) > len(pb) else (pb, 'this member')
    return f'(path {longer[min(len(pa), len(pb))]} exists only in {name})'
  return '(same leaf paths, different node types)'
