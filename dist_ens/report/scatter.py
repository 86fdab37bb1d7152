"""The report's scatter figures: a sweep's members coloured by a hyperparameter, and
methods' operating points (NLL against accuracy), with labels placed apart
(plots' conventions: NAME.png and NAME.svg, Agg canvas, non-finite drawn apart)."""

from pathlib import Path
from typing import Any

import numpy as np

from dist_ens.report.data import floats
from dist_ens.report.plots import (_ENSEMBLE_COLOR, _MEMBER_COLOR, _SELECTED_COLOR,
                                      _figure, _limits, _save)


def _color_norm(values: np.ndarray) -> tuple[Any, str]:
  """A colour scale for hyperparameter values and its name: log when the positive values
  span more than 10x (symmetric-log when 0 is among them, e.g. a weight-decay grid from 0),
  else linear."""
  from matplotlib import colors  # pylint: disable=g-import-not-at-top
  values = values[np.isfinite(values)]
  if not values.size:
    return colors.Normalize(0.0, 1.0), 'linear'
  low, high = float(values.min()), float(values.max())
  positive = values[values > 0]
  if low >= 0 and positive.size >= 2 and positive.max() > 10 * positive.min():
    if low > 0:
      return colors.LogNorm(low, high), 'log'
    return colors.SymLogNorm(float(positive.min()), vmin=0.0, vmax=high, base=10), 'symlog'
  return colors.Normalize(low, high), 'linear'


def plot_sweep(out: Path, final: dict[str, Any]) -> None:
  """sweep_scatter: test accuracy vs NLL per member, coloured by the first varying
  hyperparameter; stars for the ensembles of all and of the selected members."""
  hparams = final['hyperparameters']
  field = next(iter(hparams))
  color = floats(hparams[field])
  accuracy, nll = floats(final['members']['accuracy']), floats(final['members']['nll'])
  index = np.arange(final['num_members'])
  shown = (np.isfinite(accuracy) & np.isfinite(nll) & np.isfinite(color)
           & ~np.isin(index, final.get('frozen_members', [])))
  fig, axes = _figure(6.8, 5.0, 1)
  ax = axes[0]
  norm, scale = _color_norm(color[shown])
  points = ax.scatter(nll[shown], accuracy[shown], c=color[shown], norm=norm, cmap='viridis',
                      s=55, edgecolors='black', linewidths=0.5, zorder=3, label='member')
  fig.colorbar(points, ax=ax, label=f'{field} ({scale} scale)')
  stars = [_star(ax, final['ensemble'], _ENSEMBLE_COLOR, 'ensemble of all')]
  selected = final.get('selected')
  if selected:
    chosen = [m for m in selected['members'] if shown[m]]
    ax.scatter(nll[chosen], accuracy[chosen], s=160, facecolors='none',
               edgecolors=_SELECTED_COLOR, linewidths=2, zorder=2,
               label=f'top-{selected["top_k"]} by {selected["by"]}')
    stars.append(_star(ax, selected['ensemble'], _SELECTED_COLOR,
                       f'ensemble of the top {selected["top_k"]}'))
  hidden = int((~shown).sum())
  others = [f for f in hparams if f != field]
  ax.set(xlabel='test NLL (lower is better)', ylabel='test accuracy (higher is better)',
         xlim=_limits(np.concatenate([nll[shown], [x for x, _ in stars]]), 0.0),
         ylim=_limits(np.concatenate([accuracy[shown], [y for _, y in stars]]), 0.0, 1.0),
         title=f'{len(index)} members, coloured by {field}'
         + (f'\nalso varying: {", ".join(others)}' if others else '')
         + (f'\n{hidden} frozen / non-finite member(s) not shown' if hidden else ''))
  ax.title.set_fontsize(10)
  ax.legend(fontsize=7, markerscale=0.6)
  (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
  members = index[shown]
  where = np.stack([(nll[members] - x0) / (x1 - x0), (accuracy[members] - y0) / (y1 - y0)], 1)
  for i, (fx, fy) in place_labels(where, [str(i) for i in members]):
    ax.annotate(str(members[i]), (fx, fy), xycoords='axes fraction', fontsize=7)
  _save(fig, out, 'sweep_scatter')


# A member label's box in axes fractions of the 6.8 x 5 in sweep figure, at 7 pt.
_CHAR_WIDTH, _LABEL_HEIGHT = 0.017, 0.028


def place_labels(points: np.ndarray, texts: list[str]) -> list[tuple[int, tuple[float, float]]]:
  """(point index, label corner) for the labels that fit: each tries four corners around
  its point (axes fractions) and takes the first whose box overlaps no label placed yet
  and stays inside the axes; a label that fits nowhere is left out (its point is still
  drawn, and members.csv lists every member)."""
  placed, boxes = [], []
  for i, ((x, y), text) in enumerate(zip(points, texts)):
    w, h = _CHAR_WIDTH * len(text), _LABEL_HEIGHT
    for cx, cy in ((x + 0.01, y + 0.01), (x + 0.01, y - 0.01 - h), (x - 0.01 - w, y + 0.01),
                   (x - 0.01 - w, y - 0.01 - h)):
      box = (cx, cy, cx + w, cy + h)
      inside = box[0] >= 0 and box[1] >= 0 and box[2] <= 1 and box[3] <= 1
      if inside and not any(_overlap(box, other) for other in boxes):
        placed.append((i, (cx, cy)))
        boxes.append(box)
        break
  return placed


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
  return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _star(ax: Any, metrics: dict[str, Any], color: str, label: str) -> tuple[float, float]:
  """An ensemble's (NLL, accuracy) as a star on the sweep scatter; returns the point."""
  ax.scatter([metrics['nll']], [metrics['accuracy']], marker='*', s=220, color=color,
             edgecolors='black', zorder=4, label=label)
  return metrics['nll'], metrics['accuracy']


def plot_methods(out: Path, rows: dict[str, dict[str, Any]], name: str = 'methods') -> None:
  """Accuracy, NLL and ECE of every way the run predicted (data.method_rows), one
  horizontal bar each, the trained members' ensemble first."""
  labels = list(rows)
  fig, axes = _figure(12, 1.2 + 0.4 * len(labels), 3)
  for ax, (key, title) in zip(axes, (('accuracy', 'accuracy'), ('nll', 'NLL'), ('ece', 'ECE'))):
    values = floats([rows[label].get(key) for label in labels])
    colors = [_ENSEMBLE_COLOR] + [_MEMBER_COLOR] * (len(labels) - 1)
    ax.barh(np.arange(len(labels)), np.nan_to_num(values), color=colors)
    ax.set_yticks(np.arange(len(labels)), labels if ax is axes[0] else [''] * len(labels))
    ax.invert_yaxis()
    # Bars start at 0 (their length is the value); room on the right for the labels.
    ax.set_xlim(0, 1.25 * _limits(values, floor=0.0)[1])
    ax.set_title(f'test {title}')
    for i, v in enumerate(values):
      ax.annotate(f'{v:.4f}', (v, i), xytext=(3, 0), textcoords='offset points', va='center',
                  fontsize=8)
  _save(fig, out, name)
