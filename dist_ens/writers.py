"""What a run writes and logs: metrics.jsonl, final_metrics.json, members.csv, tables.

Only process 0 writes files; every process may log. Files are written atomically
(write, then rename) so an interrupted run never leaves a truncated one.
"""

import json
import os
import tempfile
from pathlib import Path
from typing import Any

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
  """Per-member and ensemble test metrics as a Markdown table."""
  members, ens = final['members'], final['ensemble']
  frozen = set(final.get('frozen_members', []))
  lines = ['| member | accuracy | NLL | Brier | ECE |', '|---|---|---|---|---|']
  for i in range(len(members['accuracy'])):
    name = f'{i} (frozen)' if i in frozen else str(i)
    lines.append(f'| {name} | {members["accuracy"][i]:.4f} | {members["nll"][i]:.4f} | '
                 f'{members["brier"][i]:.4f} | {members["ece"][i]:.4f} |')
  mean = {k: float(np.mean(v)) for k, v in members.items()}
  lines.append(f'| member mean | {mean["accuracy"]:.4f} | {mean["nll"]:.4f} | '
               f'{mean["brier"]:.4f} | {mean["ece"]:.4f} |')
  lines.append(f'| **ensemble** | **{ens["accuracy"]:.4f}** | **{ens["nll"]:.4f}** | '
               f'**{ens["brier"]:.4f}** | **{ens["ece"]:.4f}** |')
  lines.append(f'\nensemble disagreement: {ens["disagreement"]:.4f}')
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
