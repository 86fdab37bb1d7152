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
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Protocol

import jax
import numpy as np
from absl import logging


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


class _BarSafeStream:
  """A stream whose writes clear and redraw the progress bars on the same terminal."""

  def __init__(self, stream: IO[str]):
    self._stream = stream

  def write(self, text: str) -> None:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    tqdm.write(text, file=self._stream, end='')

  def flush(self) -> None:
    self._stream.flush()

  # absl compares its handler's stream with sys.stderr to avoid echoing a record
  # there twice; the wrapper must still count as the stream it wraps.
  def __eq__(self, other: object) -> bool:
    return other is self or other is self._stream

  def __hash__(self) -> int:
    return hash(self._stream)


class Progress:
  """A progress bar on an interactive terminal; plain log lines otherwise.

  `update(step, line)` moves the bar to `step` (cheap: call it every step) and, when
  `line` is given, logs it; on a terminal the bar stays below the log lines (absl's
  log stream is routed around it while the bar lives). Off a terminal, on processes
  other than 0, or with enabled=False there is no bar, only the log lines.

  Example:
    progress = Progress(total_steps=2000, start_step=0)
    for step in range(1, 2001):
      ...
      progress.update(step, line=f'step {step} loss ...' if step % 250 == 0 else None)
    progress.close()
  """

  def __init__(self, total_steps: int, start_step: int = 0, stream: IO[str] | None = None,
               enabled: bool | None = None):
    stream = sys.stderr if stream is None else stream
    if enabled is None:
      enabled = is_writer() and hasattr(stream, 'isatty') and stream.isatty()
    self._bar = None
    self._handler, self._handler_stream = None, None
    if not enabled:
      return
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    # tqdm hides its bar on a terminal that reports a size of 0 x 0 (a pty nobody
    # sized, as under `script` or some IDE consoles): give such a one a fixed size.
    size = {}
    try:
      if os.get_terminal_size(stream.fileno()).columns == 0:
        size = {'ncols': 100, 'nrows': 40}
    except (AttributeError, OSError, ValueError):
      pass
    self._bar = tqdm(total=total_steps, initial=start_step, file=stream, unit='step',
                     dynamic_ncols=not size, leave=True, **size)
    handler = getattr(logging.get_absl_handler(), 'python_handler', None)
    if handler is not None and getattr(handler, 'stream', None) is stream:
      self._handler, self._handler_stream = handler, stream
      handler.stream = _BarSafeStream(stream)

  @property
  def has_bar(self) -> bool:
    return self._bar is not None

  def update(self, step: int, line: str | None = None) -> None:
    if self._bar is not None and step > self._bar.n:
      self._bar.update(step - self._bar.n)
    if line is not None:
      prefix = f'[process {jax.process_index()}] ' if jax.process_count() > 1 else ''
      logging.info('%s%s', prefix, line)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    if self._handler is not None:
      self._handler.stream = self._handler_stream
      self._handler = None


def _write_text_atomic(path: Path, text: str) -> None:
  with tempfile.NamedTemporaryFile('w', dir=path.parent, suffix='.tmp', delete=False,
                                   encoding='utf-8') as tmp:
    tmp.write(text)
    tmp.flush()
    os.fsync(tmp.fileno())
  os.replace(tmp.name, path)


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'


def progress_line(step: int, total: int, loss: np.ndarray, accuracy: np.ndarray,
                  examples_per_s: float, eta_s: float, input_demand_per_s: float | None = None,
                  input_capacity_per_s: float | None = None) -> str:
  """One log line: step, member loss mean/min/max, train accuracy, throughput, ETA.

  With the input figures: the examples per second the step consumed and the rate
  the input pipeline could deliver (its examples per second of busy time).
  """
  line = (f'step {step}/{total}  loss mean {loss.mean():.4f} min {loss.min():.4f} '
          f'max {loss.max():.4f}  acc {accuracy.mean():.3f}  '
          f'{examples_per_s:,.0f} member-examples/s  ETA {_duration(eta_s)}')
  if input_demand_per_s is not None and input_capacity_per_s is not None:
    line += (f'  input: step takes {input_demand_per_s:,.0f} ex/s, pipeline gives '
             f'{input_capacity_per_s:,.0f} ex/s')
  return line


def results_table(final: dict[str, Any]) -> str:
  """Per-member and ensemble test metrics as a Markdown table.

  Columns for adaptive ECE and entropy appear when `final` has them; the ensemble's
  uncertainty decomposition and diversity follow the table.

  Example:
    print(results_table(json.load(open('/tmp/run/final_metrics.json'))))
  """
  members, ens = final['members'], final['ensemble']
  frozen = set(final.get('frozen_members', []))
  columns = [(k, name) for k, name in (('accuracy', 'accuracy'), ('nll', 'NLL'),
                                       ('brier', 'Brier'), ('ece', 'ECE'),
                                       ('adaptive_ece', 'adaptive ECE'), ('entropy', 'entropy'))
             if k in members]
  lines = ['| member | ' + ' | '.join(name for _, name in columns) + ' |',
           '|---|' + '---|' * len(columns)]
  for i in range(len(members['accuracy'])):
    name = f'{i} (frozen)' if i in frozen else str(i)
    lines.append(f'| {name} | ' + ' | '.join(f'{members[k][i]:.4f}' for k, _ in columns) + ' |')
  lines.append('| member mean | ' + ' | '.join(f'{float(np.mean(members[k])):.4f}'
                                               for k, _ in columns) + ' |')
  lines.append('| **ensemble** | ' + ' | '.join(f'**{ens[k]:.4f}**' if k in ens else ''
                                                for k, _ in columns) + ' |')
  lines.append(f'\nensemble disagreement: {ens["disagreement"]:.4f}')
  if 'mutual_information' in ens:
    lines.append(f'predictive entropy {ens["entropy"]:.4f} = expected entropy (aleatoric) '
                 f'{ens["expected_entropy"]:.4f} + mutual information (epistemic) '
                 f'{ens["mutual_information"]:.4f}; mean pairwise KL {ens["pairwise_kl"]:.4f}')
  return '\n'.join(lines)


def member_rows(final: dict[str, Any], member_hparams: dict[str, np.ndarray],
                validation: dict[str, Any] | None, metric: str,
                higher_is_better: bool) -> list[dict[str, Any]]:
  """One row per member: index, hyperparameters, validation and test metrics, sorted
  best first by `metric` (on validation when there is one, else on test)."""
  rows = []
  frozen = set(final.get('frozen_members', []))
  for i in range(final['num_members']):
    row: dict[str, Any] = {'member': i}
    row.update({field: float(v[i]) for field, v in member_hparams.items()})
    if validation is not None:
      row.update({f'val_{k}': validation['members'][k][i] for k in ('accuracy', 'nll', 'ece')})
    row.update({f'test_{k}': final['members'][k][i] for k in ('accuracy', 'nll', 'brier', 'ece')})
    row['frozen'] = i in frozen
    rows.append(row)
  key = f'val_{metric}' if validation is not None and f'val_{metric}' in rows[0] else f'test_{metric}'
  # Frozen members last; NaN metrics cannot rank.
  sign = -1.0 if higher_is_better else 1.0
  rows.sort(key=lambda r: (r['frozen'], not np.isfinite(r[key]), sign * np.nan_to_num(r[key])))
  return rows


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


def members_table(rows: list[dict[str, Any]], fields: list[str]) -> str:
  """The members with the hyperparameters that vary, as a Markdown table."""
  metric_columns = [c for c in rows[0] if c.startswith(('val_', 'test_'))]
  header = ['member'] + fields + metric_columns
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  for row in rows:
    cells = [str(row['member']) + (' (frozen)' if row['frozen'] else '')]
    cells += [f'{row[f]:.4g}' for f in fields] + [f'{row[c]:.4f}' for c in metric_columns]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)
