"""Command line: dist-ens --config=configs/default.py --workdir=DIR [--config.a.b=value ...]

Parses flags, starts jax.distributed when this is one process of several, and
hands over to train.run. Multi-process flags (see "Running on many hosts" in README.md):

  --distributed               start jax.distributed; JAX detects SLURM, TPU pods, Open MPI
  --coordinator_address=H:P   \
  --num_processes=N            > for any other launcher (e.g. launch/local.sh)
  --process_id=I              /

With none of them, jax.distributed starts only if a multi-process cluster job is
detected; --nodistributed never starts it.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from dist_ens.parallel import distributed
from dist_ens.training import run as train
from dist_ens.errors import ConfigError, TrainingError

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Config file (a .py whose get_config() returns a ConfigDict); '
    'override fields with --config.field=value.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for config, metrics and results.')
flags.mark_flags_as_required(['config', 'workdir'])

# None (neither --distributed nor --nodistributed) means: start it if a cluster is detected.
_DISTRIBUTED = flags.DEFINE_bool(
    'distributed', None, 'Start jax.distributed, letting JAX detect the cluster (SLURM, '
    'Cloud TPU, Open MPI) for what the flags below leave out. Default: only when '
    'explicit addresses are given or a multi-process cluster job is detected.')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', None, 'host:port of process 0, reachable from every process.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Number of processes in the run.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, in 0..num_processes-1.')
_INIT_TIMEOUT = flags.DEFINE_integer(
    'init_timeout_s', distributed.DEFAULT_INIT_TIMEOUT_S,
    'Seconds to wait for every process to connect before giving up.')
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    'heartbeat_timeout_s', distributed.DEFAULT_HEARTBEAT_TIMEOUT_S,
    'Seconds without a heartbeat after which a process counts as dead and the run stops.')


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.INFO)
  launched = False
  try:
    # Before anything else touches JAX: jax.distributed must precede the backend.
    launched = distributed.initialize(distributed.Launch(
        enabled=_DISTRIBUTED.value, coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value,
        init_timeout_s=_INIT_TIMEOUT.value, heartbeat_timeout_s=_HEARTBEAT_TIMEOUT.value))
    train.run(_CONFIG.value, _WORKDIR.value)
  except (ConfigError, TrainingError) as e:  # Expected failures: one clear line.
    logging.error('%s', e)
    if launched:
      distributed.exit_without_barrier(f'dist_ens: error: {e}')
    sys.exit(f'dist_ens: error: {e}')
  except Exception:  # pylint: disable=broad-except
    if not launched:
      raise
    # A normal exit would wait for the other processes, which wait for this one.
    logging.exception('this process failed (where a collective failed, another process '
                      'probably failed first: see its log); stopping so the others stop too')
    distributed.exit_without_barrier(1)


def entry() -> None:
  """Console-script entry point: `dist-ens --config=... --workdir=...` trains;
  `dist-ens report --workdir DIR` writes DIR/report/ (see dist_ens/io/report.py);
  `dist-ens plan --config=FILE [--memory_gb=G]` prints the memory a run needs (plan.py)."""
  if len(sys.argv) > 1 and sys.argv[1] == 'report':
    from dist_ens.io import report  # pylint: disable=g-import-not-at-top
    sys.exit(report.main(sys.argv[2:]))
  if len(sys.argv) > 1 and sys.argv[1] == 'plan':
    from dist_ens import plan  # pylint: disable=g-import-not-at-top
    sys.exit(plan.main(sys.argv[2:]))
  app.run(main)


if __name__ == '__main__':
  entry()
