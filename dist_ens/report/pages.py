"""report.md and report.html: the report's tables, and the figures with their captions.

report.md links the figures; report.html holds every table and figure in one file
(figures inline as data URIs), so it opens anywhere without a server.
"""

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from dist_ens.eval.ranks import NUM_ECE_BINS
from dist_ens.eval.registry import METRICS
from dist_ens.io import tables
from dist_ens.report.data import finite_mean, floats, method_rows
from dist_ens.report.plots import learning_curves_members
from dist_ens.report.stats import SizeSpread

# Above this an SVG is embedded in report.html as its PNG instead (e.g. learning curves of
# hundreds of members), to keep the page light.
_MAX_INLINE_SVG_BYTES = 1_500_000


# (name, label) of every per-member metric, from the one registry (eval.registry.METRICS):
# the rankable ones first (accuracy, NLL, Brier, ECE, ...), then the descriptions.
_METRIC_COLUMNS = tuple((m.name, m.label) for m in sorted(
    (m for m in METRICS if 'members' in m.scopes), key=lambda m: m.higher_is_better is None))
# The ones an ensemble is summed up by where a whole table would be too much.
_HEADLINE_COLUMNS = _METRIC_COLUMNS[:4]
# A regression run's (tasks/regression.py), its headline first.
_REGRESSION_COLUMNS = (
    ('rmse', 'RMSE'), ('nll', 'NLL'), ('crps', 'CRPS'), ('coverage_90', '90% coverage'),
    ('calibration_error', 'calibration error'), ('coverage_50', '50% coverage'),
    ('coverage_95', '95% coverage'), ('width_50', '50% width'), ('width_90', '90% width'),
    ('width_95', '95% width'))


def _columns(final: dict[str, Any], headline: bool = False) -> Sequence[tuple[str, str]]:
  """(key, label) of the run's task's metrics: regression's when it reports an RMSE."""
  if 'rmse' in final['members']:
    return _REGRESSION_COLUMNS[:4] if headline else _REGRESSION_COLUMNS
  return _HEADLINE_COLUMNS if headline else _METRIC_COLUMNS


def _fmt(value: Any, spec: str = '.4f') -> str:
  """A number for a table; missing or non-finite values (frozen members) as 'NaN'."""
  if value is None or not np.isfinite(float(value)):
    return 'NaN'
  return format(float(value), spec)


class Figure(NamedTuple):
  """One figure of the report (NAME.png and NAME.svg), as its section shows it."""
  name: str  # file name without suffix: NAME.png and NAME.svg
  title: str
  caption: str


class Run(NamedTuple):
  """What the report says about a run, gathered once for report.md and report.html."""
  workdir: Path
  final: dict[str, Any]
  summary: str  # what was trained, which checkpoint, which test split
  active: list[int]  # the non-frozen members: those the ensemble averages
  figures: list[Figure]


def report_figures(final: dict[str, Any], spread: SizeSpread,
                   active: list[int]) -> list[Figure]:
  """The figures written, with the captions report.md and report.html give them."""
  figures = [
      Figure('reliability', 'Reliability',
             f'Accuracy per confidence bin ({NUM_ECE_BINS} equal-width bins) against the '
             'diagonal of perfect calibration; the hatched red part is the gap to the bin\'s '
             'mean confidence, ECE in each title. Below: how many test examples fall in each '
             'bin.'),
      Figure('members_vs_ensemble', 'Members and the ensemble',
             'Every member\'s test metrics, the member mean (dashed), the ensemble (orange) and '
             'the top-k ensemble when members were selected (green, dotted). Frozen or '
             'non-finite members are grey crosses at the axis edge. Axes span the data.'),
      Figure('learning_curves', 'Learning curves',
             'Train loss and test metrics over steps of '
             f'{learning_curves_members(final["num_members"])}, the ensemble in orange.'),
      Figure('ensemble_size', 'Ensemble size', _ensemble_size_caption(final, spread, active))]
  if len(method_rows(final)) > 1:
    figures.append(Figure(
        'methods', 'Ensemble methods, selection and calibration',
        'Test accuracy, NLL and ECE of the trained members\' ensemble (orange) and of every '
        'other way this run predicted: the ensemble method\'s members (snapshots, SWAG '
        'samples), MC dropout, temperature scaling fitted on validation, top-k and greedy '
        'selection.'))
  if final.get('shift'):
    figures.append(Figure(
        'shift', 'Distribution shift',
        'Test metrics against corruption severity (config.eval.shift; 0 is the clean test '
        'split): the ensemble (orange) and the member mean (dashed), each the mean over the '
        'corruption families run at that severity; faint lines: each family\'s ensemble.'))
  if final.get('hyperparameters'):
    field = next(iter(final['hyperparameters']))
    figures.append(Figure(
        'sweep_scatter', 'Sweep: accuracy vs NLL per member',
        f'Every member\'s test accuracy against its test NLL, coloured by {field} (a log '
        'colour scale when its values span more than 10x); stars: the ensemble of all and of '
        'the selected members, circled: the selected members.'))
  return figures


def _ensemble_size_caption(final: dict[str, Any], spread: SizeSpread, active: list[int]) -> str:
  if not len(spread.size):
    return 'No member is left to ensemble.'
  accuracy = floats(final['members']['accuracy'])[active]
  return (
      f'Ensembles of k of the {len(active)} non-frozen members: for each k every subset when '
      f'there are at most {spread.accuracy.shape[1]}, else that many drawn at random (numpy '
      'seed 0). The line is the mean over subsets, the bands their interquartile range and '
      f'min-max. All {spread.size[-1]} together reach accuracy '
      f'{spread.stat("accuracy", "mean")[-1]:.4f} and NLL {spread.stat("nll", "mean")[-1]:.4f}; '
      f'single members range over accuracy '
      f'{_fmt(np.nanmin(accuracy))}-{_fmt(np.nanmax(accuracy))}.')


def _ood_table(ood: dict[str, Any], active: list[int]) -> str:
  return '\n'.join([
      f'OOD set: `{ood.get("dataset", "?")}` (positive class), scored by the ensemble\'s '
      'uncertainty:', '',
      '| score | AUROC | AUPR | mean in-dist. | mean OOD |', '|---|---|---|---|---|',
      *('| ' + ' | '.join(row) + ' |' for row in _ood_rows(ood, active))])


def _ood_rows(ood: dict[str, Any], active: list[int]) -> list[list[str]]:
  ens, members = ood['ensemble'], ood['members']
  if 'auroc_epistemic' in ens:  # Regression scores by variance (tasks/regression_eval.py).
    return [
        ['epistemic variance', _fmt(ens['auroc_epistemic']), _fmt(ens['aupr_epistemic']),
         _fmt(ens['epistemic_in']), _fmt(ens['epistemic_out'])],
        ['total variance', _fmt(ens['auroc_total']), _fmt(ens['aupr_total']), '', ''],
        ['member variance (mean of non-frozen members)',
         _fmt(finite_mean(members['auroc_variance'], active)),
         _fmt(finite_mean(members['aupr_variance'], active)), '', '']]
  return [
      ['predictive entropy', _fmt(ens['auroc_entropy']), _fmt(ens['aupr_entropy']),
       _fmt(ens['entropy_in']), _fmt(ens['entropy_out'])],
      ['mutual information', _fmt(ens['auroc_mi']), _fmt(ens['aupr_mi']), _fmt(ens['mi_in']),
       _fmt(ens['mi_out'])],
      ['member entropy (mean of non-frozen members)',
       _fmt(finite_mean(members['auroc_entropy'], active)),
       _fmt(finite_mean(members['aupr_entropy'], active)), '', '']]


def markdown(run: Run) -> str:
  final = run.final
  headline = _columns(final, headline=True)
  lines = [f'# dist_ens report: `{run.workdir}`', '', run.summary, '',
           'Every table and figure in one page: [report.html](report.html).', '',
           '## Test metrics', '', tables.results_table(final), '']
  if 'selected' in final:
    sel = final['selected']
    lines += [f'Ensemble of the {sel["top_k"]} best members {sel["members"]} by {sel["by"]}: '
              + ', '.join(f'{name} {_fmt(sel["ensemble"].get(k))}' for k, name in
                          headline) + '.', '']
  if len(method_rows(final)) > 1:
    lines += ['## Ensemble methods, selection and calibration', '',
              '| ensemble | ' + ' | '.join(name for _, name in headline) + ' |',
              '|---' * (1 + len(headline)) + '|',
              *(f'| {label} | ' + ' | '.join(_fmt(m.get(k)) for k, _ in headline) +
                ' |' for label, m in method_rows(final).items()), '']
  if 'ood' in final:
    lines += ['## Out-of-distribution detection', '', _ood_table(final['ood'], run.active), '']
  for figure in run.figures:
    lines += [f'## {figure.title}', '', figure.caption, '',
              f'![{figure.title.lower()}]({figure.name}.png) ([SVG]({figure.name}.svg))', '']
  return '\n'.join(lines)


_CSS = """
body { font: 15px/1.5 system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif; color: #222;
       background: #fff; margin: 0; }
main { max-width: 1250px; margin: 0 auto; padding: 1.5em 2em 4em; }
h1 { font-size: 1.5em; word-break: break-all; }
h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; padding-bottom: .2em; }
nav a { margin-right: 1em; }
table { border-collapse: collapse; margin: .8em 0; font-variant-numeric: tabular-nums; }
th, td { padding: .25em .8em; border-bottom: 1px solid #e4e4e4; text-align: right; }
th { background: #f3f4f6; position: sticky; top: 0; }
th:first-child, td:first-child { text-align: left; }
tbody tr:nth-child(even) { background: #fafafa; }
tr.ensemble, tr.selected { font-weight: 600; background: #fdf1e8 !important; }
tr.frozen { color: #999; }
.note { color: #555; }
figure { margin: 1em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: .9em; }
"""


def _html_table(header: Sequence[str], rows: Sequence[tuple[Sequence[str], str]]) -> str:
  """A table of escaped text; each row is (cells, its CSS class)."""
  head = ''.join(f'<th>{html.escape(h)}</th>' for h in header)
  body = '\n'.join(f'<tr class="{cls}">' + ''.join(f'<td>{html.escape(c)}</td>' for c in cells)
                   + '</tr>' for cells, cls in rows)
  return f'<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table>'


def _metrics_html(final: dict[str, Any], active: list[int]) -> str:
  members, ens = final['members'], final['ensemble']
  columns = [(k, name) for k, name in _columns(final) if k in members]
  rows = []
  if final['num_members'] <= tables.MAX_ROWS:
    kept = set(active)
    for i in range(final['num_members']):
      label, cls = _member_label(i, kept)
      rows.append(([label] + [_fmt(members[k][i]) for k, _ in columns], cls))
  else:  # The spread of the non-frozen members, as the console's table gives it.
    for label, q in _QUANTILES:
      rows.append(([f'member {label} (non-frozen)'] + [
          _fmt(_quantile(members[k], active, q)) for k, _ in columns], 'member'))
  rows.append((['member mean (non-frozen)']
               + [_fmt(finite_mean(members[k], active)) for k, _ in columns], 'mean'))
  rows.append((['ensemble'] + _cells(ens, columns), 'ensemble'))
  if 'selected' in final:
    sel = final['selected']
    rows.append(([f'top-{sel["top_k"]} ensemble'] + _cells(sel['ensemble'], columns), 'selected'))
  notes = [f'ensemble disagreement {_fmt(ens["disagreement"])}'] if 'disagreement' in ens else []
  if 'epistemic' in ens:
    notes.append(f'mean predictive variance {_fmt(ens["aleatoric"] + ens["epistemic"])} = '
                 f'aleatoric (mean of the members\' variances) {_fmt(ens["aleatoric"])} + '
                 f'epistemic (variance of their means) {_fmt(ens["epistemic"])}')
  if 'mutual_information' in ens:
    notes.append(f'predictive entropy {_fmt(ens["entropy"])} = expected entropy (aleatoric) '
                 f'{_fmt(ens["expected_entropy"])} + mutual information (epistemic) '
                 f'{_fmt(ens["mutual_information"])}; mean pairwise KL '
                 f'{_fmt(ens.get("pairwise_kl"))}')
  if final['num_members'] > tables.MAX_ROWS:
    notes.insert(0, f'{final["num_members"]} members ({len(active)} not frozen): their spread '
                    'per metric; members.csv and final_metrics.json list each.')
  return (_html_table(['member'] + [name for _, name in columns], rows)
          + ''.join(f'\n<p class="note">{html.escape(n)}</p>' for n in notes))


_QUANTILES = (('min', 0.0), ('25%', 0.25), ('median', 0.5), ('75%', 0.75), ('max', 1.0))


def _quantile(values: Sequence[Any], active: list[int], q: float) -> float:
  """The q-quantile of the non-frozen members' finite values (NaN if none)."""
  chosen = floats(values)[active]
  chosen = chosen[np.isfinite(chosen)]
  return float(np.quantile(chosen, q)) if chosen.size else float('nan')


def _selected_html(final: dict[str, Any], active: list[int]) -> str:
  sel, headline = final['selected'], _columns(final, headline=True)
  rows = [(['all non-frozen', ', '.join(map(str, active))]
           + _cells(final['ensemble'], headline), 'ensemble'),
          ([f'top {sel["top_k"]} by {sel["by"]}', ', '.join(map(str, sel['members']))]
           + _cells(sel['ensemble'], headline), 'selected')]
  return _html_table(['ensemble', 'members'] + [name for _, name in headline], rows)


def _hparams_html(final: dict[str, Any], active: list[int]) -> str:
  hparams = final['hyperparameters']
  chosen = set(final.get('selected', {}).get('members', []))
  splits = [('validation', final['validation']['members'])] if 'validation' in final else []
  splits.append(('test', final['members']))
  pair = _columns(final, headline=True)[:2]  # accuracy and NLL, or RMSE and NLL
  header = (['member'] + list(hparams)
            + [f'{split} {label}' for split, _ in splits for _, label in pair]
            + (['selected'] if chosen else []))
  kept, shown = set(active), list(range(final['num_members']))
  skipped = 0
  if len(shown) > tables.MAX_ROWS:  # The best and the worst by the first split's NLL.
    nll = floats(splits[0][1][pair[1][0]])
    shown.sort(key=lambda i: (i not in kept, not np.isfinite(nll[i]), np.nan_to_num(nll[i])))
    skipped = len(shown) - (tables.MAX_ROWS - 4)
    shown = shown[:tables.MAX_ROWS - 8] + [-1] + shown[-4:]
  rows = []
  for i in shown:
    if i < 0:
      rows.append(([f'... {skipped} more (members.csv)'] + [''] * (len(header) - 1), 'member'))
      continue
    label, cls = _member_label(i, kept)
    cells = [label] + [_fmt(values[i], '.4g') for values in hparams.values()]
    cells += [_fmt(metrics[k][i]) for _, metrics in splits for k, _ in pair]
    cells += (['yes' if i in chosen else ''] if chosen else [])
    rows.append((cells, cls))
  table = _html_table(header, rows)
  if skipped:
    table = (f'<p class="note">{tables.MAX_ROWS - 8} best and 4 worst of '
             f'{final["num_members"]} members by {splits[0][0]} {pair[1][1]}, best first.</p>\n'
             + table)
  return table


def _member_label(i: int, active: set[int] | list[int]) -> tuple[str, str]:
  """Member i's first cell and its row's CSS class (frozen members greyed out)."""
  return (str(i), 'member') if i in active else (f'{i} (frozen)', 'frozen')


def _cells(metrics: dict[str, Any], columns: Sequence[tuple[str, str]]) -> list[str]:
  """One ensemble's value of each (key, label) column, 'NaN' where it has none."""
  return [_fmt(metrics.get(k)) for k, _ in columns]


def _figure_html(out: Path, figure: Figure) -> str:
  """The figure inline as a data URI (its SVG, or its PNG when the SVG is large)."""
  svg = (out / f'{figure.name}.svg').read_bytes()
  if len(svg) <= _MAX_INLINE_SVG_BYTES:
    uri = 'data:image/svg+xml;base64,' + base64.b64encode(svg).decode('ascii')
  else:
    png = (out / f'{figure.name}.png').read_bytes()
    uri = 'data:image/png;base64,' + base64.b64encode(png).decode('ascii')
  return '\n'.join([
      f'<section id="{figure.name}">', f'<h2>{html.escape(figure.title)}</h2>',
      f'<p class="note">{html.escape(figure.caption)}</p>',
      f'<figure><img src="{uri}" alt="{html.escape(figure.title)}">',
      f'<figcaption>Files: <a href="{figure.name}.svg">{figure.name}.svg</a>, '
      f'<a href="{figure.name}.png">{figure.name}.png</a></figcaption></figure>', '</section>'])


def html_page(run: Run, out: Path) -> str:
  """report.html: every table and figure in one file, no external resource."""
  final = run.final
  sections = [('metrics', 'Test metrics', _metrics_html(final, run.active))]
  if 'selected' in final:
    sections.append(('selected', 'Selected members', _selected_html(final, run.active)))
  if 'ood' in final:
    ood = final['ood']
    sections.append(('ood', f'Out-of-distribution detection ({ood.get("dataset", "?")})',
                     '<p class="note">The OOD set is the positive class, scored by uncertainty.'
                     '</p>\n' + _html_table(['score', 'AUROC', 'AUPR', 'mean in-dist.',
                                             'mean OOD'],
                                            [(r, 'member') for r in _ood_rows(ood, run.active)])))
  if len(method_rows(final)) > 1:
    headline = _columns(final, headline=True)
    sections.append(('methods', 'Ensemble methods, selection and calibration', _html_table(
        ['ensemble'] + [name for _, name in headline],
        [([label] + [_fmt(m.get(k)) for k, _ in headline], 'member')
         for label, m in method_rows(final).items()])))
  if final.get('hyperparameters'):
    sections.append(('hyperparameters', 'Hyperparameters per member',
                     _hparams_html(final, run.active)))
  nav = [(key, title) for key, title, _ in sections] + [(f.name, f.title) for f in run.figures]
  title = f'dist_ens report: {run.workdir}'
  return '\n'.join([
      '<!DOCTYPE html>', '<html lang="en">', '<head>', '<meta charset="utf-8">',
      '<meta name="viewport" content="width=device-width, initial-scale=1">',
      f'<title>{html.escape(title)}</title>', f'<style>{_CSS}</style>', '</head>', '<body>',
      '<main>', f'<h1>{html.escape(title)}</h1>', f'<p>{html.escape(run.summary)}</p>',
      '<nav>' + ' '.join(f'<a href="#{key}">{html.escape(t)}</a>' for key, t in nav) + '</nav>',
      *(f'<section id="{key}">\n<h2>{html.escape(t)}</h2>\n{body}\n</section>'
        for key, t, body in sections),
      *(_figure_html(out, figure) for figure in run.figures),
      '</main>', '</body>', '</html>', ''])
