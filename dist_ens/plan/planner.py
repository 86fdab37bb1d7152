"""dist-ens plan: the memory a run will need, per member, before it runs.

  dist-ens plan --config=configs/default.py [--config.num_members=64] [--memory_gb=16]
  dist-ens plan --config=... --calibrate   # first time the member forms here, cache the fastest
  python -m dist_ens.plan --config=...   (the same)

Builds the model, optimizer and train step of the config exactly as training
would, but abstractly (jax.eval_shape: no parameters are materialised, nothing
is trained), compiles the step for the config's mesh on the present devices, and
prints what XLA's memory analysis of the compiled step says: parameters and
state bytes per member, the step's argument / output / temporary bytes per
device, the bytes each member adds, and the largest M that fits a device memory.
It also prints the training FLOPs per example: XLA's cost analysis of the same
compiled train step (forward, backward and optimizer update) divided by the
member-examples one device processes in it. A data set this project ships configs
for needs no files on disk (KNOWN_SHAPES, KNOWN_TRAIN_EXAMPLES).

On a CPU, where the device's memory is the host's, XLA's analysis leaves out the compiled
programs and what the step's first execution allocates outside it, so plan measures
them in its own fresh process (dist_ens/plan/dry_run.py): it compiles the step and init
programs (program_bytes), initialises the state and runs two steps on zeros, and
predicts the peak it reached (dry_run_peak_bytes) for the run.

The step is compiled twice, for the config's members per device and for twice
that, because a device's memory is (fixed part) + (members on it) x (bytes per
member): the batch and XLA's fixed scratch do not grow with M, the state and
(with vmap) the activations do. The largest M is the largest multiple of
mesh.member whose per-device bytes fit the memory.
"""

import json
import math
import sys
from collections.abc import Sequence
from typing import NamedTuple

import jax
import ml_collections
from absl import flags
from ml_collections import config_flags

from dist_ens.config import specs
from dist_ens import data, tasks
from dist_ens.run import assemble
from dist_ens.config import checks, loading
from dist_ens.parallel import mesh as mesh_lib, placement
from dist_ens.plan import calibration, dry_run, sizes, stacks_plan
from dist_ens.plan.dry_run import StepMemory, step_memory
from dist_ens.errors import ConfigError
from dist_ens.io.tables import counted
from dist_ens.plan.text import FLOPS_MEASURED, GB, plan_lines


# Input shape and classes of TFDS datasets this project ships configs for, so that
# planning a run needs neither tensorflow-datasets nor the prepared data.
KNOWN_SHAPES: dict[str, tuple[tuple[int, ...], int]] = {
    'mnist': ((28, 28, 1), 10),
    'fashion_mnist': ((28, 28, 1), 10),
    'kmnist': ((28, 28, 1), 10),
    'cifar10': ((32, 32, 3), 10),
    'cifar100': ((32, 32, 3), 100),
    'svhn_cropped': ((32, 32, 3), 10),
}
# Their training split sizes, for train.epochs (TFDS's split info).
KNOWN_TRAIN_EXAMPLES: dict[str, int] = {
    'mnist': 60_000, 'fashion_mnist': 60_000, 'kmnist': 60_000, 'cifar10': 50_000,
    'cifar100': 50_000, 'svhn_cropped': 73_257,
}


class Plan(NamedTuple):
  """What `dist-ens plan` prints; every byte count is for one device unless named so."""
  num_members: int
  mesh_shape: dict[str, int]
  platform: str
  parallelism: str
  map_batch_size: int | None
  params_per_member: int
  state_bytes_per_member: int
  step: StepMemory  # At the config's members per device.
  step_doubled: StepMemory  # At twice as many members per device.
  bytes_per_member: float  # What one more member on a device adds to its peak.
  fixed_bytes: float  # Peak bytes that do not grow with members (>= 0).
  memory_bytes: float | None  # The device memory planned for (None: unknown).
  max_members: int | None  # Largest M (a multiple of mesh.member) that fits memory_bytes.
  # Training FLOPs of one member on one example (FLOPS_MEASURED); None if the
  # backend gives no cost analysis.
  flops_per_example: float | None
  train_steps: int  # train.steps, or train.epochs resolved against the data set's size
  steps_per_epoch: int | None  # None: the training split's size is not known here
  # CPU only (dist_ens/plan/dry_run.py; None on other platforms or where RSS cannot be read):
  # the RSS this process gained compiling the step and init programs, which XLA:CPU gives
  # no size for, and the peak RSS over the process's baseline that a dry run reached
  # (compile, init, two steps on zeros; None where it would not fit the host).
  program_bytes: int | None
  dry_run_peak_bytes: int | None
  # Predicted per device: the dry run's peak where there is one, else the step's peak +
  # its share of program_bytes (the devices of one process share its programs).
  peak_bytes: float
  # The train state on one device (params, optimizer and model state of its members'
  # shards, the layout's specs), and each parameter leaf's spec and bytes per device.
  state_bytes_per_device: int
  param_leaves: list[placement.LeafPlacement]

  def to_dict(self) -> dict:
    """The plan as JSON-able values (`dist-ens plan --json`): the step analyses
    become dicts with their peak bytes, and flops_measured says what the FLOPs count."""
    out = self._asdict()
    for name in ('step', 'step_doubled'):
      out[name] = {**out[name]._asdict(), 'peak': out[name].peak}
    out['flops_measured'] = FLOPS_MEASURED
    out['param_leaves'] = [{'path': p.path, 'shape': list(p.shape), 'spec': str(p.spec),
                            'bytes_per_device': p.bytes_per_device} for p in self.param_leaves]
    return out


def data_shape(config: ml_collections.ConfigDict) -> tuple[tuple[int, ...], int]:
  """(input shape without the batch axis, the model's outputs per example) of
  config.data.name, for config.task."""
  name = config.data.name
  if name in KNOWN_SHAPES and name not in data.SOURCES:
    return KNOWN_SHAPES[name]
  dataset = data.load_dataset(name, specs.data_spec(config))
  return tuple(dataset.input_shape), tasks.get_task(config.task).output_units(dataset)


def train_examples(config: ml_collections.ConfigDict) -> int | None:
  """Training examples of config.data.name after the validation split, if known without
  reading a TFDS data set (an embedded data set is loaded: it is small)."""
  name = config.data.name
  if name in data.SOURCES:
    total = data.load_dataset(name, specs.data_spec(config)).train.num_examples
  elif name in KNOWN_TRAIN_EXAMPLES:
    total = KNOWN_TRAIN_EXAMPLES[name]
  else:
    return None
  return total - config.data.validation_size


def _resolve_steps(config: ml_collections.ConfigDict
                   ) -> tuple[ml_collections.ConfigDict, int | None]:
  """(the config with train.epochs resolved, steps per epoch or None)."""
  examples = train_examples(config)
  if examples is None:
    if config.train.epochs:
      raise ConfigError(f'config.train.epochs={config.train.epochs} needs the size of '
                        f'{config.data.name!r}, which dist-ens plan does not know; plan with '
                        'train.epochs=0 (steps do not change memory or FLOPs).')
    return config, None
  return (checks.resolve_epochs(config, examples),
          checks.steps_per_epoch(config, examples))


def device_memory_bytes(device: jax.Device) -> float | None:
  """The memory a device reports (accelerators do; a CPU reports none)."""
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  # Not implemented on some backends.
    stats = None
  return float(stats['bytes_limit']) if stats and stats.get('bytes_limit') else None


def make_plan(config: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None,
              memory_bytes: float | None = None, measure_programs: bool = True
              ) -> Plan | stacks_plan.StacksPlan:
  """Compiles the config's train step abstractly and measures its memory (a run of
  several stacks: each stack's sizes and the joint step's memory, a StacksPlan).

  Args:
    config: a config like configs/default.py's.
    devices: the devices of the mesh (default: all).
    memory_bytes: the memory of one device to plan for; None uses what the
      device reports, if it reports anything.
    measure_programs: on a CPU (one process), measure the compiled programs and a dry
      run of the step in this process (dist_ens/plan/dry_run.py; meaningful in a fresh
      process: a reused heap makes a later measurement low).

  Raises:
    ConfigError: for an invalid config or a mesh that does not fit the devices.
  """
  loading.check_known_fields(config)
  checks.validate(config)
  config, per_epoch = _resolve_steps(config)
  input_shape, num_outputs = data_shape(config)
  run = assemble.build_run(config, devices=devices, shapes=(input_shape, num_outputs))
  parts, form, mesh = run.parts, run.form, run.parts.mesh
  if memory_bytes is None:
    memory_bytes = device_memory_bytes(mesh.devices.flat[0])
  batch = step_batch(config)
  if parts.places.joined:  # Each stack priced on its own, the joint step measured whole.
    return stacks_plan.make_stacks_plan(run, memory_bytes, batch, config.train.steps)
  shards = mesh.shape[mesh_lib.MEMBER]
  per_device = config.num_members // shards
  compiled, host = dry_run.compile_and_measure(parts, batch, form, measure_programs)
  step = step_memory(compiled, per_device)
  # The same form at twice the members ('auto' held fixed, so that the two compiles
  # differ only in M); the values of per-member hyperparameters do not change sizes.
  doubled = assemble.build_parts(config, mesh, input_shape, num_outputs,
                                 num_members=2 * config.num_members)
  step_doubled = step_memory(dry_run.compile_step(doubled, batch, form)[0], 2 * per_device)
  bytes_per_member = (step_doubled.peak - step.peak) / per_device
  # Below zero where the peak more than doubles from M to 2M (XLA chose other fusions):
  # the line then overstates the growth, and no part of the peak is fixed.
  fixed = max(0.0, step.peak - bytes_per_member * per_device)
  m = config.num_members
  params_per_member, state_bytes_per_member = sizes.per_member_sizes(parts.abstract_state, m)
  peak = _peak(step, host, len(mesh.local_devices))
  max_members = _max_members(memory_bytes, peak, bytes_per_member, per_device, shards)
  return Plan(
      num_members=m, mesh_shape=dict(mesh.shape), platform=mesh.devices.flat[0].platform,
      parallelism=form[0], map_batch_size=form[1], params_per_member=params_per_member,
      state_bytes_per_member=state_bytes_per_member, step=step, step_doubled=step_doubled,
      bytes_per_member=bytes_per_member, fixed_bytes=fixed, memory_bytes=memory_bytes,
      max_members=max_members,
      flops_per_example=sizes.flops_per_example(compiled, parts, batch, form),
      train_steps=config.train.steps, steps_per_epoch=per_epoch,
      program_bytes=host.programs if host else None,
      dry_run_peak_bytes=host.peak if host else None,
      peak_bytes=peak, **sizes.placement_of(parts))


def format_plan(plan: Plan | stacks_plan.StacksPlan, config: ml_collections.ConfigDict) -> str:
  """The plan of `config` as the lines `dist-ens plan` prints."""
  if isinstance(plan, stacks_plan.StacksPlan):
    return stacks_plan.stacks_plan_lines(plan, config.data.name, config.data.batch_size)
  return plan_lines(plan, f'{plan.num_members} x {config.model.name} on {config.data.name}, '
                    f'batch {config.data.batch_size} per member, optimizer {config.optim.name}')


def step_batch(config: ml_collections.ConfigDict) -> dry_run.StepBatch:
  """The batch the config's step takes: config.data.batch_size per member, one per member
  unless config.data.member_order is 'shared'."""
  return dry_run.StepBatch(config.data.batch_size, config.data.member_order != 'shared')


def _max_members(memory_bytes: float | None, peak: float, bytes_per_member: float,
                 per_device: int, shards: int) -> int | None:
  """The largest M whose peak (the line through M's peak with slope bytes_per_member)
  fits memory_bytes; None without a budget or a growth to extrapolate."""
  if memory_bytes is None or bytes_per_member <= 0:
    return None
  return max(0, math.floor((memory_bytes - peak + bytes_per_member * per_device)
                           / bytes_per_member)) * shards


def _peak(step: StepMemory, host: dry_run.HostMemory | None, devices: int) -> float:
  """Predicted peak bytes per device of this process's `devices`."""
  if host is None:
    return step.peak
  if host.peak is None:
    return step.peak + host.programs / devices
  return host.peak / devices


def calibrate(config: ml_collections.ConfigDict,
              devices: Sequence[jax.Device] | None = None) -> str:
  """Times every member form of the config's step on these devices, caches the fastest
  for 'auto' (dist_ens.plan.calibration) and returns the table it measured. With member
  several stacks, each stack's own step (its model, method and members per device) is timed
  and cached on its own: a run's joined step runs each stack in the form cached for it."""
  loading.check_known_fields(config)
  checks.validate(config)
  config, _ = _resolve_steps(config)
  parts = assemble.build_run(config, devices=devices, shapes=data_shape(config)).parts
  lines = []
  for stack in parts.stacks:
    best, seconds = calibration.calibrate(stack, config.data.batch_size,
                                          config.data.member_order != 'shared',
                                          stack.stack.model_name)
    fastest = min(seconds.values())
    per_device = counted(calibration.members_per_device(stack), 'member')
    name = stack.stack.name
    where = f'stack {name!r} ({stack.num_members} members), ' if name else ''
    lines.append(f'{where}calibrated on {stack.mesh.devices.flat[0].device_kind}, '
                 f'{per_device} per device (seconds per step, median of 3 rounds of 5):')
    lines += [f'  {calibration.label(form):<24} {s:10.5f}  {s / fastest:5.2f}x'
              + ('  <- cached for member_parallelism=auto' if form == best else '')
              for form, s in seconds.items()]
  return '\n'.join(lines + [f'cache: {calibration.cache_path()}'])


def main(argv: Sequence[str] | None = None) -> int:
  """Command line: `dist-ens plan --config=FILE [--config.x=y ...] [--memory_gb=G]`."""
  sys_argv = ['dist-ens plan', *(sys.argv[1:] if argv is None else argv)]
  flag_values = flags.FlagValues()
  config_holder = config_flags.DEFINE_config_file(
      'config', None, 'Config file, as for training; override fields with --config.x=y.',
      flag_values=flag_values, sys_argv=sys_argv, lock_config=True)
  memory_gb = flags.DEFINE_float(
      'memory_gb', None, 'Memory of one device in GB (1e9 bytes); default: what the device '
      'reports (accelerators), else none.', flag_values=flag_values)
  as_json = flags.DEFINE_bool('json', False, 'Print the plan as one JSON object.',
                              flag_values=flag_values)
  calibrate_flag = flags.DEFINE_bool(
      'calibrate', False, "First time every member form on these devices and cache the "
      "fastest for member_parallelism='auto'.", flag_values=flag_values)
  try:
    flag_values(sys_argv)
    if config_holder.value is None:
      raise flags.Error('--config=FILE is required.')
  except (flags.Error, ConfigError) as e:
    print(f'dist-ens plan: error: {e}\nusage: dist-ens plan --config=FILE '
          '[--config.field=value ...] [--memory_gb=G]', file=sys.stderr)
    return 2
  if memory_gb.value is not None and not memory_gb.value > 0:
    print(f'dist-ens plan: error: --memory_gb={memory_gb.value} must be > 0.', file=sys.stderr)
    return 2
  config = config_holder.value
  try:
    if calibrate_flag.value:
      print(calibrate(config))
    plan = make_plan(config, memory_bytes=memory_gb.value * GB if memory_gb.value else None,
                     measure_programs=not calibrate_flag.value)
  except ConfigError as e:
    print(f'dist-ens plan: error: {e}', file=sys.stderr)
    return 1
  print(json.dumps(plan.to_dict(), indent=2) if as_json.value else format_plan(plan, config))
  return 0

