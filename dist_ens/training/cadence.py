"""How often the training loop calls the device and waits for it: train.steps_per_call
(K steps in one compiled call, 'auto' from every cadence the loop stops at and, on a CPU,
the step's FLOPs) and train.sync_every's bounds on a CPU mesh."""

from collections.abc import Sequence

import jax
import numpy as np

from dist_ens.config.specs import RunSpec
from dist_ens.run.run_data import RunData
from dist_ens.run import member_forms
from dist_ens.run import assemble
from dist_ens.errors import ConfigError
from dist_ens.parallel import mesh as mesh_lib, strategy
from dist_ens.training.loop import Action, PeriodicAction

# Multi-device CPU collectives deadlock when ~30 steps are queued (seen with XLA's
# CPU backend); waiting every 8 steps keeps well clear of that.
CPU_SYNC_EVERY = 8


def steps_per_call(spec: RunSpec, parts: assemble.Parts,
                   run_data: RunData, start_step: int,
                   actions: Sequence[Action]) -> int:
  # Examples the input pipeline delivers per step: one batch, or one per member.
  inputs = spec.batch_size * (spec.num_members if run_data.order.per_member else 1)
  platform = parts.mesh.devices.flat[0].platform
  train = spec.train
  cadences = (train.steps, train.log_every, train.eval_every, spec.checkpoint_every,
              start_step, spec.pbt.interval if spec.pbt is not None else 0,
              *(a.every for a in actions if isinstance(a, PeriodicAction)))
  k = strategy.steps_per_call(
      train.steps_per_call, cadences, platform,
      inputs * int(np.prod(parts.input_shape)) * 4,  # float32
      step_flops=lambda: step_flops(spec.batch_size, parts))
  if start_step % k:
    raise ConfigError(
        f'config.train.steps_per_call={k} does not divide the checkpoint\'s step '
        f'{start_step}; resume with a steps_per_call that divides it (e.g. 1), or 0 (auto).')
  return k


def step_flops(batch_size: int, parts: assemble.Parts) -> float | None:
  """Training FLOPs of one step per device with `batch_size` examples per member (3x the
  forward: the backward pass costs two forwards), for steps_per_call 'auto' on a CPU;
  None when not known."""
  forward = strategy.forward_flops(parts.model, parts.input_shape,
                                   batch_size // parts.mesh.shape[mesh_lib.DATA],
                                   parts.input_dtype)
  return None if forward is None else 3 * forward * member_forms.members_per_device(parts)


# On a multi-device CPU mesh too many queued steps deadlock XLA's collectives; 16 leaves a
# margin below where that was seen (benchmarks/HISTORY.md, "Figures that lived in code
# comments").
CPU_MAX_SYNC_EVERY = 16


def check_sync_every(sync_every: int, mesh: jax.sharding.Mesh) -> None:
  """train.sync_every, refused where it would deadlock a multi-device CPU mesh."""
  if (mesh.devices.flat[0].platform == 'cpu' and mesh.size > 1
      and sync_every > CPU_MAX_SYNC_EVERY):
    raise ConfigError(
        f'config.train.sync_every={sync_every} on a {mesh.size}-device CPU mesh: '
        f"XLA's CPU collectives deadlock when ~30 steps are queued; use at most "
        f'{CPU_MAX_SYNC_EVERY}, or 0 (automatic: {CPU_SYNC_EVERY}).')
