"""Multi-process runs: starting jax.distributed, and stopping every process when one is lost.

`initialize` runs in main.py before anything touches a device (jax.distributed
must start before the backend does). It starts jax.distributed when asked
(--distributed, or explicit --coordinator_address/--num_processes/--process_id)
or when JAX's own cluster detection (SLURM, Cloud TPU pods, Open MPI, ...) finds
a job of more than one process, so a real cluster job and a test that fakes one
take the same code path.

That every process resolved the same config is checked in dist_ens.config.agreement.
"""

import logging as std_logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import jax
from absl import logging

from dist_ens.errors import ConfigError
from dist_ens.parallel import peer_watch
from dist_ens.parallel.launch import Launch, check as check_launch


def detected_cluster() -> tuple[str, int] | None:
  """(name, process count) of the cluster JAX's auto-detection would use, or None.

  Uses the same ClusterEnv classes, in the same order, as
  jax.distributed.initialize() with no arguments, so what is detected here is
  what JAX will bootstrap from.
  """
  from jax._src import clusters  # pylint: disable=g-import-not-at-top  (no public API)
  for env in clusters.ClusterEnv._cluster_types:  # pylint: disable=protected-access
    if not env.opt_in_only_method and env.is_env_present():
      return env.name, int(env.get_process_count())
  return None


def initialize(launch: Launch,
               newest_step: Callable[[], int | None] = lambda: None) -> bool:
  """Starts jax.distributed if `launch` asks for it or a cluster job is detected.

  Must run before any other JAX call that touches a device.

  Args:
    launch: the flags; see Launch.
    newest_step: the step a rerun would resume from, for the one line a process
      prints when the coordination service reports another process lost.

  Returns:
    Whether jax.distributed was started.

  Raises:
    ConfigError: for contradictory flags, when the flags leave something that
      cluster detection cannot fill in, or when a JAX backend already exists.
  """
  check_launch(launch)
  if launch.enabled is False:
    return False
  cluster = None
  if not launch.explicit or None in (launch.coordinator_address, launch.num_processes,
                                     launch.process_id):
    cluster = detected_cluster()
  if launch.enabled is None and not launch.explicit and (cluster is None or cluster[1] < 2):
    return False  # Nothing asked for and no multi-process job found: a plain run.
  if cluster is None:
    missing = [f'--{name}' for name in ('coordinator_address', 'num_processes', 'process_id')
               if getattr(launch, name) is None]
    if missing:
      raise ConfigError(
          f'a multi-process run needs {", ".join(missing)}: no cluster (SLURM, Cloud TPU, '
          'Open MPI) was detected to supply them. Pass all of --coordinator_address=HOST:PORT '
          '--num_processes=N --process_id=I, or run under srun / on a TPU pod.')
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top  (no public API)
  if xla_bridge.backends_are_initialized():
    raise ConfigError('jax.distributed must start before any JAX call that touches a '
                      'device, but a backend already exists; call distributed.initialize '
                      'first thing in the program.')
  source = f'detected {cluster[0]} job' if cluster else 'explicit flags'
  logging.info('starting jax.distributed (%s): coordinator %s, process %s of %s', source,
               launch.coordinator_address or 'auto', 'auto' if launch.process_id is None
               else launch.process_id, launch.num_processes or 'auto')
  jax.distributed.initialize(
      coordinator_address=launch.coordinator_address,
      num_processes=launch.num_processes,
      process_id=launch.process_id,
      initialization_timeout=launch.init_timeout_s,
      heartbeat_timeout_seconds=launch.heartbeat_timeout_s)
  _prefix_log_lines(jax.process_index())
  _watch_peers(launch.init_timeout_s, newest_step)
  logging.info('jax.distributed started: process %d of %d, %d local / %d global devices',
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def exit_without_barrier(status: int | str) -> NoReturn:
  """Ends this process at once, skipping jax.distributed's shutdown barrier.

  A normal exit waits at a barrier until every process arrives or 300 s pass
  (jax.distributed's shutdown timeout). After a failure in one process the others
  never arrive: they wait in a collective for it, and it waits for them. Exiting
  without the barrier closes this process's connections, so the others fail
  promptly: at once where the collective notices (CPU), else when process 0's
  coordination service misses this process's heartbeat (--heartbeat_timeout_s)
  and stops every process.

  The message is the last thing the process writes: one write(2) call, so no other
  thread's output splits it, and then stdout and stderr go to /dev/null, so that JAX's
  own report of the same failure (a C++ fatal error from its coordination client,
  racing this one when process 0 died) does not follow it with 20 lines.

  Args:
    status: exit code, or a message for stderr with exit code 1 (as sys.exit).
  """
  for handler in std_logging.getLogger().handlers:
    handler.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  if isinstance(status, str):
    os.write(2, (status + '\n').encode())  # The process's stderr, whatever sys.stderr is.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
  os._exit(status if isinstance(status, int) else 1)  # pylint: disable=protected-access


# What a collective or the coordination service raises in a process whose peer died or
# left (Gloo on CPUs; gRPC status names elsewhere).
_PEER_LOST_TEXTS = ('Connection reset by peer', 'Connection closed by peer', 'Broken pipe',
                    'Socket closed', 'heartbeat', 'UNAVAILABLE', 'coordination service',
                    'Gloo', 'DEADLINE_EXCEEDED')


def lost_process_line(error: BaseException, newest_step: int | None) -> str | None:
  """One line for a process whose run lost another process (killed, crashed or stopped
  by an error of its own) in a collective: which one, and the checkpoint a rerun resumes
  from; None if `error` is not about a lost peer. Replaces a 40-line traceback of Gloo
  or gRPC frames that says nothing a researcher can act on."""
  if jax.process_count() < 2 or not isinstance(error, jax.errors.JaxRuntimeError):
    return None
  text = str(error)
  if not any(lost in text for lost in _PEER_LOST_TEXTS):
    return None
  return _lost_line(jax.process_index(), jax.process_count(), None, text, newest_step)


def _watch_peers(timeout_s: float, newest_step: Callable[[], int | None]) -> None:
  """Starts peer_watch: a process that dies is reported at once, in one line."""
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  state = jax_distributed.global_state
  me, count = jax.process_index(), jax.process_count()
  host = state.coordinator_address.rsplit(':', 1)[0].strip('[]')

  def on_lost(peer: int, reason: str) -> None:
    exit_lost(_lost_line(me, count, [peer], reason, _safe(newest_step)))

  peer_watch.PeerWatch(state.client, me, count, host, on_lost, timeout_s).start()


def _safe(newest_step: Callable[[], int | None]) -> int | None:
  try:
    return newest_step()
  except Exception:  # pylint: disable=broad-except  # The line matters more than the step.
    return None


def exit_agreed(line: str, timeout_s: float = 120) -> NoReturn:
  """Ends this process with `line`, an error every process found (AgreedConfigError).

  Each process writes its line and then waits at a barrier until every process has
  written its own, and only then exits: the first to exit would otherwise close its
  connections while a peer is still on its way to the same line, and that peer would
  report "lost process 0" instead (its peer watch and JAX's coordination client both
  see the closed connections). Holding the peer watch's lock keeps its thread quiet.
  """
  peer_watch.hold_saying()
  os.write(2, (line + '\n').encode())
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  try:
    jax_distributed.global_state.client.wait_at_barrier(
        'dist_ens/agreed_error', int(timeout_s * 1000))
  except Exception:  # pylint: disable=broad-except  # A peer already gone: the line stands.
    pass
  peer_watch.say_bye_now()
  exit_without_barrier(1)


def exit_lost(line: str) -> NoReturn:
  """Ends this process with `line` (from lost_process_line), once: a collective that
  failed and the peer watch may both see the same loss."""
  peer_watch.say_once_and_exit(line, exit_without_barrier)


def _lost_line(me: int, count: int, lost: list[int] | None, reason: str,
               newest_step: int | None) -> str:
  if not lost and count == 2:
    lost = [1 - me]  # With two processes the lost one is the other.
  who = (f'process {", ".join(map(str, lost))}' if lost else
         'another process')  # Its own log says which.
  resume = (f'the newest intact checkpoint is at step {newest_step}: rerun the same command '
            'on every process to resume from it' if newest_step is not None else
            'no checkpoint was saved yet: rerun the same command to start again')
  reason = ' '.join(reason.split())[:200]
  return (f'dist-ens: error: [process {me}] lost {who} of {count} (it died or stopped; see '
          f'its log): {reason}; {resume}.')


class _ProcessPrefix(std_logging.Filter):
  """Prefixes log messages with '[process i] ' unless they already carry it."""

  def __init__(self, index: int):
    super().__init__()
    self._prefix = f'[process {index}] '

  def filter(self, record: std_logging.LogRecord) -> bool:
    message = record.getMessage()
    if not message.startswith('[process '):
      record.msg, record.args = self._prefix + message, None
    return True


def _prefix_log_lines(index: int) -> None:
  """Every log line through absl's handler (absl and std logging alike) names its process.

  train.run's own lines already start with '[process i] '; this covers the rest
  (warnings from other modules, JAX's Python logging).
  """
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _ProcessPrefix) for f in handler.filters):
    handler.addFilter(_ProcessPrefix(index))
