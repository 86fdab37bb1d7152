"""How this process was asked to join a multi-process run: the launch flags' values, their
defaults and the combinations that cannot work. Without JAX, so the command line refuses
contradictory flags at once; parallel/distributed.py starts the run from a Launch.
"""

import dataclasses

from dist_ens.errors import ConfigError

# How long process 0's coordination service waits without a heartbeat before it
# declares a process dead and tells the others to stop. JAX's default is 100 s;
# 30 s stops a job with a dead host sooner while leaving slack for a busy host
# (heartbeats come from a separate thread, not from the train loop).
DEFAULT_HEARTBEAT_TIMEOUT_S = 30
# How long a process waits for all the others to connect at start-up. Nodes of a
# cluster job can start minutes apart, so this stays at JAX's default.
DEFAULT_INIT_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Launch:
  """How this process joins a multi-process run (main.py's flags).

  Attributes:
    enabled: True to start jax.distributed, False never to, None to start it only
      when explicit addresses are given or a multi-process cluster is detected.
    coordinator_address: 'host:port' of process 0; None lets JAX detect it.
    num_processes: number of processes; None lets JAX detect it.
    process_id: this process's index in [0, num_processes); None lets JAX detect it.
    init_timeout_s: seconds to wait for every process to connect.
    heartbeat_timeout_s: seconds without a heartbeat after which a process is
      declared dead and the others stop.
  """
  enabled: bool | None = None
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S
  heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S

  @property
  def explicit(self) -> bool:
    return any(v is not None for v in (self.coordinator_address, self.num_processes,
                                        self.process_id))


def check(launch: Launch) -> None:
  """Flag combinations that cannot work fail here, before any waiting."""
  if launch.enabled is False and launch.explicit:
    raise ConfigError('--nodistributed was given together with --coordinator_address/'
                      '--num_processes/--process_id; drop --nodistributed to run as one of '
                      'several processes, or drop the others to run alone.')
  if launch.num_processes is not None and launch.num_processes < 1:
    raise ConfigError(f'--num_processes={launch.num_processes} must be >= 1.')
  if launch.process_id is not None and launch.process_id < 0:
    raise ConfigError(f'--process_id={launch.process_id} must be >= 0.')
  if (launch.num_processes is not None and launch.process_id is not None
      and launch.process_id >= launch.num_processes):
    raise ConfigError(f'--process_id={launch.process_id} must be below '
                      f'--num_processes={launch.num_processes} (use 0..'
                      f'{launch.num_processes - 1}).')
  for name in ('init_timeout_s', 'heartbeat_timeout_s'):
    if getattr(launch, name) < 1:
      raise ConfigError(f'--{name}={getattr(launch, name)} must be >= 1 second.')
