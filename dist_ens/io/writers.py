"""What a run writes and logs: metrics.jsonl, TensorBoard events, final_metrics.json,
members.csv, tables and progress.

Only process 0 writes files; every process may log. Whole files are written
atomically (write, then rename) so an interrupted run never leaves a truncated one,
with the permissions the user's umask gives any new file (0644 under umask 022),
not tempfile's private 0600.

JSON files (final_metrics.json, config.json, metrics.jsonl) are strict JSON: a
non-finite float (NaN, inf; Python's or numpy's) is written as null, since the
NaN / Infinity tokens Python's json emits by default are not JSON and other readers
reject them. A member that diverged therefore reads back as None.

Event writers share one interface, `write(event)` / `close()`, where an event is
{'step': int, 'split': str, 'members': {name: [M floats]}, 'ensemble': {name: float},
...other numbers}; `MultiWriter` sends each event to several of them, and
`make_writer(['jsonl', 'csv', ...], workdir)` builds one from names: the built-ins
in `WRITERS`, or a user's class named by import path (see `make_writer`).
"""

import csv
import importlib
import importlib.util
import io
import json
import math
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from dist_ens.errors import ConfigError


def is_writer() -> bool:
  """Process 0 alone writes files, so hosts never race on a shared workdir."""
  return jax.process_index() == 0


def write_json(path: str | os.PathLike, obj: Any) -> None:
  """Writes `obj` as JSON to `path` atomically; no-op on processes other than 0."""
  if is_writer():
    _write_text_atomic(Path(path), _strict_json(obj, indent=2))


def _json_safe(obj: Any) -> Any:
  """`obj` with numpy values made Python ones and non-finite floats made None."""
  if isinstance(obj, dict):
    return {k: _json_safe(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_json_safe(v) for v in obj]
  if isinstance(obj, np.ndarray):
    return _json_safe(obj.tolist())
  if isinstance(obj, np.generic):
    obj = obj.item()
  if isinstance(obj, float) and not math.isfinite(obj):
    return None
  return obj


def _strict_json(obj: Any, **kwargs: Any) -> str:
  # allow_nan=False: a non-finite float that slipped past _json_safe fails loudly
  # here rather than producing a file other readers reject.
  return json.dumps(_json_safe(obj), allow_nan=False, **kwargs)


class JsonlWriter:
  """Appends one JSON object per line; each line is written whole with one write call.

  On resume from step N, events after N (written before an interruption, and about
  to be replayed) and any torn last line are dropped first, atomically.
  """

  def __init__(self, path: str | os.PathLike, keep_through_step: int | None = None):
    self._file = None
    if not is_writer():
      return
    path = Path(path)
    if keep_through_step is not None and path.exists():
      kept = []
      for line in path.read_text(encoding='utf-8').splitlines(keepends=True):
        try:
          event = json.loads(line)
        except json.JSONDecodeError:
          continue  # A line torn by a crash.
        if line.endswith('\n') and event.get('step', 0) <= keep_through_step:
          kept.append(line)
      _write_text_atomic(path, ''.join(kept))
    elif keep_through_step is None:
      _write_text_atomic(path, '')
    self._file = open(path, 'a', encoding='utf-8')

  def write(self, event: dict[str, Any]) -> None:
    if self._file is not None:
      self._file.write(_strict_json(event) + '\n')
      self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()


class EventWriter(Protocol):
  """What train.py writes events to (see the module docstring for the event format)."""

  def write(self, event: dict[str, Any]) -> None:
    ...

  def close(self) -> None:
    ...


class TensorBoardWriter:
  """Writes events as TensorBoard scalars and histograms (tensorboardX; no TensorFlow).

  Tags, for an event of split S at step N:
    member_{i}/S/{name}   each member's value of every 'members' metric,
    ensemble/S/{name}     every 'ensemble' metric,
    members/S/{name}      a histogram of the M member values (non-finite ones left out),
    S/{name}              any other top-level number (e.g. member_examples_per_s).

  On resume from step N (keep_through_step=N), TensorBoard is told to drop what
  the interrupted run wrote after N (a purge event, as TensorFlow writes on
  restart), mirroring JsonlWriter; a fresh run (None) drops everything before it.

  Example:
    writer = TensorBoardWriter('/tmp/run/tensorboard')
    writer.write({'step': 10, 'split': 'test', 'members': {'nll': [0.9, 1.1]},
                  'ensemble': {'nll': 0.8}})
    writer.close()  # then: tensorboard --logdir /tmp/run/tensorboard
  """

  def __init__(self, logdir: str | os.PathLike, keep_through_step: int | None = None):
    self._writer = None
    if not is_writer():
      return
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    purge_step = 0 if keep_through_step is None else keep_through_step + 1
    # tensorboardX names files by the second; a resume within the same second would
    # overwrite the previous file without a finer suffix.
    self._writer = SummaryWriter(str(logdir), purge_step=purge_step,
                                 filename_suffix=f'.{time.time_ns()}')

  def write(self, event: dict[str, Any]) -> None:
    if self._writer is None:
      return
    step, split = int(event['step']), event.get('split', 'train')
    for name, values in event.get('members', {}).items():
      values = np.asarray(values, np.float64)
      if values.ndim != 1:
        continue
      for i, value in enumerate(values):
        self._writer.add_scalar(f'member_{i}/{split}/{name}', value, step)
      finite = values[np.isfinite(values)]
      if finite.size:
        self._writer.add_histogram(f'members/{split}/{name}', finite, step)
    for name, value in event.get('ensemble', {}).items():
      if _is_number(value):
        self._writer.add_scalar(f'ensemble/{split}/{name}', value, step)
    for name, value in event.items():
      if name not in ('step', 'split', 'members', 'ensemble') and _is_number(value):
        self._writer.add_scalar(f'{split}/{name}', value, step)
    # Events come every log_every steps; flushing each keeps TensorBoard live.
    self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)


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


def flatten(event: dict[str, Any], prefix: str = '') -> dict[str, Any]:
  """An event's numbers and strings under '/'-joined names, 'step' and 'split' left out.

  Example:
    >>> flatten({'step': 1, 'split': 'test', 'members': {'nll': [0.5, 0.7]},
    ...          'ensemble': {'nll': 0.4}})
    {'members/nll/0': 0.5, 'members/nll/1': 0.7, 'ensemble/nll': 0.4}
  """
  flat = {}
  for key, value in event.items():
    if not prefix and key in ('step', 'split'):
      continue
    name = f'{prefix}{key}'
    if isinstance(value, np.ndarray):
      value = value.tolist()
    if isinstance(value, dict):
      flat.update(flatten(value, f'{name}/'))
    elif isinstance(value, (list, tuple)):
      flat.update(flatten({str(i): v for i, v in enumerate(value)}, f'{name}/'))
    elif isinstance(value, (str, bool, int, float, np.number, np.bool_)):
      flat[name] = value.item() if isinstance(value, np.generic) else value
  return flat


class CsvWriter:
  """One CSV file per split, `{directory}/{split}.csv`, one row per event.

  Columns are 'step' and then the event's values flattened by `flatten`
  (members/loss/0 .. members/loss/{M-1}, ensemble/nll, member_examples_per_s, ...).
  Splits carry different metrics, so each gets its own file, whose header is written
  from the split's first event. Should a later event of the split bring a column the
  header lacks, the file is rewritten (atomically) with that column appended, earlier
  rows leaving it empty; a column an event lacks is left empty. Floats are written in
  full precision; non-finite ones as nan / inf / -inf, which CSV readers such as
  pandas read back as floats.

  On resume from step N (keep_through_step=N), rows after N and a torn last row are
  dropped from every file first, as JsonlWriter does; a fresh run (None) deletes the
  directory's *.csv files.

  Example:
    writer = CsvWriter('/tmp/run/csv')
    writer.write({'step': 10, 'split': 'train', 'members': {'loss': [2.3, 2.4]}})
    writer.close()  # /tmp/run/csv/train.csv: step,members/loss/0,members/loss/1
  """

  def __init__(self, directory: str | os.PathLike, keep_through_step: int | None = None):
    self._dir = Path(directory)
    self._files: dict[str, Any] = {}  # split -> open file
    self._columns: dict[str, list[str]] = {}  # split -> header
    self._enabled = is_writer()
    if not self._enabled:
      return
    self._dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(self._dir.glob('*.csv')):
      if keep_through_step is None:
        path.unlink()
      else:
        _truncate_csv(path, keep_through_step)

  def write(self, event: dict[str, Any]) -> None:
    if not self._enabled:
      return
    split = str(event.get('split', 'train'))
    row = {'step': int(event['step']), **flatten(event)}
    if split not in self._files:
      self._open(split, list(row))
    new = [c for c in row if c not in self._columns[split]]
    if new:
      self._widen(split, new)
    columns = self._columns[split]
    # One write call per row, so a crash tears at most the last line.
    self._files[split].write(_csv_line([_csv_cell(row.get(c, '')) for c in columns]))
    self._files[split].flush()

  def close(self) -> None:
    for file in self._files.values():
      file.close()
    self._files.clear()

  def _path(self, split: str) -> Path:
    return self._dir / (re.sub(r'[^\w.-]', '_', split) + '.csv')

  def _open(self, split: str, columns: list[str]) -> None:
    path = self._path(split)
    existing = _read_csv(path)
    if existing:  # Resumed: carry on under the file's own header.
      self._columns[split] = existing[0]
    else:
      self._columns[split] = columns
      _write_text_atomic(path, _csv_line(columns))
    self._files[split] = open(path, 'a', encoding='utf-8', newline='')

  def _widen(self, split: str, new: list[str]) -> None:
    self._files.pop(split).close()
    path = self._path(split)
    header, *rows = _read_csv(path)
    self._columns[split] = header + new
    _write_text_atomic(path, _csv_line(header + new) + ''.join(
        _csv_line(r + [''] * len(new)) for r in rows))
    self._files[split] = open(path, 'a', encoding='utf-8', newline='')


def _csv_cell(value: Any) -> str:
  if isinstance(value, float):
    return repr(value)  # Shortest exact form; 'nan', 'inf', '-inf' when non-finite.
  return str(int(value)) if isinstance(value, bool) else str(value)


def _csv_line(cells: list[str]) -> str:
  buffer = io.StringIO()
  csv.writer(buffer, lineterminator='\n').writerow(cells)
  return buffer.getvalue()


def _read_csv(path: Path) -> list[list[str]]:
  """The header and complete rows of `path` ([] if missing); a torn last row is left out."""
  if not path.exists():
    return []
  lines = [l for l in path.read_text(encoding='utf-8').splitlines(keepends=True)
           if l.endswith('\n')]
  return list(csv.reader(lines))


def _truncate_csv(path: Path, keep_through_step: int) -> None:
  rows = _read_csv(path)
  if not rows:
    path.unlink(missing_ok=True)
    return
  header, *rows = rows
  kept = [r for r in rows if len(r) == len(header) and r[0].isdigit()
          and int(r[0]) <= keep_through_step]
  _write_text_atomic(path, ''.join(_csv_line(r) for r in [header] + kept))


class WandbWriter:
  """Logs events to Weights & Biases (optional: `pip install wandb`), under `workdir`.

  Each value of `flatten(event)` is logged as '{split}/{name}' (e.g. 'test/ensemble/nll',
  'train/members/loss/3') at the event's step. The run's files go to
  `{workdir}/wandb/`; with WANDB_MODE=offline nothing leaves the machine (upload later
  with `wandb sync {workdir}/wandb/offline-run-*`). The project is $WANDB_PROJECT, else
  'dist_ens'; the run is named after the workdir. wandb's console capture is off (the
  run's log stays as it is).

  On resume (keep_through_step not None) the run id saved in `{workdir}/wandb/run_id`
  is resumed, so online the curves continue in the same run. W&B cannot delete history:
  steps the interrupted run logged after the checkpoint are replayed with the same
  values (resumed training is bit-for-bit the uninterrupted one) and W&B ignores the
  repeats. A fresh run (None) starts a new W&B run.
  """

  def __init__(self, workdir: str | os.PathLike, keep_through_step: int | None = None):
    self._run = None
    if not is_writer():
      return
    wandb = _import_wandb()
    directory = Path(workdir) / 'wandb'
    directory.mkdir(parents=True, exist_ok=True)
    id_file = directory / 'run_id'
    resume = keep_through_step is not None and id_file.exists()
    run_id = id_file.read_text().strip() if resume else secrets.token_hex(4)
    if not resume:
      _write_text_atomic(id_file, run_id + '\n')
    self._run = wandb.init(
        project=os.environ.get('WANDB_PROJECT', 'dist_ens'), name=Path(workdir).resolve().name,
        id=run_id, resume='allow' if resume else None, dir=str(workdir),
        settings=wandb.Settings(console='off'))

  def write(self, event: dict[str, Any]) -> None:
    if self._run is None:
      return
    split = event.get('split', 'train')
    values = {f'{split}/{k}': v for k, v in flatten(event).items() if not isinstance(v, str)}
    self._run.log(values, step=int(event['step']))

  def close(self) -> None:
    if self._run is not None:
      self._run.finish()
      self._run = None


_WANDB_MISSING = ("config.writers names 'wandb' but the wandb package is not installed: "
                  "pip install wandb")


def _wandb_installed() -> bool:
  return importlib.util.find_spec('wandb') is not None


def _import_wandb() -> Any:
  if not _wandb_installed():
    raise ConfigError(_WANDB_MISSING)
  import wandb  # pylint: disable=g-import-not-at-top
  return wandb


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
      raise ConfigError(_WANDB_MISSING)
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


def _read_umask() -> int:
  # os.umask can only be read by setting it; set it straight back, once, at import
  # (before any thread of ours could create a file under the temporary mask).
  mask = os.umask(0o077)
  os.umask(mask)
  return mask


_FILE_MODE = 0o666 & ~_read_umask()


def _write_text_atomic(path: Path, text: str) -> None:
  with tempfile.NamedTemporaryFile('w', dir=path.parent, suffix='.tmp', delete=False,
                                   encoding='utf-8') as tmp:
    tmp.write(text)
    tmp.flush()
    # tempfile creates 0600; give the file what open() would have under the umask.
    os.fchmod(tmp.fileno(), _FILE_MODE)
    os.fsync(tmp.fileno())
  os.replace(tmp.name, path)


def write_members_csv(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
  """members.csv, atomically; process 0 only."""
  if not is_writer():
    return
  columns = list(rows[0])
  lines = [','.join(columns)]
  for row in rows:
    lines.append(','.join(f'{row[c]:.6g}' if isinstance(row[c], float) else str(row[c])
                          for c in columns))
  _write_text_atomic(Path(path), '\n'.join(lines) + '\n')
