"""Whole files a run writes: final_metrics.json, config.json, members.csv, and arrays
fitted after training (laplace.npz).

Only process 0 writes files; every process may log. Whole files are written
atomically (write, then rename) so an interrupted run never leaves a truncated one,
with the permissions the user's umask gives any new file (0644 under umask 022),
not tempfile's private 0600.

JSON files (final_metrics.json, config.json, metrics.jsonl) are strict JSON: a
non-finite float (NaN, inf; Python's or numpy's) is written as null, since the
NaN / Infinity tokens Python's json emits by default are not JSON and other readers
reject them. A member that diverged therefore reads back as None.
"""

import json
import math
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
    write_text_atomic(Path(path), strict_json(obj, indent=2))


def write_members_csv(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
  """members.csv, atomically; process 0 only."""
  if not is_writer():
    return
  columns = list(rows[0])
  lines = [','.join(columns)]
  for row in rows:
    lines.append(','.join(f'{row[c]:.6g}' if isinstance(row[c], float) else str(row[c])
                          for c in columns))
  write_text_atomic(Path(path), '\n'.join(lines) + '\n')


def write_npz(path: str | os.PathLike, arrays: dict[str, Any]) -> None:
  """Writes `arrays` as an uncompressed .npz to `path` atomically; process 0 only."""
  if not is_writer():
    return
  path = Path(path)
  with tempfile.NamedTemporaryFile(dir=path.parent, suffix='.tmp', delete=False) as tmp:
    np.savez(tmp, **arrays)
    tmp.flush()
    os.fchmod(tmp.fileno(), _FILE_MODE)
    os.fsync(tmp.fileno())
  os.replace(tmp.name, path)


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


def strict_json(obj: Any, **kwargs: Any) -> str:
  """`obj` as strict JSON text: numpy values as Python ones, non-finite floats as null."""
  # allow_nan=False: a non-finite float that slipped past _json_safe fails loudly
  # here rather than producing a file other readers reject.
  return json.dumps(_json_safe(obj), allow_nan=False, **kwargs)


def _read_umask() -> int:
  # os.umask can only be read by setting it; set it straight back, once, at import
  # (before any thread of ours could create a file under the temporary mask).
  mask = os.umask(0o077)
  os.umask(mask)
  return mask


_FILE_MODE = 0o666 & ~_read_umask()


def write_text_atomic(path: Path, text: str) -> None:
  """Replaces `path` with `text` in one rename, with the mode the umask gives new files."""
  with tempfile.NamedTemporaryFile('w', dir=path.parent, suffix='.tmp', delete=False,
                                   encoding='utf-8') as tmp:
    tmp.write(text)
    tmp.flush()
    # tempfile creates 0600; give the file what open() would have under the umask.
    os.fchmod(tmp.fileno(), _FILE_MODE)
    os.fsync(tmp.fileno())
  os.replace(tmp.name, path)
