"""How each device runs its members (vmap, or map in chunks): config.ensemble's
member_parallelism resolved for a run's parts, by `dist-ens plan --calibrate`'s
measurement where there is one (parallel/form_cache.py), else by parallel/strategy.py's
rules. dist_ens.run.assemble uses it."""

from typing import Any

import jax

from dist_ens.parallel import form_cache, mesh as mesh_lib, strategy

# `parts` below: an assemble.Parts (not imported: assemble builds on this module).


def members_per_device(parts: Any) -> int:
  return parts.num_members // parts.mesh.shape[mesh_lib.MEMBER]


def form_key(parts: Any, batch_size: int) -> str:
  """The key of the measured member forms' cache (parallel/form_cache.py) for this run
  with this global batch per member."""
  return form_cache.key(parts.stack.form_fields, parts.mesh.devices.flat[0],
                        members_per_device(parts),
                        batch_size // parts.mesh.shape[mesh_lib.DATA])


def member_form(parts: Any, batch_size: int) -> strategy.Form:
  """(member parallelism, map chunk) for this mesh, with config.ensemble's 'auto' resolved:
  by `dist-ens plan --calibrate`'s measurement when it has one for this run's shape
  (parallel/form_cache.py), else by the rules of parallel/strategy.py."""
  stack, mesh = parts.stack, parts.mesh
  # Only a single process trusts its cache: every process must compile the same program.
  if stack.member_parallelism == 'auto' and jax.process_count() == 1:
    calibrated = form_cache.lookup(form_key(parts, batch_size))
    if calibrated is not None:
      return calibrated
  return strategy.resolve(
      stack.member_parallelism, stack.map_batch_size, stack.model_name,
      mesh.devices.flat[0].platform,
      members_per_device=members_per_device(parts),
      sizes=lambda: strategy.member_size(
          parts.model, parts.input_shape, batch_size // mesh.shape[mesh_lib.DATA],
          parts.input_dtype))
