"""What each device holds of a train state under a layout's specs (for `dist-ens plan`,
the benchmarks' state bytes and the tests): each leaf's shard and the bytes summed."""

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from dist_ens.parallel.sharding_rules import entry_size, path_str

PyTree = Any


class LeafPlacement(NamedTuple):
  """One leaf of the train state as placed: its path, global shape, spec and the bytes
  of its shard on one device."""
  path: str
  shape: tuple[int, ...]
  spec: P
  bytes_per_device: int


def describe(layout_specs: PyTree, abstract_state: PyTree,
             mesh_shape: Mapping[str, int]) -> list[LeafPlacement]:
  """Each leaf's placement, for `dist-ens plan` to print.

  Args:
    layout_specs: a PartitionSpec per leaf of abstract_state (Layout.state_specs).
    abstract_state: the train state's ShapeDtypeStructs (global shapes, [M, ...]).
    mesh_shape: mesh axis name -> size (a Mesh's .shape).

  Returns:
    A LeafPlacement per leaf, in the state's flattening order. A dimension split over
    axes of n devices in all holds ceil(d / n) entries per device (jax pads uneven
    shards).
  """
  specs = jax.tree.leaves(layout_specs, is_leaf=lambda x: isinstance(x, P))
  leaves = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
  if len(specs) != len(leaves):
    raise ValueError(f'describe: {len(specs)} specs for {len(leaves)} leaves; layout_specs '
                     'must be Layout.state_specs(abstract_state).')
  out = []
  for (path, leaf), spec in zip(leaves, specs):
    where = f'leaf {path_str(path)!r}'
    shard = [-(-d // entry_size(spec[i] if i < len(spec) else None, mesh_shape, where))
             for i, d in enumerate(leaf.shape)]
    nbytes = math.prod(shard) * np.dtype(leaf.dtype).itemsize
    out.append(LeafPlacement(path_str(path), tuple(leaf.shape), spec, nbytes))
  return out


def state_bytes_per_device(layout_specs: PyTree, abstract_state: PyTree,
                           mesh_shape: Mapping[str, int]) -> int:
  """The bytes of the train state on one device: describe's bytes_per_device summed."""
  return sum(p.bytes_per_device for p in describe(layout_specs, abstract_state, mesh_shape))
