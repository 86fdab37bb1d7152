"""The mesh a saved run is loaded onto (Ensemble.load, and the report through it).

By default, the run's own layout: each member split over as many devices as training
split it over (the saved mesh.model), so a member larger than one device stays split,
with members spread over as many device groups as divide M and the rest on 'data'. A
caller may name another mesh, as a jax Mesh or as the config's mesh fields; a mesh that
cannot hold the members is refused in one line naming it and one that would.

"Hold" is counted against a memory budget per device: the caller's, else what the device
reports as its limit (GPUs, TPUs); a CPU reports none, and then only the mesh's shape is
checked (the members must split evenly over 'member', the rules must divide the leaves).
"""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh

from dist_ens.errors import ConfigError
from dist_ens.parallel import mesh as mesh_lib

# What Ensemble.load(mesh=...) takes: a Mesh with axes ('member', 'data'[, 'model']), or
# the config's mesh fields {'member': m, 'data': d, 'model': k} (absent: -1, 1, 1, as
# configs/default.py; -1 fills the devices).
MeshArg = Mesh | Mapping[str, int] | None
FIELDS = {'member': -1, 'data': 1, 'model': 1}


def saved_axes(mesh_fields: Mapping[str, Any],
               meta: Mapping[str, Any] | None) -> dict[str, int]:
  """The mesh the run last trained on: the checkpoint's (meta['mesh']) where it says,
  else the config's mesh fields' sizes (a -1 there, unknown without the checkpoint's: 1)."""
  saved = (meta or {}).get('mesh')
  if isinstance(saved, Mapping):
    return {name: int(saved.get(name, 1)) for name in FIELDS}
  sizes = {name: mesh_fields.get(name, default) for name, default in FIELDS.items()}
  return {name: size if isinstance(size, int) and size > 0 else 1
          for name, size in sizes.items()}


def _grid(num_members: int, devices: Sequence[jax.Device], model: int,
          data_split: int = 1) -> Mesh:
  """`model` neighbouring devices per group; as many groups on 'member' as divide M
  (after `data_split` on 'data'), the rest on 'data'."""
  groups = len(devices) // model
  data_split = math.gcd(data_split, groups)
  member = math.gcd(num_members, groups // data_split)
  return mesh_lib.make_mesh(mesh_lib.MeshSpec(member, groups // member, model=model), devices)


def saved_layout(num_members: int, mesh_fields: Mapping[str, Any],
                 meta: Mapping[str, Any] | None,
                 devices: Sequence[jax.Device]) -> Mesh:
  """The default: each member split over the saved mesh.model devices (under ZeRO-3,
  mesh.fsdp_over_data, over the saved data x model), or over as many as the devices
  allow (the greatest common divisor with their count, with a warning)."""
  saved = saved_axes(mesh_fields, meta)
  model = math.gcd(saved['model'], len(devices))
  if model < saved['model']:
    logging.warning('the run split each member over mesh.model=%d devices; %d devices '
                    'allow %d, so each device holds more of a member than in training.',
                    saved['model'], len(devices), model)
  data_split = saved['data'] if mesh_fields.get('fsdp_over_data', False) else 1
  return _grid(num_members, devices, model, data_split)


def describe(mesh: Mesh) -> str:
  return ' x '.join(f'{name}={size}' for name, size in mesh.shape.items())


def requested(mesh: MeshArg, num_members: int, devices: Sequence[jax.Device]) -> Mesh:
  """The caller's mesh, checked to split the members evenly.

  Raises:
    ConfigError: one line naming the mesh: unknown axes or fields, sizes the devices do
      not allow, or a 'member' axis that does not divide the members.
  """
  where = f'Ensemble.load(mesh={mesh!r})'
  if isinstance(mesh, Mesh):
    names = tuple(mesh.axis_names)
    if names not in (mesh_lib.AXES, mesh_lib.AXES + (mesh_lib.MODEL,)):
      raise ConfigError(f'{where}: a mesh has the axes {mesh_lib.AXES} or '
                        f'{mesh_lib.AXES + (mesh_lib.MODEL,)}; this one has {names}.')
    built = mesh
  elif isinstance(mesh, Mapping):
    unknown = sorted(set(mesh) - set(FIELDS))
    if unknown:
      raise ConfigError(f'{where}: unknown field {unknown[0]!r}; give the sizes of '
                        f'{list(FIELDS)} (absent: {FIELDS}), or a jax Mesh.')
    spec = mesh_lib.MeshSpec(**{name: mesh.get(name, default)
                                for name, default in FIELDS.items()})
    try:  # Any 'data' size serves prediction: batches are padded to a multiple of it.
      built = mesh_lib.make_mesh(spec, devices, num_members=num_members,
                                 batch_size=len(devices))
    except ConfigError as e:
      raise ConfigError(f'{where}: {e}') from None
  else:
    raise ConfigError(f'{where}: give a jax Mesh or a dict of {list(FIELDS)} sizes, e.g. '
                      "{'member': 2, 'data': 2, 'model': 2}.")
  m = built.shape[mesh_lib.MEMBER]
  if num_members % m:
    raise ConfigError(f'{where}: its {describe(built)} splits the {num_members} members over '
                      f'member={m}, which does not divide them; use a member size in '
                      f'{[d for d in range(1, num_members + 1) if num_members % d == 0]}.')
  return built


def memory_budget(memory_gb: float | None, mesh: Mesh) -> int | None:
  """Bytes one device may hold: `memory_gb` (1e9 bytes, as `dist-ens plan --memory_gb`),
  else the device's own limit where it reports one (None on a CPU)."""
  if memory_gb is not None:
    if not memory_gb > 0:
      raise ConfigError(f'Ensemble.load(memory_gb={memory_gb!r}) must be > 0.')
    return int(memory_gb * 1e9)
  stats = mesh.devices.flat[0].memory_stats() or {}
  return stats.get('bytes_limit')


def held_bytes(abstract_state: Any) -> int:
  """What a loaded ensemble keeps on one device: its shards of the params and model
  state (the optimizer state is not restored), by the state's shardings."""
  leaves = jax.tree.leaves((abstract_state.params, abstract_state.model_state))
  return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
             for leaf in leaves)


def check_holds(mesh: Mesh, held: int, budget: int, devices: Sequence[jax.Device],
                num_members: int, held_on: Callable[[Mesh], int]) -> None:
  """Refuses `mesh` when a device would hold more than `budget` bytes (`held`), naming
  the least split of each member over 'model' that fits (`held_on(mesh)`: the bytes on
  another mesh), if any does."""
  if held <= budget:
    return
  current = mesh.shape.get(mesh_lib.MODEL, 1)
  fits = None
  for model in range(current + 1, len(devices) + 1):
    if len(devices) % model == 0:
      candidate = _grid(num_members, devices, model)
      if held_on(candidate) <= budget:
        fits = candidate
        break
  hint = (f"mesh={{'model': {fits.shape[mesh_lib.MODEL]}}} ({describe(fits)}) fits"
          if fits is not None else f'no split of a member over these {len(devices)} devices '
          'fits it; load on more devices')
  raise ConfigError(
      f'Ensemble.load: the mesh {describe(mesh)} cannot hold the members: each device would '
      f"hold {held / 1e6:.3g} MB of their parameters and state, over the budget of "
      f'{budget / 1e6:.3g} MB per device; {hint}.')
