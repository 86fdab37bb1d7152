"""What the plan counts per member and per device, for a run's parts: parameters and state
bytes per member, the state's bytes per device by its layout, and the compiled step's train
FLOPs per member-example (the planner's, for each stack of members)."""

from typing import Any

import jax

from dist_ens.run import assemble
from dist_ens.parallel import mesh as mesh_lib, placement
from dist_ens.plan import dry_run


def per_member_sizes(state: Any, m: int) -> tuple[int, int]:
  """(parameters, state bytes) per member: all trained parameters over M (a shared weight
  counts 1/M per member); leaves with axes only (the step counter belongs to no member)."""
  params = round(sum(leaf.size for leaf in jax.tree.leaves(state.params)) / m)
  state_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state)
                    if leaf.ndim) // m
  return params, state_bytes


def placement_of(parts: assemble.Parts) -> dict:
  """The train state's bytes per device and each parameter's spec, by the run's layout."""
  state, shape = parts.abstract_state, parts.mesh.shape
  specs = parts.layout.state_specs(state)
  return {'state_bytes_per_device': placement.state_bytes_per_device(specs, state, shape),
          'param_leaves': placement.describe(specs.params, state.params, shape)}


def flops_per_example(compiled, parts, batch: dry_run.StepBatch, form) -> float | None:
  """FLOPs of the compiled (per-device) step / the member-examples one device runs. XLA's
  cost analysis counts a loop's body once, so a step whose members run in a loop ('map')
  is counted on the same parts' vmapped step instead (compiled, never run)."""
  mesh = parts.mesh
  members_per_device = parts.num_members // mesh.shape[mesh_lib.MEMBER]
  if form[0] != 'vmap' and members_per_device > 1:
    compiled = dry_run.compile_step(parts, batch, ('vmap', None))[0]
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except  # Not implemented on some backends.
    return None
  if isinstance(cost, (list, tuple)):  # Older jax: one dict per program.
    cost = cost[0] if cost else None
  if not cost or cost.get('flops', -1) <= 0:
    return None
  examples = batch.size // mesh.shape[mesh_lib.DATA]
  return float(cost['flops']) / (members_per_device * examples)
