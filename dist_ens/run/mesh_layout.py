"""config -> where an ensemble lives: the ('member', 'data'[, 'model']) device mesh, checked
against M and the batch, and the layout that places every leaf of the train state on it
(members whole, a method's shared leaves once, or a member's leaves split over 'model')."""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import Mesh

from dist_ens.core import step as step_lib
from dist_ens.ensembles import batchensemble, methods
from dist_ens.errors import ConfigError
from dist_ens.parallel import mesh as mesh_lib, sharding_rules
from dist_ens.parallel.layout import Layout
from dist_ens.config.specs import mesh_spec


def build_mesh(config: ml_collections.ConfigDict,
               devices: Sequence[jax.Device] | None = None,
               num_members: int | None = None) -> Mesh:
  """The ('member', 'data'[, 'model']) mesh for the config, checked against M and the
  batch; an axis left at -1 is fitted to the devices (parallel.mesh.make_mesh), and a
  warning says what to set when that leaves devices idle. A 'member' axis left at -1 is
  fitted to `num_members` (default config.num_members; run.assemble.fitted_members for
  a run whose stacks are each split over every member device)."""
  devices = list(jax.devices() if devices is None else devices)
  mesh = mesh_lib.make_mesh(mesh_spec(config), devices,
                            num_members=config.num_members if num_members is None
                            else num_members, batch_size=config.data.batch_size)
  mesh_lib.check_divisibility(mesh, config.num_members, config.data.batch_size)
  if mesh.size < len(devices):
    logging.warning('%s', mesh_lib.idle_devices_message(
        mesh_spec(config), mesh, len(devices), config.num_members, config.data.batch_size))
  if config.reproducible:
    check_canonical(config.train.micro_batches, mesh.shape[mesh_lib.DATA])
    if config.mesh.fsdp_over_data:  # Its split, so its sums, would follow mesh.data.
      raise ConfigError(
          'config.reproducible=True promises members bit-identical on any mesh, but '
          'mesh.fsdp_over_data splits each member over data x model devices, so its sums '
          'change with mesh.data; set fsdp_over_data=False (a fixed mesh.model is fine).')
  return mesh


def build_layout(method: methods.Method, mesh: Mesh, mesh_config: ml_collections.ConfigDict,
                 member_params: Callable[[], Any]) -> Layout:
  """Where every leaf lives: a method's shared leaves stored once, members whole on each
  device of their group or, on a mesh with a 'model' axis (or with mesh.fsdp_over_data
  and data > 1), each member's leaves split by the model's Flax annotations,
  config.mesh.rules, else FSDP over 'model' (or 'data' x 'model'). A rule sees one
  member's leaf; `member_params()` are one member's abstract params, with their
  annotations, traced only where a split needs them."""
  shared = {} if method.hooks.shared is None else {
      'shared': method.hooks.shared, 'rule_path': batchensemble.unwrapped_path}
  over_data = bool(mesh_config.fsdp_over_data) and mesh.shape[mesh_lib.DATA] > 1
  if mesh_lib.MODEL not in mesh.axis_names and not over_data:
    return Layout(**shared)
  axes = tuple(a for a in (mesh_lib.DATA, mesh_lib.MODEL) if a in mesh.axis_names
               and (a == mesh_lib.MODEL or over_data))
  size = int(np.prod([mesh.shape[a] for a in axes]))
  rule = sharding_rules.fsdp(axes if len(axes) > 1 else axes[0], axis_size=size,
                             min_size=mesh_config.fsdp_min_size)
  rules = sharding_rules.config_rules(mesh_config.rules)
  if rules:
    rule = sharding_rules.by_regex(rules, default=rule, axis_sizes=dict(mesh.shape),
                                   field='config.mesh.rules')
  logical = tuple(tuple(pair) for pair in mesh_config.logical_rules) or None
  rule = sharding_rules.from_flax_metadata(member_params(), logical, default=rule)
  return Layout(axes=tuple(mesh.axis_names), rule=rule, **shared)


def check_canonical(k: int, data_size: int) -> None:
  """ConfigError unless config.train.micro_batches=k can be summed canonically over the
  mesh's `data_size` devices (reproducible mode; core.step.canonical_split)."""
  if step_lib.canonical_split(k, data_size) is None:
    return
  if data_size & (data_size - 1):
    raise ConfigError(f"config.mesh.data={data_size}: reproducible mode needs a data axis that "
                      'is a power of two (1, 2, 4, ...), as train.micro_batches is one.')
  raise ConfigError(f'config.train.micro_batches={k} must be a power of two that the '
                    f"mesh's data axis ({data_size}) divides, in reproducible mode: e.g. "
                    f'{data_size} or {2 * data_size}.')
