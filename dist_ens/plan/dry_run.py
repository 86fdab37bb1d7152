"""The train step as `dist-ens plan` compiles it, XLA's memory analysis of it
(StepMemory) and, on a CPU, a dry run of it (HostMemory).

XLA's memory analysis counts a step's arguments, outputs and temporaries. On a CPU the
device's memory is the host's, and a run also holds what that analysis leaves out: the
compiled programs (XLA:CPU gives no size for them) and what the first execution
allocates outside XLA's buffer assignment (its YNNPACK dot fusions). Nothing predicts
those from the program, so plan measures them: `dry_run` compiles the step and init
programs, initialises the state and runs two steps on zeros, as a run does, and reads
the peak resident memory this process reached over its baseline.
"""

import gc
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dist_ens.run import assemble, initial_state
from dist_ens.plan import host_memory
from dist_ens.errors import ConfigError
from dist_ens.parallel import mesh as mesh_lib

# A dry run only where its predicted peak (XLA's step peak + the programs) takes at most
# this share of the host's available memory, so that planning a run too big for the host
# reports it instead of running out of memory.
HOST_SHARE = 0.5
STEPS = 2  # The first execution allocates beyond XLA's peak; the second shows it is kept.


class StepMemory(NamedTuple):
  """XLA's memory analysis of one compiled train step, bytes per device."""
  members_per_device: int
  argument: int
  output: int
  alias: int  # Outputs that reuse donated argument buffers (the state).
  temp: int

  @property
  def peak(self) -> int:
    """Bytes live during the step: arguments, new outputs and temporaries."""
    return self.argument + self.output - self.alias + self.temp


def step_memory(compiled, members_per_device: int) -> StepMemory:
  """XLA's memory analysis of a compiled step (ConfigError where the backend has none)."""
  stats = compiled.memory_analysis()
  if stats is None:
    raise ConfigError('this backend gives no memory analysis of a compiled program; '
                      'dist-ens plan cannot measure the step here.')
  return StepMemory(members_per_device, int(stats.argument_size_in_bytes),
                    int(stats.output_size_in_bytes), int(stats.alias_size_in_bytes),
                    int(stats.temp_size_in_bytes))


class HostMemory(NamedTuple):
  """What a dry run measured on a CPU, bytes of this process (all its devices)."""
  programs: int  # Resident memory that compiling the step and init programs added.
  peak: int | None  # Peak resident memory over the baseline through compile, init and
  # STEPS steps; None where the dry run was not run (it would not fit HOST_SHARE).


class StepBatch(NamedTuple):
  """What a run's step takes: `size` examples per member, one batch or (`per_member`:
  any member order but 'shared') one per member."""
  size: int
  per_member: bool


def step_arguments(parts: assemble.Parts, batch: StepBatch, uses_index: bool) -> tuple:
  """The step's abstract arguments (state, hparams, x, y[, index]), sharded as in a run."""
  mesh, num_members, per_member = parts.mesh, parts.num_members, batch.per_member
  lead = (num_members, batch.size) if per_member else (batch.size,)
  x_shape, y_shape = (*lead, *parts.input_shape), lead
  batch_sharding = mesh_lib.batch_sharding(mesh, per_member)
  x = jax.ShapeDtypeStruct(x_shape, jnp.float32, sharding=batch_sharding)
  y = jax.ShapeDtypeStruct(y_shape, jnp.int32, sharding=batch_sharding)
  member_sharding = mesh_lib.member_sharding(mesh)

  def hparams_of(p: assemble.Parts) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct((p.num_members,), jnp.float32, sharding=member_sharding)
            for k in p.hparams}

  # The step takes each stack's hyperparameters (Parts.device_hparams).
  hparams = parts.places.join_tree([hparams_of(one) for one in parts.stacks])
  # With augmentation the step also takes the examples' indices (int32, shaped like y).
  index = (jax.ShapeDtypeStruct(y_shape, jnp.int32, sharding=batch_sharding),)
  return (parts.abstract_state, hparams, x, y, *(index if uses_index else ()))


def compile_step(parts: assemble.Parts, batch: StepBatch,
                 form) -> tuple[jax.stages.Compiled, tuple]:
  """(the train step for `parts`, compiled abstractly (nothing is materialised), its
  abstract arguments)."""
  step = assemble.build_step(parts, per_member_batches=batch.per_member, form=form)
  args = step_arguments(parts, batch, step.uses_index)
  return step.fn.lower(*args).compile(), args


def compile_and_measure(parts: assemble.Parts, batch: StepBatch, form,
                        measure: bool) -> tuple[jax.stages.Compiled, HostMemory | None]:
  """(the compiled step, a dry run's HostMemory where `measure` and the mesh is one
  process's CPU devices, else None)."""
  on_cpu = parts.mesh.devices.flat[0].platform == 'cpu'
  if measure and on_cpu and jax.process_count() == 1:
    return dry_run(parts, batch, form)
  return compile_step(parts, batch, form)[0], None


def dry_run(parts: assemble.Parts, batch: StepBatch, form) -> tuple[jax.stages.Compiled, HostMemory | None]:
  """(the compiled step, what running it took on this CPU host; None where resident
  memory cannot be read). Meaningful in a fresh process: a heap that earlier work left
  free is reused, and the growth then reads low."""
  jax.block_until_ready(jax.jit(lambda v: v + 1)(jnp.zeros(8)))  # XLA's one-time set-up.
  gc.collect()
  base = host_memory.status_bytes()
  if base is None or not host_memory.reset_peak():
    return compile_step(parts, batch, form)[0], None
  compiled, args = compile_step(parts, batch, form)
  init = initial_state.compile_init(parts)
  gc.collect()
  programs = max(0, host_memory.status_bytes() - base)
  if not _fits(compiled, programs, len(parts.mesh.local_devices)):
    return compiled, HostMemory(programs, None)
  _run(compiled, init, parts, args[2:])
  return compiled, HostMemory(programs, max(0, host_memory.status_bytes('VmHWM') - base))


def _fits(compiled, programs: int, devices: int) -> bool:
  """Whether the programs and every device's step peak fit HOST_SHARE of what is free."""
  peak = step_memory(compiled, 0).peak
  available = host_memory.available_bytes()
  return available is not None and programs + devices * peak <= HOST_SHARE * available


def _run(compiled, init, parts: assemble.Parts, batch_shapes) -> None:
  """STEPS steps of `compiled` from the initial state on zeros; every buffer is freed."""
  state = init()
  hparams = parts.device_hparams()
  batch = [jax.device_put(np.zeros(s.shape, s.dtype), s.sharding) for s in batch_shapes]
  for _ in range(STEPS):
    state, metrics = compiled(state, hparams, *batch)
    jax.block_until_ready(metrics)
  del state, metrics, batch
  gc.collect()
