"""Event writers to plain files: metrics.jsonl (`JsonlWriter`) and csv/{split}.csv
(`CsvWriter`), written by process 0 only.

On resume from step N, both drop what an interrupted run wrote after N (about to be
replayed) and any line a crash tore, atomically, before appending.
"""

import csv
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from dist_ens.io.run_files import is_writer, strict_json, write_text_atomic


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
    if keep_through_step is None:
      write_text_atomic(path, '')
    elif path.exists():
      _truncate_jsonl(path, keep_through_step)
    self._file = open(path, 'a', encoding='utf-8')

  def write(self, event: dict[str, Any]) -> None:
    if self._file is not None:
      self._file.write(strict_json(event) + '\n')
      self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()


def _truncate_jsonl(path: Path, keep_through_step: int) -> None:
  kept = []
  for line in path.read_text(encoding='utf-8').splitlines(keepends=True):
    try:
      event = json.loads(line)
    except json.JSONDecodeError:
      continue  # A line torn by a crash.
    if line.endswith('\n') and event.get('step', 0) <= keep_through_step:
      kept.append(line)
  write_text_atomic(path, ''.join(kept))


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
      write_text_atomic(path, _csv_line(columns))
    self._files[split] = _append(path)

  def _widen(self, split: str, new: list[str]) -> None:
    self._files.pop(split).close()
    path = self._path(split)
    header, *rows = _read_csv(path)
    self._columns[split] = header + new
    write_text_atomic(path, _csv_line(header + new) + ''.join(
        _csv_line(r + [''] * len(new)) for r in rows))
    self._files[split] = _append(path)


def _append(path: Path) -> Any:
  return open(path, 'a', encoding='utf-8', newline='')


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
  write_text_atomic(path, ''.join(_csv_line(r) for r in [header] + kept))
