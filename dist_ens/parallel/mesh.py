"""The ('member', 'data'[, 'model']) device mesh and the shardings of state and batches.

Members are split over the 'member' axis and every member's batch over 'data'.
Stacked state (every leaf [M, ...]) is sharded on its leading axis over 'member'
and replicated over 'data'; a batch [B, ...] is sharded over 'data' and replicated
over 'member'. With config.mesh.model > 1 a third axis, 'model', splits each
member's own leaves (dist_ens.parallel.layout decides which, per leaf); its devices
are neighbours (the innermost axis: within a host).
"""

import dataclasses
from collections.abc import Sequence

import jax
from absl import logging
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dist_ens.core.axes import DATA, MEMBER, MODEL
from dist_ens.errors import ConfigError

AXES = (MEMBER, DATA)
HOSTS_ALONG = ('member', 'data')


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """config.mesh: devices as member x data x model (-1 fills the rest), and which of
  member and data runs across processes in a multi-host run."""
  member: int
  data: int
  hosts_along: str = 'member'
  model: int = 1  # > 1: a third axis splitting each member's leaves (the layout's rule)


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def resolve_shape(member: int, data: int, num_devices: int, model: int = 1) -> tuple[int, int]:
  """Resolves -1 ('fill with the remaining devices') and checks the product;
  `num_devices` counts groups of `model` devices where model > 1."""
  for name, size in (('member', member), ('data', data)):
    if size != -1 and size < 1:
      raise ConfigError(f'config.mesh.{name}={size} must be a positive int or -1 (fill).')
  if member == -1 and data == -1:
    raise ConfigError('config.mesh.member and config.mesh.data are both -1; at most one '
                      'axis can fill the remaining devices (e.g. member=-1, data=1).')
  if member == -1 or data == -1:
    fixed, name = (data, 'data') if member == -1 else (member, 'member')
    if num_devices % fixed:
      raise ConfigError(
          f'config.mesh.{name}={fixed} does not divide the {num_devices} devices; use one '
          f'of {_divisors(num_devices)}.')
    other = num_devices // fixed
    member, data = (other, data) if member == -1 else (member, other)
  if member * data != num_devices:
    pairs = [(d, num_devices // d) for d in _divisors(num_devices)]
    groups = (f' (groups of mesh.model={model} devices)' if model > 1 else '')
    raise ConfigError(
        f'config.mesh.member x config.mesh.data = {member} x {data} = {member * data} '
        f'but {num_devices} devices{groups} are in use; use member x data in {pairs}, or -1 '
        'for one of them.')
  return member, data


def _usable_counts(devices: Sequence[jax.Device]) -> list[int]:
  """Device counts a mesh may use, largest first: the same number from every process.

  A process left without a device in the mesh could not feed or read its part
  of the run, so a mesh over n < all devices takes n / processes from each.
  """
  per_process = {}
  for d in devices:
    per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
  processes, local = len(per_process), min(per_process.values())
  return [k * processes for k in range(local, 0, -1)]


def fit_shape(member: int, data: int, devices: Sequence[jax.Device], num_members: int,
              batch_size: int) -> tuple[int, int]:
  """The mesh shape for a config with a -1 (fill) axis, fitted to M, the batch and the devices.

  The rule: an axis given as a number stays that number; a -1 axis takes the
  size that uses the most devices such that mesh.member divides num_members and
  mesh.data divides batch_size. With both -1, ties go to the larger 'member'
  (whole members per device need no collective in the step). All devices are
  used when any such shape can use them all; otherwise some stay idle (8
  members on 3 devices: member=2 on 2 of them), which the log line reports.

  Raises:
    ConfigError: when no shape works (a fixed axis that does not divide its
      quantity or exceeds the devices), naming the values that would.
  """
  for name, size in (('member', member), ('data', data)):
    if size != -1 and size < 1:
      raise ConfigError(f'config.mesh.{name}={size} must be a positive int or -1 (fill).')
  counts = _usable_counts(devices)
  choices = lambda size, total: _divisors(total) if size == -1 else [size]
  best = None
  for n in counts:
    for m in choices(member, num_members):
      for d in choices(data, batch_size):
        if m * d == n and num_members % m == 0 and batch_size % d == 0:
          best = max(best or (0, 0), (m, d))  # Same n: the larger member wins.
    if best:
      return best
  fixed, name, total, what = ((member, 'member', num_members, 'config.num_members')
                              if member != -1 else
                              (data, 'data', batch_size, 'config.data.batch_size'))
  fits = [x for x in _divisors(total) if any(c % x == 0 for c in counts)]
  raise ConfigError(
      f'no mesh fits config.mesh.{name}={fixed}: mesh.{name} must divide {what}={total} '
      f'and fit the {counts[0]} devices; use mesh.{name} in {fits}, or -1 to fit it.')


def idle_devices_message(spec: MeshSpec, mesh: Mesh, num_devices: int, num_members: int,
                         batch_size: int) -> str:
  """The warning for a fitted mesh that leaves devices idle, saying what to set: the
  member x data that uses them all where the axis the config fixes alone prevents one
  (M=4 on 8 devices with mesh.data=1: 4 x 2), else the num_members that does."""
  model = dict(mesh.shape).get(MODEL, 1)
  groups = num_devices // model
  full = [(m, groups // m) for m in _divisors(num_members)
          if groups % m == 0 and batch_size % (groups // m) == 0]
  idle = f'{num_devices - mesh.size} of {num_devices} devices stay idle'
  if full:
    name, size = ('data', spec.data) if spec.member == -1 else ('member', spec.member)
    m, d = max(full)  # Whole members per device first, as fit_shape prefers.
    return (f'{idle}: config.mesh.{name}={size} leaves no mesh over all of them for '
            f'num_members={num_members}; set mesh.member={m} and mesh.data={d} to use every '
            'device.')
  return (f'{idle}: no mesh over all of them divides config.num_members={num_members} (and '
          f'data.batch_size={batch_size}); num_members={-(-num_members // groups) * groups} '
          f'uses every device, or set mesh.member / mesh.data / mesh.model whose product is '
          f'{num_devices}.')


def make_mesh(spec: MeshSpec,
              devices: Sequence[jax.Device] | None = None, num_members: int | None = None,
              batch_size: int | None = None) -> Mesh:
  """Builds the ('member', 'data') mesh that `spec` describes.

  Given `num_members` and `batch_size`, a -1 axis is fitted to them and to the
  devices (see `fit_shape`: the mesh that uses the most devices with member
  dividing M and data dividing the batch; possibly fewer than all), and one
  INFO line says which mesh was chosen. Without them, or with no -1, the
  shape must use every device exactly (`resolve_shape`).

  Devices are ordered by (process, id) and laid out so that the axis named by
  `spec.hosts_along` varies slowest, i.e. runs across processes: with
  'member', each host holds whole members and the train step needs no
  cross-host collective.

  Example:
    make_mesh(MeshSpec(member=-1, data=1), jax.devices()[:3], num_members=8, batch_size=128)
    # member=-1, data=1 -> Mesh {'member': 2, 'data': 1} on 2 of the 3 devices.
  """
  devices = sorted(jax.devices() if devices is None else devices,
                   key=lambda d: (d.process_index, d.id))
  model = model_size(spec, len(devices))
  # Each group of `model` neighbouring devices holds one shard of a member; the
  # member x data grid is fitted over the groups, each stood for by its first device.
  groups = {g[0]: g for g in (devices[i:i + model] for i in range(0, len(devices), model))}
  devices = list(groups)
  member, data = int(spec.member), int(spec.data)
  if -1 in (member, data) and num_members is not None and batch_size is not None:
    member, data = fit_shape(member, data, devices, num_members, batch_size)
    idle = len(devices) - member * data
    # Debug here: the trainer logs the mesh once the config has passed every check.
    logging.debug('mesh member=%d x data=%d (config.mesh.member=%s, data=%s fitted to %d '
                 'members, batch %d) on %d of %d devices%s', member, data, spec.member,
                 spec.data, num_members, batch_size, member * data, len(devices),
                 f'; {idle} idle: no mesh over all of them divides the members and the batch'
                 if idle else '')
    devices = _take_evenly(devices, member * data)
  else:
    member, data = resolve_shape(member, data, len(devices), model)
  return _layout([groups[d] for d in devices], member, data, spec.hosts_along)


def model_size(spec: MeshSpec, num_devices: int) -> int:
  """config.mesh.model with -1 (fill: the devices member x data leaves) resolved; a
  size that divides the devices, so whole groups of neighbours form the axis."""
  model = spec.model
  if isinstance(model, bool) or not isinstance(model, int) or (model < 1 and model != -1):
    raise ConfigError(f'config.mesh.model={model!r} must be a positive int or -1 (fill).')
  if model == -1:
    if -1 in (spec.member, spec.data):
      raise ConfigError('config.mesh.model=-1 fills what member x data leaves, so both must be '
                        f'numbers; got member={spec.member}, data={spec.data}.')
    model = num_devices // max(spec.member * spec.data, 1)
  if model < 1 or num_devices % model:
    raise ConfigError(f'config.mesh.model={spec.model} must divide the {num_devices} devices; '
                      f'use one of {_divisors(num_devices)}.')
  return model


def _take_evenly(devices: list[jax.Device], n: int) -> list[jax.Device]:
  """The first n / processes devices of every process (devices sorted by process)."""
  processes = sorted({d.process_index for d in devices})
  per = n // len(processes)
  return [d for p in processes for d in [x for x in devices if x.process_index == p][:per]]


def _layout(groups: list[list[jax.Device]], member: int, data: int, hosts_along: str) -> Mesh:
  """The device groups (sorted by process, id) as a member x data grid, hosts_along
  varying slowest; a group of several devices adds the innermost axis, 'model'."""
  if hosts_along not in HOSTS_ALONG:
    raise ConfigError(f'config.mesh.hosts_along={hosts_along!r}; use one of {HOSTS_ALONG}.')
  model = len(groups[0])
  ordered = np.empty((len(groups), model), dtype=object)
  for i, group in enumerate(groups):
    ordered[i, :] = group
  if hosts_along == 'member':
    grid = ordered.reshape(member, data, model)
  else:
    grid = ordered.reshape(data, member, model).transpose(1, 0, 2)
  devices = [d for group in groups for d in group]
  processes = len({d.process_index for d in devices})
  across = member if hosts_along == 'member' else data
  if processes > 1 and across % processes:
    logging.warning('config.mesh.hosts_along=%r but mesh.%s=%d is not a multiple of the %d '
                    'processes, so the train step communicates across hosts; use mesh.%s a '
                    'multiple of %d.', hosts_along, hosts_along, across, processes,
                    hosts_along, processes)
  if model == 1:  # Two axes, the programs of a run without a model axis.
    return Mesh(grid[:, :, 0], AXES)
  spanning = groups_across_hosts(groups)
  if spanning:
    logging.warning('%d of %d mesh.model=%d device groups span processes %s...: their '
                    "members' per-layer collectives cross hosts (fine on a TPU slice's "
                    'inter-chip links, slow over a network); use a mesh.model that divides '
                    'the devices per host.', len(spanning), len(groups), model, spanning[0])
  return Mesh(grid, AXES + (MODEL,))


def groups_across_hosts(groups: Sequence[Sequence[jax.Device]]) -> list[list[int]]:
  """The process indices of each device group that spans more than one process."""
  out = []
  for group in groups:
    processes = sorted({d.process_index for d in group})
    if len(processes) > 1:
      out.append(processes)
  return out


def check_divisibility(mesh: Mesh, num_members: int, batch_size: int) -> None:
  """Members must split evenly over 'member' and every batch over 'data'."""
  m, d = mesh.shape[MEMBER], mesh.shape[DATA]
  if num_members % m:
    raise ConfigError(
        f'config.num_members={num_members} is not divisible by mesh.member={m}; use '
        f'num_members a multiple of {m} (e.g. {m * max(1, round(num_members / m))}), or a '
        f'mesh.member in {[x for x in _divisors(num_members) if mesh.size % x == 0]}.')
  if batch_size % d:
    raise ConfigError(
        f'config.data.batch_size={batch_size} is not divisible by mesh.data={d}; use a '
        f'batch size that is a multiple of {d} (e.g. {d * max(1, round(batch_size / d))}), '
        f'or a mesh.data in {[x for x in _divisors(batch_size) if mesh.size % x == 0]}.')


def member_sharding(mesh: Mesh) -> NamedSharding:
  """For stacked state: leading member axis over 'member', replicated over 'data'."""
  return NamedSharding(mesh, P(MEMBER))


def batch_sharding(mesh: Mesh, per_member: bool = False) -> NamedSharding:
  """For a batch shared by all members: batch axis over 'data'; `per_member`, for a
  batch per member ([M, B, ...]): members over 'member', each batch over 'data'."""
  return NamedSharding(mesh, P(MEMBER, DATA) if per_member else P(DATA))


def gather_members(outputs: jax.Array, member_mask: jax.Array, mesh: Mesh
                   ) -> tuple[jax.Array, jax.Array]:
  """Every member's outputs of one batch ([M, B, ...]) and the [M] member mask, inside a
  jitted evaluation, constrained to lie whole on every device (the batch over 'data').

  Metrics sum over members; with the members gathered first, each device sums them in one
  order, as one device does, and no collective sits inside a metric's loop (the regression
  mixture's bisection). An all-reduce over 'member' inside such a loop hung XLA:CPU's
  collectives at random: one device left the loop while the others waited in it. The mask
  is gathered too: split over 'member', it pulled the sums back to an all-reduce.
  """
  return jax.lax.with_sharding_constraint(
      (outputs, member_mask), (NamedSharding(mesh, P(None, DATA)), NamedSharding(mesh, P())))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
