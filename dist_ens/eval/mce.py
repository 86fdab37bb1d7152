"""mCE: a run's corruption errors relative to a baseline run's (ImageNet-C's definition).

Hendrycks & Dietterich (2019) normalise each corruption's error by a fixed baseline
model's, so that hard corruptions do not dominate the mean. With err(c, s) = 1 -
accuracy on corruption c at severity s and config.eval.shift_baseline naming the workdir
of a finished run evaluated on the same (corruption, severity) pairs:

  CE_c           = sum_s err(c, s) / sum_s err_base(c, s)
  relative CE_c  = sum_s (err(c, s) - err_clean) / sum_s (err_base(c, s) - err_base_clean)
  mCE            = mean over corruptions c of CE_c (relative mCE likewise)

The baseline is one predictor: the baseline run's ensemble (a one-member run for a
single model). This run's ensemble, its mean member (the error averaged over the
members it includes) and each member are compared with it. A denominator of 0 (the
baseline never errs on c) gives NaN for that corruption, and so for the mean.

Example:
  baseline = load_baseline('/tmp/base', [('contrast', 1), ('contrast', 3)])
  report = mce_report(baseline, per_pair, clean, member_mask)
  report['mCE']['ensemble'], report['CE']['contrast']['mean_member']
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from dist_ens.errors import ConfigError

FIELD = 'config.eval.shift_baseline'


class Baseline(NamedTuple):
  """A baseline run's ensemble errors: on the clean test split, and per pair."""
  workdir: str
  clean_error: float
  errors: dict[tuple[str, int], float]


def _read_final(workdir: str) -> dict[str, Any]:
  file = Path(workdir).expanduser() / 'final_metrics.json'
  how = ('name the workdir of a finished classification run evaluated with eval.shift on '
         "this run's pairs, or '' for no mCE")
  if not file.is_file():
    raise ConfigError(f'{FIELD}={workdir!r}: no finished run there ({file} does not '
                      f'exist); {how}.')
  try:
    final = json.loads(file.read_text())
  except (OSError, ValueError) as e:
    raise ConfigError(f'{FIELD}={workdir!r}: {file} cannot be read ({e}); {how}.') from None
  if not isinstance(final.get('shift'), dict) or 'accuracy' not in final.get('ensemble', {}):
    raise ConfigError(f"{FIELD}={workdir!r}: that run has no 'shift' section with accuracy "
                      f'(it ran without eval.shift, or is not a classification run); {how}.')
  return final


def load_baseline(workdir: str, pairs: Sequence[tuple[str, int]]) -> Baseline | None:
  """The baseline's errors on `pairs` (this run's); None for workdir ''.

  Raises:
    ConfigError: naming config.eval.shift_baseline, when the workdir holds no finished
      run, the run has no shift accuracies, or lacks some of `pairs`.
  """
  if not workdir:
    return None
  final = _read_final(workdir)
  found = {}
  for name, severities in final['shift'].get('corruptions', {}).items():
    for severity, result in severities.items():
      accuracy = result.get('ensemble', {}).get('accuracy')
      if accuracy is not None:
        found[(name, int(severity))] = 1.0 - float(accuracy)
  missing = [f'{name}:{severity}' for name, severity in pairs if (name, severity) not in found]
  if missing:
    spec = final['shift'].get('spec', '?')
    raise ConfigError(
        f'{FIELD}={workdir!r} was evaluated with eval.shift={spec!r}, which lacks '
        f"{len(missing)} of this run's {len(pairs)} pairs ({', '.join(missing[:5])}"
        f"{', ...' if len(missing) > 5 else ''}); run the baseline with this run's eval.shift, "
        "or restrict this run's eval.shift to the baseline's pairs.")
  return Baseline(str(workdir), 1.0 - float(final['ensemble']['accuracy']),
                  {pair: found[pair] for pair in pairs})


def _errors(result: dict[str, Any], member_mask: np.ndarray) -> np.ndarray:
  """[2 + M] errors of (ensemble, mean included member, every member) in a result."""
  members = 1.0 - np.asarray(result['members']['accuracy'], np.float64)
  mean_member = members[member_mask].mean() if member_mask.any() else np.nan
  return np.concatenate([[1.0 - result['ensemble']['accuracy'], mean_member], members])


def _ratio(top: np.ndarray, bottom: float) -> np.ndarray:
  with np.errstate(divide='ignore', invalid='ignore'):
    return top / bottom if bottom != 0 else np.full_like(top, np.nan)


def mce_report(baseline: Baseline, per_pair: dict[tuple[str, int], dict[str, Any]],
               clean: dict[str, Any], member_mask: np.ndarray) -> dict[str, Any]:
  """{'baseline', 'mCE', 'relative_mCE': {'ensemble', 'mean_member', 'members': [M]},
  'CE', 'relative_CE': {corruption: {'ensemble', 'mean_member'}}} of a run's shift
  results (per_pair and clean: the task's metrics with 'members' and 'ensemble')."""
  mask = np.asarray(member_mask, bool)
  clean_errors = _errors(clean, mask)
  ce, relative = {}, {}
  for name in dict.fromkeys(c for c, _ in per_pair):
    severities = [s for c, s in per_pair if c == name]
    errors = np.sum([_errors(per_pair[(name, s)], mask) for s in severities], axis=0)
    base = sum(baseline.errors[(name, s)] for s in severities)
    ce[name] = _ratio(errors, base)
    relative[name] = _ratio(errors - len(severities) * clean_errors,
                            base - len(severities) * baseline.clean_error)
  out: dict[str, Any] = {'baseline': baseline.workdir}
  for mean_key, key, table in (('mCE', 'CE', ce), ('relative_mCE', 'relative_CE', relative)):
    mean = np.mean(list(table.values()), axis=0)
    out[mean_key] = {
        'ensemble': float(mean[0]), 'mean_member': float(mean[1]),
        'members': [float(v) for v in mean[2:]]}
    out[key] = {name: {'ensemble': float(v[0]), 'mean_member': float(v[1])}
                for name, v in table.items()}
  return out
