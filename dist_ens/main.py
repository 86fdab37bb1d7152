"""Command line: dist-ens [train|plan|report] [flags]; `dist-ens COMMAND --help` lists the flags.

  dist-ens --config=configs/default.py --workdir=DIR [--config.a.b=value ...]   (train)
  dist-ens train ...                     the same
  dist-ens plan --config=FILE [--memory_gb=G] [--json] [--calibrate]   needs and speed (plan.py)
  dist-ens report --workdir=DIR          writes DIR/report/ (dist_ens/report/build.py)
  python -m dist_ens.main ...            the same as dist-ens

Training parses flags, starts jax.distributed when this is one process of several,
and hands over to training.train. Multi-process flags (see "Running on many hosts"
in README.md):

  --distributed               start jax.distributed; JAX detects SLURM, TPU pods, Open MPI
  --coordinator_address=H:P   \\
  --num_processes=N            > for any other launcher (e.g. launch/local.sh)
  --process_id=I              /

With none of them, jax.distributed starts only if a multi-process cluster job is
detected; --nodistributed never starts it.

A mistyped flag or config field, a value of the wrong type, or an invalid config
ends in one line on stderr ("dist-ens: error: ...") and a non-zero status.
"""

import functools
import logging as std_logging
import os
import signal
import sys
from collections.abc import Sequence

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from dist_ens import commands
from dist_ens.config import command_line

FLAGS = flags.FLAGS

# Libraries' INFO chatter that a normal run should not print (e.g. "Unable to
# initialize backend 'tpu'" on every CPU run); their warnings still show.
_QUIET_LOGGERS = ('jax._src.xla_bridge', 'jax._src.distributed', 'jax._src.clusters',
                  'asyncio', 'matplotlib', 'matplotlib.font_manager', 'PIL')
_HELP_ARGS = ('-h', '--help', '-?', '--helpshort', '--helpfull')


def _parse_flags(argv: list[str], prog: str) -> list[str]:
  """absl's flag parsing, with every error as one line and a non-zero exit."""
  try:
    rest = FLAGS(argv)
  except flags.Error as e:
    message = command_line.unknown_field_message(argv) or str(e)
  except (KeyError, AttributeError, TypeError, ValueError):
    # ml_collections raises these for an override of a field that does not exist.
    message = command_line.unknown_field_message(argv)
    if message is None:
      raise
  else:
    message = _config_problem(argv)
    if message is None:
      return rest
  message = ' '.join(message.split())  # absl joins several errors with newlines.
  sys.exit(f'{prog}: error: {message} (see {prog} --help)')


def _config_problem(argv: Sequence[str]) -> str | None:
  """After a successful parse: a config file that did not load, or a mistyped override."""
  if 'config' not in FLAGS:
    return None
  config = FLAGS.config
  if not isinstance(config, ml_collections.ConfigDict):
    # config_flags defers a load failure to the first use of the config.
    try:
      config.keys()
    except Exception as e:  # pylint: disable=broad-except
      reason = str(e).strip().splitlines()[-1].strip()  # The most specific line.
      return f'--config={config_flags.get_config_filename(FLAGS["config"])}: {reason}'
  return command_line.wrong_type_message(argv, config)


def _quiet_other_loggers() -> None:
  for name in _QUIET_LOGGERS:
    std_logging.getLogger(name).setLevel(std_logging.WARNING)


class Interrupted(KeyboardInterrupt):
  """SIGTERM or SIGINT outside the training loop (whose watcher saves and stops instead)."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def _stop_at_once(prog: str, signum: int, frame) -> None:
  # Exits from the handler itself rather than raising: an exception raised where the
  # signal lands (e.g. inside a garbage-collection callback) would print a traceback
  # and be ignored.
  del frame
  _exit_interrupted(prog, Interrupted(signum))


def _exit_interrupted(prog: str, error: KeyboardInterrupt) -> None:
  """One line and the conventional 128 + signal status, at once.

  os._exit: a stop outside the loop's save-and-stop (during start-up, or a second
  Ctrl-C) must not wait for background threads (input prefetch, checkpoint writes)
  or jax.distributed's shutdown barrier; the last complete checkpoint is kept.
  """
  signum = getattr(error, 'signum', signal.SIGINT)
  what = str(error) or signal.Signals(signum).name
  print(f'{prog}: stopped ({what}) without saving; rerunning the same command resumes from '
        'the last checkpoint, if any.', file=sys.stderr)
  for handler in std_logging.getLogger().handlers:
    handler.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(128 + signum)  # pylint: disable=protected-access


def entry(argv: Sequence[str] | None = None) -> None:
  """Console-script entry point: `dist-ens [train|plan|report] [flags]` (see the module doc)."""
  argv = list(sys.argv if argv is None else argv)
  rest = argv[1:]
  name = rest.pop(0) if rest and rest[0] in commands.COMMANDS else 'train'
  prog = 'dist-ens' if name == 'train' else f'dist-ens {name}'
  options = rest[:rest.index('--')] if '--' in rest else rest
  if any(a in _HELP_ARGS for a in options):
    commands.print_help(name, full='--helpfull' in options)
    sys.exit(0)
  # Before JAX starts a backend, which logs as it does.
  _quiet_other_loggers()
  # Until the training loop's watcher takes over (save, then stop): stop with one line.
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, functools.partial(_stop_at_once, prog))
  commands.COMMANDS[name].define_flags(FLAGS)
  # config_flags reads the --config.x overrides from sys.argv, without the command.
  sys.argv = [argv[0], *command_line.last_overrides(rest)]
  try:
    app.run(commands.COMMANDS[name].main, argv=sys.argv,
            flags_parser=lambda args: _parse_flags(args, prog))
  except KeyboardInterrupt as e:
    _exit_interrupted(prog, e)


if __name__ == '__main__':
  entry()
