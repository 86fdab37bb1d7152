"""What a run writes and logs: metrics.jsonl, TensorBoard events, final_metrics.json,
members.csv, tables and progress.

Only process 0 writes files; every process may log. Whole files are written
atomically (write, then rename) so an interrupted run never leaves a truncated one.

Event writers share one interface, `write(event)` / `close()`, where an event is
{'step': int, 'split': str, 'members': {name: [M floats]}, 'ensemble': {name: float},
...other numbers}; `MultiWriter` sends each event to several of them.
"""

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np


def is_writer() -> bool:
  """Process 0 alone writes files, so hosts never race on a shared workdir."""
  return jax.process_index() == 0


def write_json(path: str | os.PathLike, obj: Any) -> None:
  """Writes `obj` as JSON to `path` atomically; no-op on processes other than 0."""
  if is_writer():
    _write_text_atomic(Path(path), json.dumps(obj, indent=2))


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
      self._file.write(json.dumps(event) + '\n')
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

  def close(self) -> None:
    for writer in self._writers:
      writer.close()


def _write_text_atomic(path: Path, text: str) -> None:
  with tempfile.NamedTemporaryFile('w', dir=path.parent, suffix='.tmp', delete=False,
                                   encoding='utf-8') as tmp:
    tmp.write(text)
    tmp.flush()
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
