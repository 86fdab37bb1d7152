"""The subcommands of `dist-ens` (train, plan, report): their flags and their mains.

dist_ens/main.py parses the command line and dispatches to COMMANDS; each main gets
absl's leftover argv after the flags (absl.flags.FLAGS) are parsed. Each main imports what
it runs (JAX, through training, plan or report) when it runs: --help, a flag or config
field refused while parsing, and a config whose fields' declarations refuse it
(config.loading.check_fields), answer without starting JAX.
"""

import contextlib
import json
import logging as std_logging
import os
import signal
import sys
import textwrap
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, NoReturn

import ml_collections
from absl import app, flags, logging

from dist_ens import importing
from dist_ens.config import command_line, loading
from dist_ens.io import console
from dist_ens.errors import AgreedConfigError, ConfigError, TrainingError
from dist_ens.parallel import launch, xla_flags

FLAGS = flags.FLAGS
GB = 1e9  # --memory_gb is in units of 1e9 bytes, as plan.py prints.


class Command(NamedTuple):
  """A subcommand: what it does, its flags, and its main (absl's main(argv))."""
  usage: str
  define_flags: Callable[[flags.FlagValues], None]
  main: Callable[[list[str]], None]


def _define_train_flags(fv: flags.FlagValues) -> None:
  command_line.define_config_flag(fv)
  flags.DEFINE_string('workdir', None, 'Directory for config, metrics, checkpoints and '
                      'results; rerunning with the same one resumes.', flag_values=fv)
  # None (neither --distributed nor --nodistributed): start it if a cluster is detected.
  flags.DEFINE_bool(
      'distributed', None, 'Start jax.distributed, letting JAX detect the cluster (SLURM, '
      'Cloud TPU, Open MPI) for what the flags below leave out. Default: only when '
      'explicit addresses are given or a multi-process cluster job is detected.',
      flag_values=fv)
  flags.DEFINE_string('coordinator_address', None,
                      'host:port of process 0, reachable from every process.', flag_values=fv)
  flags.DEFINE_integer('num_processes', None, 'Number of processes in the run.', flag_values=fv)
  flags.DEFINE_integer('process_id', None, 'This process, in 0..num_processes-1.',
                       flag_values=fv)
  flags.DEFINE_integer('init_timeout_s', launch.DEFAULT_INIT_TIMEOUT_S,
                       'Seconds to wait for every process to connect before giving up.',
                       flag_values=fv)
  flags.DEFINE_integer(
      'heartbeat_timeout_s', launch.DEFAULT_HEARTBEAT_TIMEOUT_S,
      'Seconds without a heartbeat after which a process counts as dead and the run stops.',
      flag_values=fv)
  flags.DEFINE_bool('verbose', False, "Also log the run's details (how each device runs its "
                    "members, steps per call of the compiled step, the input pipeline's "
                    "speed) with absl's prefix (level, time, source line) on every line.",
                    flag_values=fv)
  flags.mark_flags_as_required(['config', 'workdir'], flag_values=fv)


def _define_plan_flags(fv: flags.FlagValues) -> None:
  command_line.define_config_flag(fv)
  flags.DEFINE_float('memory_gb', None, 'Memory of ONE device in GB (1e9 bytes); default: '
                     'what the device reports (accelerators), else none.', flag_values=fv)
  flags.DEFINE_bool('json', False, 'Print the plan as one JSON object instead of a table.',
                    flag_values=fv)
  flags.DEFINE_bool('calibrate', False, "First time every member form on these devices and "
                    "cache the fastest for member_parallelism='auto'.", flag_values=fv)
  flags.mark_flag_as_required('config', flag_values=fv)


def _define_report_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string('workdir', None, 'The workdir of a finished run.', flag_values=fv)
  flags.mark_flag_as_required('workdir', flag_values=fv)


def _train_main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  _console_logging(FLAGS.verbose)
  flagged = launch.Launch(
      enabled=FLAGS.distributed, coordinator_address=FLAGS.coordinator_address,
      num_processes=FLAGS.num_processes, process_id=FLAGS.process_id,
      init_timeout_s=FLAGS.init_timeout_s, heartbeat_timeout_s=FLAGS.heartbeat_timeout_s)
  # Before JAX is imported, so that these answer at once: contradictory flags, a field the
  # config may not have, a value its field's declaration refuses (training checks the rest).
  try:
    launch.check(flagged)
    loading.check_fields(FLAGS.config)
  except ConfigError as e:
    sys.exit(f'dist-ens: error: {e}')
  from dist_ens.parallel import distributed  # pylint: disable=g-import-not-at-top
  from dist_ens.training import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  launched = False
  try:
    with contextlib.suppress(Exception):  # (a config that fails to load: training says so)
      if FLAGS.config.reproducible:
        xla_flags.set_flags()  # read by XLA when the backend starts, just below
    # Before anything else touches JAX: jax.distributed must precede the backend.
    launched = distributed.initialize(
        flagged, newest_step=lambda: workdir_lib.newest_intact_step(FLAGS.workdir))
    from dist_ens import training  # pylint: disable=g-import-not-at-top
    result = training.train(FLAGS.config, FLAGS.workdir)
    if result.get('preempted'):  # Saved, but not finished: `dist-ens ... && next` must stop.
      sys.exit(128 + signal.Signals[result['signal']])
    _say_where_things_went(FLAGS.workdir)
  except (ConfigError, TrainingError) as e:  # Expected failures: one clear line.
    if launched:
      logging.error('%s', e)  # In the log too, with this process's index.
      if isinstance(e, AgreedConfigError):
        distributed.exit_agreed(f'dist-ens: error: {e}')
      distributed.exit_without_barrier(f'dist-ens: error: {e}')
    sys.exit(f'dist-ens: error: {e}')
  except Exception as e:  # pylint: disable=broad-except
    if not launched and _user_code_field(e, FLAGS.config) is None:
      raise  # A dist_ens bug or a library's failure: its traceback is the report.
    _unexpected_failure(e, launched)


def _unexpected_failure(error: Exception, launched: bool) -> NoReturn:
  """Ends the process after an exception training did not expect: an error in the
  user's own code (its traceback, then one line naming the config field that imports
  it), another process of the run lost (one line), or else the traceback."""
  from dist_ens.parallel import distributed  # pylint: disable=g-import-not-at-top
  from dist_ens.training import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  field = _user_code_field(error, FLAGS.config)
  line = field and (f'dist-ens: error: the code {field} names raised {type(error).__name__}: '
                    f'{_first_line(error)} (its traceback is above).')
  if not launched:
    traceback.print_exception(error)
    sys.exit(line)
  # A normal exit would wait for the other processes, which wait for this one.
  lost = distributed.lost_process_line(error, workdir_lib.newest_intact_step(FLAGS.workdir))
  if lost is not None:
    distributed.exit_lost(lost)
  logging.exception('this process failed (where a collective failed, another process '
                    'probably failed first: see its log); stopping so the others stop too',
                    exc_info=error)
  distributed.exit_without_barrier(line or 1)


def _console_logging(verbose: bool) -> None:
  """INFO lines without absl's prefix; with --verbose, the run's details (logged at
  DEBUG) too, in absl's own format. Only absl's logger goes to DEBUG: under app.run
  absl sets Python's root logger to its verbosity, and JAX's DEBUG lines (every
  compile's cache keys) would drown ours."""
  logging.set_verbosity(logging.DEBUG if verbose else logging.INFO)
  std_logging.getLogger().setLevel(std_logging.INFO)
  std_logging.getLogger('absl').setLevel(std_logging.DEBUG if verbose else std_logging.INFO)
  if not verbose:
    logging.get_absl_handler().setFormatter(console.PlainFormatter())
  console.results_to_stdout(logging.get_absl_handler())  # The final tables; the rest: stderr.


def _say_where_things_went(workdir: str) -> None:
  from dist_ens.io import run_files  # pylint: disable=g-import-not-at-top
  if not run_files.is_writer():
    return
  names = ('final_metrics.json', 'members.csv', 'metrics.jsonl', 'csv', 'tensorboard',
           'checkpoints')
  found = [n + ('/' if (Path(workdir) / n).is_dir() else '') for n in names
           if (Path(workdir) / n).exists()]
  # A result, so stdout (console.RESULT says why); flushed after the tables.
  print(f'results in {workdir}: {", ".join(found)}; `dist-ens report --workdir={workdir}` '
        'draws the figures.', flush=True)


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return text.splitlines()[0][:300] if text else ''


def _import_paths(node, field: str = 'config'):
  """(field, value) for every import path ('pkg.module:attr') the config holds."""
  if isinstance(node, dict):
    for key, value in node.items():
      yield from _import_paths(value, f'{field}.{key}')
  elif isinstance(node, (list, tuple)):
    for value in node:
      yield from _import_paths(value, field)
  elif importing.is_import_path(node):
    yield field, node


def _user_code_field(error: BaseException, config) -> str | None:
  """The config field (as field='pkg.mod:f') whose import path leads to the code that
  raised `error`: a user's factory, loader, loss... None when dist_ens or a library
  raised it. dist_ens calls into the user's module first at the outermost of its
  frames; several fields naming one module are told apart by the function's name."""
  try:
    paths = list(_import_paths(loading.to_dict(config)))
  except Exception:  # pylint: disable=broad-except  # (a config that did not load)
    return None
  by_file: dict[str, list[tuple[str, str]]] = {}
  for field, value in paths:
    module_file = getattr(sys.modules.get(value.partition(':')[0]), '__file__', None)
    if module_file:
      by_file.setdefault(os.path.realpath(module_file), []).append((field, value))
  for frame, _ in traceback.walk_tb(error.__traceback__):
    named = by_file.get(os.path.realpath(frame.f_code.co_filename))
    if named:
      field, value = next((f for f in named if f[1].split('.')[-1].split(':')[-1] ==
                           frame.f_code.co_name), named[0])
      return f'{field}={value!r}'
  return None


def _plan_main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  memory_gb = FLAGS.memory_gb
  if memory_gb is not None and not memory_gb > 0:
    sys.exit(f'dist-ens plan: error: --memory_gb={memory_gb} must be > 0.')
  try:
    loading.check_fields(FLAGS.config)  # Before JAX is imported: a refused field answers at once.
    from dist_ens import plan  # pylint: disable=g-import-not-at-top
    if FLAGS.calibrate:
      print(plan.calibrate(FLAGS.config))
    p = plan.make_plan(FLAGS.config, memory_bytes=memory_gb * GB if memory_gb else None)
  except ConfigError as e:
    sys.exit(f'dist-ens plan: error: {e}')
  print(json.dumps(p.to_dict(), indent=2) if FLAGS.json else plan.format_plan(p, FLAGS.config))


def _report_main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  from dist_ens.report import data  # pylint: disable=g-import-not-at-top  (numpy only)
  try:  # A mistyped path answers before JAX is imported.
    data.check_workdir(Path(FLAGS.workdir))
    from dist_ens.report import build as report  # pylint: disable=g-import-not-at-top
    out = report.make_report(FLAGS.workdir)
  except (FileNotFoundError, ImportError, ConfigError) as e:
    sys.exit(f'dist-ens report: error: {e}')
  print(f'wrote {out / "report.md"} and its figures')


# The first argument picks one; anything else (a flag) means train.
COMMANDS: dict[str, Command] = {
    'train': Command('dist-ens [train] --config=FILE --workdir=DIR [--config.field=value ...]\n'
                     '  Trains the config\'s ensemble in DIR, resuming from its last checkpoint.',
                     _define_train_flags, _train_main),
    'plan': Command('dist-ens plan --config=FILE [--config.field=value ...] [--memory_gb=G] '
                    '[--json] [--calibrate]\n  Prints the memory the config\'s run needs per '
                    'device and the most members that fit, without training.',
                    _define_plan_flags, _plan_main),
    'report': Command('dist-ens report --workdir=DIR\n  Writes DIR/report/ from a finished '
                      'run: report.html (every table and figure in one file) and report.md, '
                      'with figures as PNG and SVG: reliability diagrams (the ensemble, its '
                      'best and worst member), every member\'s test accuracy, NLL and ECE '
                      'beside the ensemble\'s, learning curves, accuracy and NLL against '
                      'ensemble size; and, where the run has them, a hyperparameter sweep '
                      'scatter and a comparison of its prediction methods.',
                      _define_report_flags, _report_main),
}

# What each group of the config holds, for --help (a group without a line here
# is still listed, by name).
GROUP_HELP: dict[str, str] = {
    'mesh': 'how the devices are split between members, data and a model axis',
    'model': 'a built-in model or your own factory; pretrained weights (init_from)',
    'ensemble': 'the method (deep, batchensemble, ...), what members own (head, lora), vmap/map',
    'data': 'the dataset (built-in, UCI, TFDS or your loader), batch, orders, k-fold splits',
    'optim': 'optimizer, learning rate, schedule (per-member values and sweeps)',
    'train': 'steps, logging and evaluation cadence, micro-batches, steps per call',
    'checkpoint': 'how often to save and how many to keep',
    'select': 'keeping the best members by a validation metric',
    'eval': 'OOD data, shift, conformal sets, your metrics, MC dropout, temperature scaling',
    'pbt': 'population-based training over the members (exploit and explore)',
    'distill': 'after training, the ensemble distilled into one student (same, hydra, yours)',
}
_DEFAULT_CONFIG = loading.DEFAULT_CONFIG


def config_groups() -> list[str]:
  """The groups (sub-ConfigDicts) of the package's defaults."""
  config = loading.load_config(_DEFAULT_CONFIG)
  return [k for k, v in config.items() if isinstance(v, ml_collections.ConfigDict)]


def _print_config_groups() -> None:
  print('\nconfig groups (--config.GROUP.FIELD=value; top-level fields such as num_members '
        'too):')
  for group in config_groups():
    print(f'  {group:<11} {GROUP_HELP.get(group, "")}'.rstrip())
  print('Every field, its default and what it means: docs/config.md.')


def print_help(name: str, full: bool) -> None:
  fv = flags.FlagValues()
  COMMANDS[name].define_flags(fv)
  for line in f'usage: {COMMANDS[name].usage}'.splitlines():
    print(textwrap.fill(line, width=88, subsequent_indent='  '))
  print()
  print('flags:')
  defined = [f for module_flags in fv.flags_by_module_dict().values() for f in module_flags]
  for flag in sorted(defined, key=lambda f: f.name):
    spelt = f'--[no]{flag.name}' if flag.boolean else f'--{flag.name}'
    default = f' (default: {flag.default_as_str})' if flag.default is not None else ''
    print(textwrap.fill(f'{spelt}: {" ".join(flag.help.split())}{default}', width=88,
                        initial_indent='  ', subsequent_indent='      '))
  if 'config' in fv:
    _print_config_groups()
  if full:
    print('\nabsl flags (logging, debugging):')
    print(FLAGS.get_help(prefix='  ', include_special_flags=False))
  else:
    others = ', '.join(n for n in COMMANDS if n != name)
    print(f'\nOther commands: {others} (dist-ens COMMAND --help); --helpfull adds absl\'s '
          'logging flags.')
