"""How each leaf of the train state is laid out on the ('member', 'data') mesh.

A sharding rule maps (path, leaf) to a PartitionSpec. The default, `stacked`,
puts a leaf's leading member axis on 'member' (replicated over 'data') and
replicates scalars (the step counter); an ensemble method whose state has shared
leaves (one weight for all members) passes a rule that returns P() for them.
"""

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dist_ens.parallel.mesh import MEMBER

PyTree = Any
ShardingRule = Callable[[tuple[Any, ...], jax.ShapeDtypeStruct], P]


def stacked(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> P:
  """The default rule: [M, ...] leaves over 'member'; scalars replicated."""
  del path
  return P() if leaf.ndim == 0 else P(MEMBER)


def state_specs(abstract_state: PyTree, rule: ShardingRule = stacked) -> PyTree:
  """The PartitionSpec of every leaf of `abstract_state` (a tree of shapes)."""
  return jax.tree_util.tree_map_with_path(rule, abstract_state)


def state_shardings(abstract_state: PyTree, mesh: Mesh,
                    rule: ShardingRule = stacked) -> PyTree:
  """NamedShardings of every leaf on `mesh`, by `rule`."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(abstract_state, rule),
                      is_leaf=lambda x: isinstance(x, P))


def with_shardings(abstract_state: PyTree, shardings: PyTree) -> PyTree:
  """ShapeDtypeStructs that carry their sharding (what orbax restores into)."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      abstract_state, shardings)
