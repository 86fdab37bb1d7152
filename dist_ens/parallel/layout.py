"""The layout extension point: the mesh's axes and where every leaf of the train state
lives on them.

A Layout answers, for each leaf of the (abstract) train state, its PartitionSpec:

  scalars (the step counter)       P(), replicated everywhere;
  leaves shared by all members     P(*rule(path, leaf)), stored once (BatchEnsemble's W);
  stacked leaves [M, ...]          P(MEMBER, *rule(path, one member's leaf)), the member
                                   axis prepended to what `rule` says of one member's leaf.

`rule` sees one member's leaf (its shape without the member axis) and returns the spec
of its own dimensions. The default, `whole`, keeps a member whole on every device of its
member group (P(): replicated over 'data'), so a member must fit on a device. A rule
that names other mesh axes shards each member over them (a 'model' axis for members
larger than a device); the member axis is prepended by the layout, never by the rule.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dist_ens.core.axes import DATA, MEMBER

PyTree = Any
Path = tuple[Any, ...]
# rule(path, one member's leaf) -> the PartitionSpec of that leaf's own dimensions.
LeafRule = Callable[[Path, jax.ShapeDtypeStruct], P]


def whole(path: Path, leaf: jax.ShapeDtypeStruct) -> P:
  """The default rule: every member whole on each of its devices (nothing split)."""
  del path, leaf
  return P()


def _never(path: Path) -> bool:
  del path
  return False


def _same(path: Path) -> Path:
  return path


@dataclasses.dataclass(frozen=True)
class Layout:
  """Mesh axes and a per-leaf rule (see the module doc).

  Attributes:
    axes: the mesh's axis names, members first.
    rule: the spec of one member's leaf (LeafRule).
    shared: (path) -> whether the leaf is stored once for all members (an ensemble
      method's, core.hooks.MethodHooks.shared) instead of stacked [M, ...].
    rule_path: (path) -> the path `rule` sees: where a method wraps a member's leaf
      ({'own': p}, {'shared': p}), the leaf's path in the member's own tree, so that
      path rules (regexes ending '$', Flax annotations) match it as without the method.
  """
  axes: tuple[str, ...] = (MEMBER, DATA)
  rule: LeafRule = whole
  shared: Callable[[Path], bool] = _never
  rule_path: Callable[[Path], Path] = _same

  def leaf_spec(self, path: Path, leaf: jax.ShapeDtypeStruct) -> P:
    """The PartitionSpec of one leaf of the train state."""
    if leaf.ndim == 0:
      return P()
    if self.shared(path):
      return P(*self.rule(self.rule_path(path), leaf))
    one = jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
    return P(MEMBER, *self.rule(self.rule_path(path), one))

  def state_specs(self, abstract_state: PyTree) -> PyTree:
    """The PartitionSpec of every leaf of `abstract_state` (a tree of shapes)."""
    return jax.tree_util.tree_map_with_path(self.leaf_spec, abstract_state)

  def state_shardings(self, abstract_state: PyTree, mesh: Mesh) -> PyTree:
    """NamedShardings of every leaf on `mesh`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.state_specs(abstract_state),
                        is_leaf=lambda x: isinstance(x, P))

  def place(self, abstract_state: PyTree, mesh: Mesh) -> PyTree:
    """`abstract_state`'s ShapeDtypeStructs carrying their shardings (what init is
    compiled for and orbax restores into)."""
    return with_shardings(abstract_state, self.state_shardings(abstract_state, mesh))


def with_shardings(abstract_state: PyTree, shardings: PyTree) -> PyTree:
  """ShapeDtypeStructs that carry their sharding."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      abstract_state, shardings)
