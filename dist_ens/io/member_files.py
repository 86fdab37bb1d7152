"""Exported members: one .npz per member, leaves under '/'-joined pytree paths, readable
with numpy alone (Ensemble.export writes them; load_member reads one back)."""

import os
from typing import Any

import jax
import numpy as np

PyTree = Any


def path_key(path: tuple[Any, ...]) -> str:
  """A leaf's path as the key it is stored under: '0/w', 'convs/1/b', 'head/w'."""
  parts = []
  for entry in path:
    if isinstance(entry, jax.tree_util.SequenceKey):
      parts.append(str(entry.idx))
    elif isinstance(entry, jax.tree_util.DictKey):
      parts.append(str(entry.key))
    elif isinstance(entry, jax.tree_util.GetAttrKey):
      parts.append(entry.name)
    else:
      parts.append(str(entry))
  return '/'.join(parts)


def load_member(path: str | os.PathLike) -> PyTree:
  """One exported member's parameters as the pytree it was trained as (numpy only).

  Nested dicts are rebuilt from the '/'-joined keys; a level whose keys are all
  integers becomes a list.

  Example:
    params = load_member('/tmp/members/member_0.npz')
    params[0]['w'].shape  # MLP: first layer's weights
  """
  with np.load(path) as f:
    flat = {key: f[key] for key in f.files}
  tree: dict[str, Any] = {}
  for key, value in flat.items():
    node = tree
    *parents, leaf = key.split('/')
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value

  def listify(node: Any) -> Any:
    if not isinstance(node, dict):
      return node
    node = {k: listify(v) for k, v in node.items()}
    if node and all(k.isdigit() for k in node):
      return [node[str(i)] for i in range(len(node))]
    return node

  return listify(tree)
