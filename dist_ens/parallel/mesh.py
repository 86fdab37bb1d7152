"""The ('member', 'data') device mesh and the shardings of state and batches.

Members are split over the 'member' axis and every member's batch over 'data'.
Stacked state (every leaf [M, ...]) is sharded on its leading axis over 'member'
and replicated over 'data'; a batch [B, ...] is sharded over 'data' and replicated
over 'member'.
"""

from collections.abc import Sequence

import jax
import ml_collections
from absl import logging
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dist_ens.errors import ConfigError

MEMBER, DATA = 'member', 'data'
AXES = (MEMBER, DATA)
HOSTS_ALONG = ('member', 'data')


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def resolve_shape(member: int, data: int, num_devices: int) -> tuple[int, int]:
  """Resolves -1 ('fill with the remaining devices') and checks the product."""
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
    raise ConfigError(
        f'config.mesh.member x config.mesh.data = {member} x {data} = {member * data} '
        f'but {num_devices} devices are in use; use member x data in {pairs}, or -1 '
        'for one of them.')
  return member, data


def make_mesh(mesh_config: ml_collections.ConfigDict,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the ('member', 'data') mesh that `mesh_config` describes.

  Devices are ordered by (process, id) and laid out so that the axis named by
  `mesh_config.hosts_along` varies slowest, i.e. runs across processes: with
  'member', each host holds whole members and the train step needs no
  cross-host collective.
  """
  devices = list(jax.devices() if devices is None else devices)
  member, data = resolve_shape(int(mesh_config.member), int(mesh_config.data), len(devices))
  hosts_along = mesh_config.get('hosts_along', 'member')
  if hosts_along not in HOSTS_ALONG:
    raise ConfigError(f'config.mesh.hosts_along={hosts_along!r}; use one of {HOSTS_ALONG}.')
  ordered = np.array(sorted(devices, key=lambda d: (d.process_index, d.id)), dtype=object)
  if hosts_along == 'member':
    grid = ordered.reshape(member, data)
  else:
    grid = ordered.reshape(data, member).T
  processes = len({d.process_index for d in devices})
  across = member if hosts_along == 'member' else data
  if processes > 1 and across % processes:
    logging.warning('config.mesh.hosts_along=%r but mesh.%s=%d is not a multiple of the %d '
                    'processes, so the train step communicates across hosts; use mesh.%s a '
                    'multiple of %d.', hosts_along, hosts_along, across, processes,
                    hosts_along, processes)
  return Mesh(grid, AXES)


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


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """For a batch shared by all members: batch axis over 'data'."""
  return NamedSharding(mesh, P(DATA))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
