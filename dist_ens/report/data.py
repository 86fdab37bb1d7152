"""What a report reads from a finished run's workdir, with JSON nulls read back as NaN.

Strict JSON writers (dist_ens.io.run_files) store a non-finite metric (a member frozen
when it diverged) as null; the report turns each back into NaN, so numpy can compute
with it and the tables print it as 'NaN'.
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def check_workdir(workdir: Path) -> None:
  """FileNotFoundError unless `workdir` is a dist_ens workdir (numpy only: `dist-ens report`
  calls it before it imports JAX, so a mistyped path answers at once).

  Raises:
    FileNotFoundError: `workdir` does not exist or holds no run (no config.json,
      checkpoints/ or final_metrics.json).
  """
  if not workdir.is_dir():
    raise FileNotFoundError(f'{workdir} does not exist; name the workdir of a finished run.')
  if not any((workdir / n).exists() for n in ('final_metrics.json', 'config.json',
                                               'checkpoints')):
    raise FileNotFoundError(f'{workdir} is not a dist_ens workdir (it has no config.json, '
                            'checkpoints/ or final_metrics.json); name the workdir of a '
                            'finished run.')


def read_final_metrics(workdir: Path) -> dict[str, Any]:
  """WORKDIR/final_metrics.json, nulls as NaN.

  Raises:
    FileNotFoundError: `workdir` does not exist, holds no run, or holds one that has not
      finished, so there is no final_metrics.json.
  """
  check_workdir(workdir)
  path = workdir / 'final_metrics.json'
  if not path.is_file():
    raise FileNotFoundError(f'{path} does not exist: the run in {workdir} has not '
                            'finished; run (or resume) its training command first.')
  return nan_for_null(json.loads(path.read_text()))


def read_events(path: Path) -> list[dict[str, Any]]:
  """The events of metrics.jsonl at `path`, nulls as NaN ([] when it does not exist)."""
  if not path.exists():
    return []
  events = []
  for line in path.read_text(encoding='utf-8').splitlines():
    try:
      events.append(nan_for_null(json.loads(line)))
    except json.JSONDecodeError:
      continue  # A line torn by a crash.
  return events


def nan_for_null(obj: Any) -> Any:
  """`obj` with JSON nulls as NaN: strict JSON writers store a non-finite metric as null."""
  if isinstance(obj, dict):
    return {k: nan_for_null(v) for k, v in obj.items()}
  if isinstance(obj, list):
    return [nan_for_null(v) for v in obj]
  return np.nan if obj is None else obj


def floats(values: Sequence[Any]) -> np.ndarray:
  """A float64 array from JSON numbers, None (a missing value) as NaN."""
  return np.array([np.nan if v is None else v for v in values], np.float64)


def finite_mean(values: Sequence[Any], members: Sequence[int]) -> float:
  """The mean of values[members] that are finite (NaN when none is)."""
  kept = [v for v in floats(values)[list(members)] if np.isfinite(v)]
  return float(np.mean(kept)) if kept else np.nan


def method_rows(final: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """label -> ensemble test metrics of every way the run predicted: the trained members,
  each member group's own ensemble, and what the ensemble method, selection and post-hoc
  actions added (snapshots, SWAG samples, MC dropout, temperature scaling, top-k, greedy,
  the distilled student), in that order."""
  rows = {'trained members': final['ensemble']}
  for name, group in final.get('groups', {}).items():  # Member groups: each group's own.
    if group['ensemble'] is not None:
      rows[f"group {name} ({len(group['members'])} members)"] = group['ensemble']
  for key, value in final.items():  # The members a method collected (its own section).
    if isinstance(value, dict) and 'members_per_member' in value:
      rows[f'{key} ({value["members_per_member"]} per member)'] = value['ensemble']
  if 'mc_dropout' in final:
    rows[f'MC dropout x{final["mc_dropout"]["samples"]}'] = final['mc_dropout']['ensemble']
  if 'temperature_scaling' in final:
    rows['temperature scaled'] = final['temperature_scaling']['after']['ensemble']
  if 'selected' in final:
    rows[f'top-{final["selected"]["top_k"]}'] = final['selected']['ensemble']
  if 'greedy' in final:
    rows['greedy selection'] = final['greedy']['ensemble']
  if 'distill' in final:  # One network, scored as the ensemble's stand-in.
    rows[f"distilled student ({final['distill']['student']})"] = final['distill']
  return rows
