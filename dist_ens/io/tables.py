"""Results as Markdown tables and member rows (what the log, members.csv and report show)."""

from collections.abc import Sequence
from typing import Any

import numpy as np

from dist_ens.eval.registry import METRICS


def _member_metrics(results: dict[str, Any], ranking_only: bool = False) -> list[str]:
  """The per-member metrics `results['members']` holds: classification's in the
  registry's order, then any other task's (one number per member) as they come."""
  known = [m.name for m in METRICS if 'members' in m.scopes and m.name in results['members']
           and not (ranking_only and m.higher_is_better is None)]
  registry = {m.name for m in METRICS}
  others = [k for k, v in results['members'].items() if k not in registry
            and isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)]
  return known + others


_LABELS = {m.name: m.label for m in METRICS}
# Tables list members one per row up to this many; beyond, a summary (members.csv has all).
MAX_ROWS = 32
_QUANTILES = (('min', 0.0), ('25%', 0.25), ('median', 0.5), ('75%', 0.75), ('max', 1.0))


def short_list(values: Sequence[Any], limit: int = MAX_ROWS, head: int = 8) -> str:
  """`values` as a list for a log line, up to `limit` of them; beyond, the first `head`
  and how many more (a line per member list stays one screen line at 4,096 members).

  Example:
    >>> short_list([3, 1, 2]), short_list(range(40), head=3)
    ('[3, 1, 2]', '[0, 1, 2, ... 37 more]')
  """
  values = list(values)
  if len(values) <= limit:
    return str(values)
  return '[' + ', '.join(map(str, values[:head])) + f', ... {len(values) - head:,} more]'


def spread_text(values: Sequence[float], fmt: str = '.3f', limit: int = MAX_ROWS) -> str:
  """Per-member numbers for a log line: the list up to `limit` members, else their min,
  median and max (final_metrics.json keeps every value).

  Example:
    >>> spread_text([1.0, 2.0]), spread_text([1.0, 2.0, 4.0], limit=2)
    ('[1.0, 2.0]', 'min 1.000, median 2.000, max 4.000 over 3 members')
  """
  values = np.asarray(values, np.float64)
  if len(values) <= limit:
    return str([float(format(v, fmt)) for v in values])
  low, mid, high = np.nanquantile(values, (0.0, 0.5, 1.0))
  return (f'min {low:{fmt}}, median {mid:{fmt}}, max {high:{fmt}} over '
          f'{counted(len(values), "member")}')


def counted(n: int, noun: str, plural: str = '') -> str:
  """'1 device', '4 devices': a count with its noun in the right number.

  Example:
    >>> counted(1, 'process', 'processes'), counted(2, 'member')
    ('1 process', '2 members')
  """
  return f'{n} {noun if n == 1 else plural or noun + "s"}'


def results_table(final: dict[str, Any]) -> str:
  """Per-member and ensemble test metrics as a Markdown table.

  One column per member metric `final` holds (dist_ens.eval.registry.METRICS); the
  ensemble's uncertainty decomposition and diversity follow the table.

  Example:
    print(results_table(json.load(open('/tmp/run/final_metrics.json'))))
  """
  members, ens = final['members'], final['ensemble']
  frozen = set(final.get('frozen_members', []))
  columns = [(name, _LABELS.get(name, name)) for name in _member_metrics(final)]
  lines = ['| member | ' + ' | '.join(name for _, name in columns) + ' |',
           '|---|' + '---|' * len(columns)]
  num_members = len(members[columns[0][0]])  # (Old results carry no num_members.)
  if num_members <= MAX_ROWS:
    for i in range(num_members):
      name = f'{i} (frozen)' if i in frozen else str(i)
      lines.append(f'| {name} | ' + ' | '.join(f'{members[k][i]:.4f}' for k, _ in columns) + ' |')
  # The summary rows describe the members the ensemble averages, as report.html's do: a
  # frozen member (a PBT loser, a diverged one) would pull a mean to NaN.
  active = [i for i in range(num_members) if i not in frozen] or list(range(num_members))
  of_active = lambda k: np.asarray(members[k], np.float64)[active]
  scope = ' (non-frozen)' if len(active) < num_members else ''
  if num_members > MAX_ROWS:  # A summary of the members' spread: members.csv has every one.
    for label, q in _QUANTILES:
      lines.append(f'| member {label}{scope} | ' + ' | '.join(
          f'{float(np.nanquantile(of_active(k), q)):.4f}' for k, _ in columns) + ' |')
  lines.append(f'| member mean{scope} | ' + ' | '.join(f'{float(np.mean(of_active(k))):.4f}'
                                                       for k, _ in columns) + ' |')
  # Each ensemble row says which members it averages: a sweep's whole ensemble (every
  # member, most of them badly tuned) is not its top-k, which the row after it holds.
  for label, averaged in _ensembles(final, num_members, frozen):
    lines.append(f'| **ensemble: {label}** | ' + ' | '.join(
        f'**{averaged[k]:.4f}**' if k in averaged else '' for k, _ in columns) + ' |')
  if 'disagreement' in ens:
    lines.append(f'\nensemble disagreement: {ens["disagreement"]:.4f}')
  if 'mutual_information' in ens:
    lines.append(f'predictive entropy {ens["entropy"]:.4f} = expected entropy (aleatoric) '
                 f'{ens["expected_entropy"]:.4f} + mutual information (epistemic) '
                 f'{ens["mutual_information"]:.4f}; mean pairwise KL {ens["pairwise_kl"]:.4f}')
  return '\n'.join(lines)


def _ensembles(final: dict[str, Any], num_members: int,
               frozen: set[int]) -> list[tuple[str, dict[str, Any]]]:
  """(what it averages, its metrics) for the whole ensemble and the selected ones.

  Example:
    >>> [label for label, _ in _ensembles({'ensemble': {}, 'selected': {'top_k': 4,
    ...     'by': 'validation nll', 'members': [0, 3, 5, 9], 'ensemble': {}}}, 16, {2})]
    ['15 members (1 frozen left out)', 'top-4 by validation nll, members [0, 3, 5, 9]']
  """
  rows = [(f'{counted(num_members - len(frozen), "member")} ({len(frozen)} frozen left out)'
           if frozen else f'all {counted(num_members, "member")}', final['ensemble'])]
  if 'selected' in final:  # config.select.top_k (training/actions.py SelectTopK)
    selected = final['selected']
    rows.append((f'top-{selected["top_k"]} by {selected["by"]}, members '
                 f'{short_list(selected["members"])}', selected['ensemble']))
  if 'greedy' in final:  # select.method='greedy' (evaluators/greedy.py)
    greedy = final['greedy']
    rows.append((f'greedy by {greedy["by"]}, {counted(len(greedy["picks"]), "pick")} of '
                 f'{counted(len(greedy["members"]), "member")}', greedy['ensemble']))
  return rows


def member_rows(final: dict[str, Any], member_hparams: dict[str, np.ndarray],
                validation: dict[str, Any] | None, metric: str,
                higher_is_better: bool) -> list[dict[str, Any]]:
  """One row per member: index, hyperparameters, validation and test metrics, sorted
  best first by `metric` (on validation when there is one, else on test). The metric
  columns are every rankable member metric (val_*, test_*, and shift_*: the mean over
  config.eval.shift's corruptions, when the run has them)."""
  rows = []
  frozen = set(final.get('frozen_members', []))
  for i in range(final['num_members']):
    row: dict[str, Any] = {'member': i}
    row.update({field: float(str(np.float32(v[i]))) for field, v in member_hparams.items()})
    if validation is not None:
      row.update({f'val_{name}': validation['members'][name][i]
                  for name in _member_metrics(validation, ranking_only=True)})
    row.update({f'test_{name}': final['members'][name][i]
                for name in _member_metrics(final, ranking_only=True)})
    if 'shift' in final:  # means over the corruptions and severities of config.eval.shift
      shifted = final['shift']['mean']
      row.update({f'shift_{name}': shifted['members'][name][i]
                  for name in _member_metrics(shifted, ranking_only=True)})
    row['frozen'] = i in frozen
    if 'pbt' in final:  # Which members it copied, when (dist_ens/evaluators/pbt.py).
      row['lineage'] = final['pbt']['lineage'][i]
    rows.append(row)
  key = f'val_{metric}' if validation is not None and f'val_{metric}' in rows[0] else f'test_{metric}'
  # Frozen members last; NaN metrics cannot rank.
  sign = -1.0 if higher_is_better else 1.0
  rows.sort(key=lambda r: (r['frozen'], not np.isfinite(r[key]), sign * np.nan_to_num(r[key])))
  return rows


def members_table(rows: list[dict[str, Any]], fields: list[str]) -> str:
  """The members with the hyperparameters that vary, as a Markdown table."""
  metric_columns = [c for c in rows[0] if c.startswith(('val_', 'test_'))]
  header = ['member'] + fields + metric_columns
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  if len(rows) > MAX_ROWS:  # The best and the worst, ranked; members.csv has every one.
    head, tail = rows[:MAX_ROWS - 8], rows[-4:]
    skipped = len(rows) - len(head) - len(tail)
    rows = [*head, {'skipped': skipped}, *tail]
  for row in rows:
    if 'skipped' in row:
      lines.append(f'| ... {row["skipped"]} more (members.csv) |' + ' |' * (len(header) - 1))
      continue
    cells = [str(row['member']) + (' (frozen)' if row['frozen'] else '')]
    cells += [f'{row[f]:.4g}' for f in fields] + [f'{row[c]:.4f}' for c in metric_columns]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)
