"""Where a run's events go: `make_writer(['jsonl', 'csv', ...], workdir)`.

Event writers share one interface, `write(event)` / `close()`, where an event is
{'step': int, 'split': str, 'members': {name: [M floats]}, 'ensemble': {name: float},
...other numbers}; `MultiWriter` sends each event to several of them, and
`make_writer` builds one from names: the built-ins in `WRITERS`, or a user's class
named by import path (see `make_writer`).

The writers themselves live beside this module: file_sinks (jsonl, csv),
tensorboard_writer, wandb_writer; the whole files a run writes (final_metrics.json,
members.csv) in run_files. Only process 0 writes files.
"""

import importlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from dist_ens.errors import ConfigError
from dist_ens.io.file_sinks import CsvWriter, JsonlWriter
from dist_ens.io.run_files import is_writer
from dist_ens.io.tensorboard_writer import TensorBoardWriter
from dist_ens.io.wandb_writer import WANDB_MISSING, WandbWriter, wandb_installed

# Looked up at call time, so a test can make wandb look missing where it is installed.
_wandb_installed = wandb_installed


class EventWriter(Protocol):
  """What train.py writes events to (see the module docstring for the event format)."""

  def write(self, event: dict[str, Any]) -> None:
    ...

  def close(self) -> None:
    ...


class MultiWriter:
  """Sends every event to each of `writers`, e.g. JSONL and TensorBoard.

  Example:
    writer = MultiWriter(JsonlWriter(workdir / 'metrics.jsonl'),
                         TensorBoardWriter(workdir / 'tensorboard'))
    writer.write({'step': 1, 'split': 'train', 'members': {'loss': [2.3, 2.4]}})
    writer.close()
  """

  def __init__(self, *writers: EventWriter):
    self._writers = writers

  def write(self, event: dict[str, Any]) -> None:
    for writer in self._writers:
      writer.write(event)

  @property
  def writers(self) -> tuple[EventWriter, ...]:
    return self._writers

  def close(self) -> None:
    """Closes every writer, even if one fails to close (the first error is raised)."""
    error = None
    for writer in self._writers:
      try:
        writer.close()
      except Exception as e:  # pylint: disable=broad-except
        error = error or e
    if error is not None:
      raise error


WriterFactory = Callable[..., EventWriter]

# Built-in writers by name; each is called as factory(workdir=..., keep_through_step=...).
WRITERS: dict[str, WriterFactory] = {
    'jsonl': lambda workdir, keep_through_step: JsonlWriter(
        Path(workdir) / 'metrics.jsonl', keep_through_step),
    'csv': lambda workdir, keep_through_step: CsvWriter(
        Path(workdir) / 'csv', keep_through_step),
    'tensorboard': lambda workdir, keep_through_step: TensorBoardWriter(
        Path(workdir) / 'tensorboard', keep_through_step),
    'wandb': WandbWriter,
}


def make_writer(names: Sequence[str] | str, workdir: str | os.PathLike,
                keep_through_step: int | None = None) -> MultiWriter:
  """One writer sending every event to each writer `names` lists (config.writers).

  Names are the built-ins of `WRITERS`:
    'jsonl'        {workdir}/metrics.jsonl, one JSON object per event;
    'csv'          {workdir}/csv/{split}.csv, one row per event (`CsvWriter`);
    'tensorboard'  {workdir}/tensorboard/ (`TensorBoardWriter`);
    'wandb'        Weights & Biases, files in {workdir}/wandb/ (`WandbWriter`; needs
                   `pip install wandb`; WANDB_MODE=offline keeps it local);
  or a user's class by import path, 'my_pkg.module:MyWriter', constructed as
  `MyWriter(workdir=pathlib.Path, keep_through_step=int | None)` on process 0 only. Its
  instances need `write(event: dict)` (an event as in the module docstring; called on
  process 0 after every log and evaluation) and `close()` (called once at the end, also
  after an error). keep_through_step is None for a fresh run, or the step a resumed
  run restarts from: events after it were written by the interrupted run and are about
  to be written again, so a writer that can should drop them.

  Example:
    writer = make_writer(['jsonl', 'csv', 'my_pkg.sinks:SlackWriter'], '/tmp/run')
    writer.write({'step': 10, 'split': 'train', 'members': {'loss': [2.3, 2.4]}})
    writer.close()

  Args:
    names: writer names, as a sequence or one comma-separated string; repeats count once.
    workdir: the run's directory.
    keep_through_step: None for a fresh run; on resume, the checkpoint's step.

  Returns:
    A MultiWriter over the named writers, in the order named (none on processes other
    than 0, which write no files).

  Raises:
    ConfigError: naming config.writers, for an unknown name, an import path that does
      not import, or 'wandb' when wandb is not installed (checked on every process).
  """
  names = check_writer_names(names)
  factories = [_writer_factory(name) for name in names]
  if not is_writer():
    return MultiWriter()
  Path(workdir).mkdir(parents=True, exist_ok=True)
  made = []
  for name, factory in zip(names, factories):
    writer = factory(workdir=Path(workdir), keep_through_step=keep_through_step)
    if not (callable(getattr(writer, 'write', None)) and callable(getattr(writer, 'close', None))):
      raise ConfigError(f'config.writers: {name!r} made a {type(writer).__name__}, which lacks '
                        'write(event) or close().')
    made.append(writer)
  return MultiWriter(*made)


def check_writer_names(names: Sequence[str] | str) -> list[str]:
  """The distinct writer names (config.writers), each checked to stand for a writer.

  Raises:
    ConfigError: as make_writer does; nothing is created or written.
  """
  if isinstance(names, str):
    names = names.split(',')
  names = list(dict.fromkeys(n.strip() for n in names if n.strip()))
  for name in names:
    _writer_factory(name)
  return names


def _writer_factory(name: str) -> WriterFactory:
  """The constructor `name` stands for; ConfigError if there is none."""
  if name in WRITERS:
    if name == 'wandb' and not _wandb_installed():
      raise ConfigError(WANDB_MISSING)
    return WRITERS[name]
  valid = ', '.join(repr(n) for n in WRITERS)
  if ':' not in name:
    raise ConfigError(f'config.writers: unknown writer {name!r}; valid names are {valid}, or '
                      "a class by import path such as 'my_pkg.module:MyWriter'.")
  module_name, _, attr = name.partition(':')
  try:
    obj = importlib.import_module(module_name)
    for part in attr.split('.'):
      obj = getattr(obj, part)
  except (ImportError, AttributeError, ValueError) as e:
    raise ConfigError(f'config.writers: cannot load writer {name!r} ({e}); valid names are '
                      f"{valid}, or a class by import path such as 'my_pkg.module:MyWriter'."
                      ) from None
  if not callable(obj):
    raise ConfigError(f'config.writers: {name!r} is not a class (nor callable).')
  return obj
