"""Command line: dist-ens --config=configs/default.py --workdir=DIR [--config.a.b=value ...]

Only parses flags and hands over to train.run.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from dist_ens import train
from dist_ens.errors import ConfigError

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Config file (a .py whose get_config() returns a ConfigDict); '
    'override fields with --config.field=value.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for config, metrics and results.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.INFO)
  try:
    train.run(_CONFIG.value, _WORKDIR.value)
  except ConfigError as e:
    logging.error('%s', e)
    sys.exit(f'dist_ens: error: {e}')


def entry() -> None:
  """Console-script entry point (`dist-ens`)."""
  app.run(main)


if __name__ == '__main__':
  entry()
