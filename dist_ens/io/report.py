"""`dist-ens report --workdir DIR`: plots, a Markdown report and one self-contained HTML page.

  python -m dist_ens.io.report --workdir /tmp/run     # the same as `dist-ens report ...`

Writes DIR/report/ (every figure as NAME.png at 150 dpi and NAME.svg):
  reliability              reliability diagrams with bin counts: the ensemble, its best and
                           worst member
  members_vs_ensemble      test accuracy, NLL and ECE of every member next to the ensemble
  learning_curves          train loss and test accuracy/NLL of every member over steps
  ensemble_size            test accuracy and NLL against ensemble size k: mean and spread over
                           random subsets of k members
  sweep_scatter            (runs whose members differ in hyperparameters) test accuracy vs NLL
                           per member, coloured by the first varying hyperparameter
  report.md                the final metrics table with the figures linked
  report.html              every table and figure in one file (figures inline), no server needed

Tables come from final_metrics.json and metrics.jsonl; the figures that need
predictions (reliability, ensemble size) load the final checkpoint with
dist_ens.inference.Ensemble and predict the test split, on whatever devices exist.
Plots use matplotlib's Agg canvas directly (no pyplot, no display, no global state).
Non-finite metrics (members frozen when they diverged) are drawn apart and printed as NaN.
"""

import argparse
import base64
import html
import itertools
import json
import math
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from dist_ens import data
from dist_ens.io import tables
from dist_ens.inference import Ensemble
from dist_ens.eval.metrics import METRICS, NUM_ECE_BINS

FIGURES = ('reliability.png', 'members_vs_ensemble.png', 'learning_curves.png',
           'ensemble_size.png')
SWEEP_FIGURE = 'sweep_scatter.png'  # Written only when final_metrics.json has 'hyperparameters'.
DPI = 150
_MEMBER_COLOR, _ENSEMBLE_COLOR, _SELECTED_COLOR = '#4c72b0', '#dd8452', '#55a868'
_FROZEN_COLOR = '#999999'
# Above this an SVG is embedded in report.html as its PNG instead (e.g. learning curves of
# hundreds of members), to keep the page light.
_MAX_INLINE_SVG_BYTES = 1_500_000


class Reliability(NamedTuple):
  """Equal-width confidence bins of one predictor (empty bins have count 0)."""
  accuracy: np.ndarray  # [NUM_ECE_BINS] fraction correct per bin (0 where empty)
  confidence: np.ndarray  # [NUM_ECE_BINS] mean confidence per bin (0 where empty)
  count: np.ndarray  # [NUM_ECE_BINS]
  ece: float


def reliability(probs: np.ndarray, labels: np.ndarray,
                num_bins: int = NUM_ECE_BINS) -> Reliability:
  """Binned accuracy and confidence, with bins and ECE as in dist_ens.eval.metrics.

  Predictions with a non-finite probability (a diverged member) fall in no bin and
  make the ECE NaN.

  Example:
    >>> r = reliability(np.array([[0.9, 0.1], [0.2, 0.8]]), np.array([0, 0]), num_bins=2)
    >>> r.count.tolist(), r.accuracy.tolist(), round(r.ece, 3)
    ([0, 2], [0.0, 0.5], 0.35)

  Args:
    probs: [N, C] predicted probabilities.
    labels: [N] integer labels.
    num_bins: equal-width bins over [0, 1].

  Returns:
    Reliability of the N predictions.
  """
  probs = np.asarray(probs, np.float64)
  labels = np.asarray(labels)
  finite = np.isfinite(probs).all(-1)
  confidence = np.where(finite, probs.max(-1, initial=0.0, where=np.isfinite(probs)), 0.0)
  correct = (probs.argmax(-1) == labels).astype(np.float64)
  index = np.clip(np.floor(confidence * num_bins).astype(int), 0, num_bins - 1)[finite]
  count = np.bincount(index, minlength=num_bins)
  conf_sum = np.bincount(index, confidence[finite], minlength=num_bins)
  correct_sum = np.bincount(index, correct[finite], minlength=num_bins)
  safe = np.maximum(count, 1)
  ece = float(np.abs(correct_sum - conf_sum).sum() / len(labels)) if finite.all() else np.nan
  return Reliability(correct_sum / safe, conf_sum / safe, count, ece)


def _accuracy_nll(probs: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
  """Accuracy and mean NLL of [N, C] probabilities (NaN where they are not finite)."""
  if not np.isfinite(probs).all():
    return np.nan, np.nan
  picked = probs[np.arange(len(labels)), labels]
  return (float(np.mean(probs.argmax(-1) == labels)),
          float(-np.mean(np.log(np.maximum(picked, 1e-300)))))


def ensemble_size_curve(member_probs: np.ndarray, labels: np.ndarray,
                        members: Sequence[int]) -> dict[str, np.ndarray]:
  """Accuracy and NLL of the ensembles of the first k of `members`, k = 1..len(members).

  ensemble_size_spread gives the same over many subsets of each size.

  Example:
    >>> p = np.array([[[0.9, 0.1]], [[0.3, 0.7]]])  # 2 members, 1 example
    >>> ensemble_size_curve(p, np.array([0]), [0, 1])['accuracy'].tolist()
    [1.0, 1.0]

  Args:
    member_probs: [M, N, C] every member's probabilities.
    labels: [N] integer labels.
    members: the member indices, in the order they join the ensemble.

  Returns:
    {'size': [K], 'accuracy': [K], 'nll': [K]} with K = len(members).
  """
  running = np.zeros(member_probs.shape[1:], np.float64)
  accuracy, nll = [], []
  for k, m in enumerate(members, start=1):
    running += member_probs[m]
    acc, loss = _accuracy_nll(running / k, labels)
    accuracy.append(acc)
    nll.append(loss)
  return {'size': np.arange(1, len(members) + 1), 'accuracy': np.array(accuracy),
          'nll': np.array(nll)}


class SizeSpread(NamedTuple):
  """Accuracy and NLL of ensembles of k members, over several member subsets per size.

  Row i describes size[i]; its first num_subsets[i] columns hold one subset each and
  the rest are NaN (fewer distinct subsets exist, e.g. one of all members).
  """
  size: np.ndarray  # [K] ensemble sizes, increasing
  num_subsets: np.ndarray  # [K] subsets evaluated per size
  accuracy: np.ndarray  # [K, S] test accuracy per size and subset
  nll: np.ndarray  # [K, S] test NLL per size and subset

  def stat(self, key: str, name: str) -> np.ndarray:
    """[K] 'mean', 'min', 'max', 'q25' or 'q75' of `key` ('accuracy' or 'nll') per size."""
    values = {'accuracy': self.accuracy, 'nll': self.nll}.get(key)
    if values is None:
      raise ValueError(f"key={key!r}: use 'accuracy' or 'nll'")
    reducers = {'mean': np.nanmean, 'min': np.nanmin, 'max': np.nanmax,
                'q25': lambda v, axis: np.nanpercentile(v, 25, axis=axis),
                'q75': lambda v, axis: np.nanpercentile(v, 75, axis=axis)}
    if name not in reducers:
      raise ValueError(f'name={name!r}: use one of {sorted(reducers)}')
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', RuntimeWarning)  # A size whose subsets are all NaN.
      return reducers[name](values, axis=1)


def _subsets(num: int, k: int, num_subsets: int,
             rng: np.random.Generator) -> list[tuple[int, ...]]:
  """Every k-subset of range(num) when there are at most num_subsets, else that many
  distinct ones drawn at random (sorted tuples)."""
  if math.comb(num, k) <= num_subsets:
    return list(itertools.combinations(range(num), k))
  chosen: dict[tuple[int, ...], None] = {}  # Insertion-ordered: the draw order.
  while len(chosen) < num_subsets:
    chosen[tuple(sorted(rng.choice(num, size=k, replace=False).tolist()))] = None
  return list(chosen)


def _spread_sizes(num: int, max_sizes: int) -> np.ndarray:
  """1..num when that is at most max_sizes values, else about max_sizes log-spaced ones
  (1 and num included): large ensembles change little from one size to the next."""
  if num <= max_sizes:
    return np.arange(1, num + 1)
  return np.unique(np.round(np.geomspace(1, num, max_sizes)).astype(int))


def ensemble_size_spread(member_probs: np.ndarray, labels: np.ndarray,
                         members: Sequence[int], num_subsets: int = 20, seed: int = 0,
                         max_sizes: int = 24) -> SizeSpread:
  """Accuracy and NLL of the ensembles of k of `members`, over many subsets of each size.

  For each k, every k-subset when there are at most num_subsets of them (so k = 1 gives
  each member alone when len(members) <= num_subsets, and k = len(members) the one full
  ensemble), else num_subsets distinct subsets drawn with numpy's default_rng(seed).

  Example:
    >>> p = np.array([[[0.9, 0.1]], [[0.3, 0.7]], [[0.6, 0.4]]])  # 3 members, 1 example
    >>> s = ensemble_size_spread(p, np.array([0]), [0, 1, 2])
    >>> s.num_subsets.tolist(), s.stat('accuracy', 'min').tolist()
    ([3, 3, 1], [0.0, 0.0, 1.0])

  Args:
    member_probs: [M, N, C] every member's probabilities.
    labels: [N] integer labels.
    members: the member indices to draw from (e.g. the non-frozen ones).
    num_subsets: the most subsets evaluated per size.
    seed: seeds the draw of subsets.
    max_sizes: sizes evaluated at most (log-spaced beyond it; the cost grows as the
      sum of the sizes).

  Returns:
    SizeSpread over the sizes 1..len(members).
  """
  members = np.asarray(list(members), int)
  labels = np.asarray(labels)
  rng = np.random.default_rng(seed)
  sizes = _spread_sizes(len(members), max_sizes)
  accuracy = np.full((len(sizes), num_subsets), np.nan)
  nll = np.full((len(sizes), num_subsets), np.nan)
  counts = []
  for i, k in enumerate(sizes):
    subsets = _subsets(len(members), int(k), num_subsets, rng)
    counts.append(len(subsets))
    for j, subset in enumerate(subsets):
      mean = member_probs[members[list(subset)]].sum(0, dtype=np.float64) / k
      accuracy[i, j], nll[i, j] = _accuracy_nll(mean, labels)
  return SizeSpread(sizes, np.array(counts, int), accuracy, nll)


def _limits(values: Any, floor: float | None = None, ceil: float | None = None,
            margin: float = 0.1) -> tuple[float, float]:
  """Axis limits around the finite `values` with a margin, clipped to [floor, ceil].

  Data-driven rather than from 0: accuracies of 0.91-0.93 drawn on [0, 1] all look alike.
  """
  finite = np.asarray(values, np.float64).ravel()
  finite = finite[np.isfinite(finite)]
  if not finite.size:
    return (0.0 if floor is None else floor), (1.0 if ceil is None else ceil)
  low, high = float(finite.min()), float(finite.max())
  pad = margin * (high - low) if high > low else max(0.02 * abs(high), 0.01)
  low, high = low - pad, high + pad
  if floor is not None:
    low = max(low, floor)
  if ceil is not None:
    high = min(high, ceil)
  return low, high


def _figure(width: float, height: float, ncols: int, nrows: int = 1, **grid: Any):
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(width, height), dpi=100, layout='constrained')
  axes = fig.subplots(nrows, ncols, squeeze=False, **grid)
  return fig, (axes[0] if nrows == 1 else axes)


def _save(fig: Any, out: Path, name: str) -> None:
  """NAME.png at DPI and NAME.svg (vector, text as paths: no fonts needed to view it)."""
  path = out / name
  fig.savefig(path.with_suffix('.png'), dpi=DPI)
  fig.savefig(path.with_suffix('.svg'), metadata={'Date': None})


def _floats(values: Sequence[Any]) -> np.ndarray:
  """A float64 array from JSON numbers, None (a missing value) as NaN."""
  return np.array([np.nan if v is None else v for v in values], np.float64)


def _plot_reliability(out: Path, panels: list[tuple[str, Reliability]]) -> None:
  fig, axes = _figure(4.0 * len(panels), 5.4, len(panels), 2, height_ratios=(3.3, 1.0),
                      sharex=True)
  edges = np.linspace(0.0, 1.0, NUM_ECE_BINS + 1)
  width = edges[1] - edges[0]
  for column, (title, r) in enumerate(panels):
    ax, hist = axes[0, column], axes[1, column]
    filled = r.count > 0
    total = int(r.count.sum())
    ax.bar(edges[:-1][filled], r.accuracy[filled], width=width, align='edge',
           color=_MEMBER_COLOR, edgecolor='white', label='accuracy')
    # The gap between confidence and accuracy: what ECE averages (weighted by count).
    # Hatched, not filled: under-confident bins draw the gap over the accuracy bar.
    ax.bar(edges[:-1][filled], r.confidence[filled] - r.accuracy[filled],
           bottom=r.accuracy[filled], width=width, align='edge', color='none',
           edgecolor='#c44e52', hatch='///', linewidth=0.8, label='gap to mean confidence')
    ax.plot([0, 1], [0, 1], '--', color='gray', lw=1, label='perfect calibration')
    ax.set(xlim=(0, 1), ylim=(0, 1), title=f'{title}\nECE {r.ece:.3f}, {total} examples')
    # Bin counts: a bar far off the diagonal matters little when few examples fall in it.
    fraction = r.count / max(total, 1)
    hist.bar(edges[:-1], fraction, width=width, align='edge', color=_FROZEN_COLOR,
             edgecolor='white')
    for left, n, f in zip(edges[:-1], r.count, fraction):
      if n:
        hist.text(left + width / 2, f, f' {n}', ha='center', va='bottom', rotation=90,
                  fontsize=6)
    hist.set(xlim=(0, 1), ylim=(0, 1.6 * max(float(fraction.max()), 1e-3)),
             xlabel='confidence (top-class probability)')
  axes[0, 0].set_ylabel('accuracy')
  axes[1, 0].set_ylabel('examples\n(fraction, count)')
  axes[0, 0].legend(loc='upper left', fontsize=8)
  _save(fig, out, 'reliability')


def _plot_members_vs_ensemble(out: Path, final: dict[str, Any]) -> None:
  metrics = (('accuracy', 'test accuracy (higher is better)', 0.0, 1.0),
             ('nll', 'test NLL (lower is better)', 0.0, None),
             ('ece', 'test ECE (lower is better)', 0.0, 1.0))
  fig, axes = _figure(12.0, 3.8, len(metrics))
  num = final['num_members']
  index = np.arange(num)
  frozen = np.isin(index, final.get('frozen_members', []))
  selected = final.get('selected')
  for ax, (key, title, floor, ceil) in zip(axes, metrics):
    values = _floats(final['members'][key])
    ens = final['ensemble'].get(key, np.nan)
    sel = selected['ensemble'].get(key, np.nan) if selected else np.nan
    ok = np.isfinite(values) & ~frozen
    low, high = _limits(np.concatenate([values[ok], _floats([ens, sel])]), floor, ceil)
    ax.scatter(index[ok], values[ok], color=_MEMBER_COLOR, zorder=3, label='member')
    if (~ok).any():  # Frozen or NaN: drawn at the axis edge so they do not set the scale.
      clipped = np.clip(np.nan_to_num(values[~ok], nan=low), low, high)
      ax.scatter(index[~ok], clipped, marker='x', color=_FROZEN_COLOR, zorder=3,
                 clip_on=False, label='frozen / NaN (clipped)')
    if ok.any():
      ax.axhline(values[ok].mean(), ls='--', color='black', lw=1, label='member mean')
    ax.axhline(ens, color=_ENSEMBLE_COLOR, lw=1.5, label='ensemble')
    ax.scatter([num + 0.5], [ens], marker='D', color=_ENSEMBLE_COLOR, zorder=3)
    if selected:
      ax.axhline(sel, color=_SELECTED_COLOR, ls=':', lw=1.5,
                 label=f'top-{selected["top_k"]} ensemble')
    step = 1 if num <= 16 else max(1, num // 16)
    ax.set_xticks(list(index[::step]) + [num + 0.5],
                  [str(i) for i in index[::step]] + ['ens'], fontsize=8)
    ax.set(title=title, xlabel='member', ylim=(low, high))
  # Below the panels: inside, it would hide the members at the axes' edges.
  fig.legend(handles=axes[0].get_legend_handles_labels()[0], loc='outside lower center',
             ncols=5, fontsize=8, frameon=False)
  _save(fig, out, 'members_vs_ensemble')


def _plot_learning_curves(out: Path, events: list[dict[str, Any]], frozen: set[int]) -> None:
  train = [e for e in events if e.get('split') == 'train' and 'loss' in e.get('members', {})]
  test = [e for e in events if e.get('split') == 'test']
  fig, axes = _figure(12.0, 3.6, 3)
  panels = ((axes[0], train, 'loss', 'train loss (mean over each log interval)', 0.0, None),
            (axes[1], test, 'accuracy', 'test accuracy', 0.0, 1.0),
            (axes[2], test, 'nll', 'test NLL', 0.0, None))
  for ax, series, key, title, floor, ceil in panels:
    ax.set(title=title, xlabel='step')
    if not series:
      ax.text(0.5, 0.5, 'no events', ha='center', transform=ax.transAxes)
      continue
    steps = [e['step'] for e in series]
    per_member = np.array([_floats(e['members'][key]) for e in series])  # [T, M]
    labelled = set()
    for m in range(per_member.shape[1]):
      group = 'frozen members' if m in frozen else 'members'
      ax.plot(steps, per_member[:, m], color=_FROZEN_COLOR if m in frozen else _MEMBER_COLOR,
              lw=0.8, alpha=0.6, marker='.', label=None if group in labelled else group)
      labelled.add(group)
    ens = _floats([e.get('ensemble', {}).get(key) for e in series])
    if np.isfinite(ens).any():
      ax.plot(steps, ens, color=_ENSEMBLE_COLOR, lw=2, marker='o', label='ensemble')
    # A diverged (frozen) member's huge loss would flatten every other curve.
    kept = [m for m in range(per_member.shape[1]) if m not in frozen]
    ax.set_ylim(*_limits(np.concatenate([per_member[:, kept].ravel(), ens]), floor, ceil))
    ax.legend(fontsize=8)
  _save(fig, out, 'learning_curves')


def _plot_ensemble_size(out: Path, spread: SizeSpread, member_mean: dict[str, float]) -> None:
  fig, axes = _figure(9.0, 3.6, 2)
  size = spread.size
  if not len(size):
    for ax in axes:
      ax.text(0.5, 0.5, 'no member left to ensemble', ha='center', transform=ax.transAxes)
    _save(fig, out, 'ensemble_size')
    return
  for ax, key, title, floor, ceil in ((axes[0], 'accuracy', 'test accuracy', 0.0, 1.0),
                                      (axes[1], 'nll', 'test NLL', 0.0, None)):
    low, high = spread.stat(key, 'min'), spread.stat(key, 'max')
    ax.fill_between(size, low, high, color=_ENSEMBLE_COLOR, alpha=0.18, lw=0,
                    label='min-max over subsets')
    ax.fill_between(size, spread.stat(key, 'q25'), spread.stat(key, 'q75'),
                    color=_ENSEMBLE_COLOR, alpha=0.35, lw=0, label='interquartile range')
    ax.plot(size, spread.stat(key, 'mean'), marker='o', ms=3, color=_ENSEMBLE_COLOR,
            label='mean over subsets of size k')
    ax.axhline(member_mean[key], ls='--', color=_MEMBER_COLOR, lw=1, label='member mean')
    ax.set(title=f'{title} (up to {int(spread.num_subsets.max(initial=0))} subsets per k)',
           xlabel='ensemble size k',
           ylim=_limits(np.concatenate([low, high, [member_mean[key]]]), floor, ceil))
    if len(size) < size[-1]:  # Log-spaced sizes of a large ensemble.
      ax.set_xscale('log')
      ax.minorticks_off()
    ticks = size if len(size) <= 16 else size[::max(1, len(size) // 12)]
    ax.set_xticks(ticks, [str(k) for k in ticks])
  axes[0].legend(fontsize=8)
  _save(fig, out, 'ensemble_size')


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


def _plot_sweep(out: Path, final: dict[str, Any]) -> None:
  """Test accuracy vs NLL per member, coloured by the first varying hyperparameter."""
  hparams = final['hyperparameters']
  field = next(iter(hparams))
  color = _floats(hparams[field])
  accuracy, nll = _floats(final['members']['accuracy']), _floats(final['members']['nll'])
  index = np.arange(final['num_members'])
  shown = (np.isfinite(accuracy) & np.isfinite(nll) & np.isfinite(color)
           & ~np.isin(index, final.get('frozen_members', [])))
  fig, axes = _figure(6.8, 5.0, 1)
  ax = axes[0]
  norm, scale = _color_norm(color[shown])
  points = ax.scatter(nll[shown], accuracy[shown], c=color[shown], norm=norm, cmap='viridis',
                      s=55, edgecolors='black', linewidths=0.5, zorder=3, label='member')
  fig.colorbar(points, ax=ax, label=f'{field} ({scale} scale)')
  if shown.sum() <= 40:
    for i in index[shown]:
      ax.annotate(str(i), (nll[i], accuracy[i]), textcoords='offset points', xytext=(5, 4),
                  fontsize=7)
  xs, ys = [nll[shown]], [accuracy[shown]]
  ens = final['ensemble']
  ax.scatter([ens['nll']], [ens['accuracy']], marker='*', s=220, color=_ENSEMBLE_COLOR,
             edgecolors='black', zorder=4, label='ensemble of all')
  xs.append([ens['nll']])
  ys.append([ens['accuracy']])
  selected = final.get('selected')
  if selected:
    chosen = [m for m in selected['members'] if shown[m]]
    ax.scatter(nll[chosen], accuracy[chosen], s=160, facecolors='none',
               edgecolors=_SELECTED_COLOR, linewidths=2, zorder=2,
               label=f'top-{selected["top_k"]} by {selected["by"]}')
    sel = selected['ensemble']
    ax.scatter([sel['nll']], [sel['accuracy']], marker='*', s=220, color=_SELECTED_COLOR,
               edgecolors='black', zorder=4, label=f'ensemble of the top {selected["top_k"]}')
    xs.append([sel['nll']])
    ys.append([sel['accuracy']])
  hidden = int((~shown).sum())
  others = [f for f in hparams if f != field]
  ax.set(xlabel='test NLL (lower is better)', ylabel='test accuracy (higher is better)',
         xlim=_limits(np.concatenate(xs), 0.0), ylim=_limits(np.concatenate(ys), 0.0, 1.0),
         title=f'{len(index)} members, coloured by {field}'
         + (f'\nalso varying: {", ".join(others)}' if others else '')
         + (f'\n{hidden} frozen / non-finite member(s) not shown' if hidden else ''))
  ax.title.set_fontsize(10)
  ax.legend(fontsize=7, markerscale=0.6)
  _save(fig, out, 'sweep_scatter')


def _read_events(path: Path) -> list[dict[str, Any]]:
  if not path.exists():
    return []
  events = []
  for line in path.read_text(encoding='utf-8').splitlines():
    try:
      events.append(_nan_for_null(json.loads(line)))
    except json.JSONDecodeError:
      continue  # A line torn by a crash.
  return events


def _nan_for_null(obj: Any) -> Any:
  """`obj` with JSON nulls as NaN: strict JSON writers store a non-finite metric as null."""
  if isinstance(obj, dict):
    return {k: _nan_for_null(v) for k, v in obj.items()}
  if isinstance(obj, list):
    return [_nan_for_null(v) for v in obj]
  return np.nan if obj is None else obj


def _fmt(value: Any, spec: str = '.4f') -> str:
  """A number for a table; missing or non-finite values (frozen members) as 'NaN'."""
  if value is None or not np.isfinite(float(value)):
    return 'NaN'
  return format(float(value), spec)


def _finite_mean(values: Sequence[Any], members: Sequence[int]) -> float:
  """The mean of values[members] that are finite (NaN when none is)."""
  kept = [v for v in _floats(values)[list(members)] if np.isfinite(v)]
  return float(np.mean(kept)) if kept else np.nan


# (name, label) of every per-member metric, from the one registry (eval.metrics.METRICS):
# the rankable ones first (accuracy, NLL, Brier, ECE, ...), then the descriptions.
_METRIC_COLUMNS = tuple((m.name, m.label) for m in sorted(
    (m for m in METRICS if 'members' in m.scopes), key=lambda m: m.higher_is_better is None))


class _Figure(NamedTuple):
  name: str  # file name without suffix: NAME.png and NAME.svg
  title: str
  caption: str


class _Run(NamedTuple):
  """What the report says about a run, gathered once for report.md and report.html."""
  workdir: Path
  final: dict[str, Any]
  summary: str  # what was trained, which checkpoint, which test split
  active: list[int]  # the non-frozen members: those the ensemble averages
  figures: list[_Figure]


def _reliability_panels(final: dict[str, Any], probs: np.ndarray, member_probs: np.ndarray,
                        labels: np.ndarray, active: list[int]) -> list[tuple[str, Reliability]]:
  """The ensemble, and its best and worst non-frozen member by test NLL."""
  panels = [('ensemble', reliability(probs, labels))]
  nll = _floats(final['members']['nll'])
  if active:
    best = min(active, key=lambda m: nll[m] if np.isfinite(nll[m]) else np.inf)
    worst = max(active, key=lambda m: nll[m] if np.isfinite(nll[m]) else -np.inf)
    panels += [(f'best member ({best}, test NLL {nll[best]:.3f})',
                reliability(member_probs[best], labels)),
               (f'worst member ({worst}, test NLL {nll[worst]:.3f})',
                reliability(member_probs[worst], labels))]
  return panels


def _figures(final: dict[str, Any], spread: SizeSpread, active: list[int]) -> list[_Figure]:
  """The figures written, with the captions report.md and report.html give them."""
  accuracy = _floats(final['members']['accuracy'])[active]
  if len(spread.size):
    full = spread.size[-1]
    size_text = (
        f'Ensembles of k of the {len(active)} non-frozen members: for each k every subset when '
        f'there are at most {spread.accuracy.shape[1]}, else that many drawn at random (numpy '
        'seed 0). The line is the mean over subsets, the bands their interquartile range and '
        f'min-max. All {full} together reach accuracy {spread.stat("accuracy", "mean")[-1]:.4f} '
        f'and NLL {spread.stat("nll", "mean")[-1]:.4f}; single members range over accuracy '
        f'{_fmt(np.nanmin(accuracy))}-{_fmt(np.nanmax(accuracy))}.')
  else:
    size_text = 'No member is left to ensemble.'
  figures = [
      _Figure('reliability', 'Reliability',
              f'Accuracy per confidence bin ({NUM_ECE_BINS} equal-width bins) against the '
              'diagonal of perfect calibration; the hatched red part is the gap to the bin\'s '
              'mean confidence, ECE in each title. Below: how many test examples fall in each '
              'bin.'),
      _Figure('members_vs_ensemble', 'Members and the ensemble',
              'Every member\'s test metrics, the member mean (dashed), the ensemble (orange) and '
              'the top-k ensemble when members were selected (green, dotted). Frozen or '
              'non-finite members are grey crosses at the axis edge. Axes span the data.'),
      _Figure('learning_curves', 'Learning curves',
              'Train loss and test metrics of every member over steps, the ensemble in orange.'),
      _Figure('ensemble_size', 'Ensemble size', size_text)]
  if final.get('hyperparameters'):
    field = next(iter(final['hyperparameters']))
    figures.append(_Figure(
        'sweep_scatter', 'Sweep: accuracy vs NLL per member',
        f'Every member\'s test accuracy against its test NLL, coloured by {field} (a log '
        'colour scale when its values span more than 10x); stars: the ensemble of all and of '
        'the selected members, circled: the selected members.'))
  return figures


def _ood_table(ood: dict[str, Any], active: list[int]) -> str:
  ens = ood['ensemble']
  return '\n'.join([
      f'OOD set: `{ood.get("dataset", "?")}` (positive class), scored by the ensemble\'s '
      'uncertainty:', '',
      '| score | AUROC | AUPR | mean in-dist. | mean OOD |', '|---|---|---|---|---|',
      *('| ' + ' | '.join(row) + ' |' for row in _ood_rows(ood, active))])


def _ood_rows(ood: dict[str, Any], active: list[int]) -> list[list[str]]:
  ens, members = ood['ensemble'], ood['members']
  return [
      ['predictive entropy', _fmt(ens['auroc_entropy']), _fmt(ens['aupr_entropy']),
       _fmt(ens['entropy_in']), _fmt(ens['entropy_out'])],
      ['mutual information', _fmt(ens['auroc_mi']), _fmt(ens['aupr_mi']), _fmt(ens['mi_in']),
       _fmt(ens['mi_out'])],
      ['member entropy (mean of non-frozen members)',
       _fmt(_finite_mean(members['auroc_entropy'], active)),
       _fmt(_finite_mean(members['aupr_entropy'], active)), '', '']]


def _markdown(run: _Run) -> str:
  final = run.final
  lines = [f'# dist_ens report: `{run.workdir}`', '', run.summary, '',
           'Every table and figure in one page: [report.html](report.html).', '',
           '## Test metrics', '', tables.results_table(final), '']
  if 'selected' in final:
    sel = final['selected']
    lines += [f'Ensemble of the {sel["top_k"]} best members {sel["members"]} by {sel["by"]}: '
              + ', '.join(f'{name} {_fmt(sel["ensemble"].get(k))}' for k, name in
                          _METRIC_COLUMNS[:4]) + '.', '']
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
  columns = [(k, name) for k, name in _METRIC_COLUMNS if k in members]
  rows = [([str(i) if i in active else f'{i} (frozen)'] + [_fmt(members[k][i]) for k, _ in columns],
           'member' if i in active else 'frozen') for i in range(final['num_members'])]
  rows.append((['member mean (non-frozen)']
               + [_fmt(_finite_mean(members[k], active)) for k, _ in columns], 'mean'))
  rows.append((['ensemble'] + [_fmt(ens.get(k)) for k, _ in columns], 'ensemble'))
  if 'selected' in final:
    sel = final['selected']
    rows.append(([f'top-{sel["top_k"]} ensemble']
                 + [_fmt(sel['ensemble'].get(k)) for k, _ in columns], 'selected'))
  notes = [f'ensemble disagreement {_fmt(ens.get("disagreement"))}']
  if 'mutual_information' in ens:
    notes.append(f'predictive entropy {_fmt(ens["entropy"])} = expected entropy (aleatoric) '
                 f'{_fmt(ens["expected_entropy"])} + mutual information (epistemic) '
                 f'{_fmt(ens["mutual_information"])}; mean pairwise KL '
                 f'{_fmt(ens.get("pairwise_kl"))}')
  return (_html_table(['member'] + [name for _, name in columns], rows)
          + ''.join(f'\n<p class="note">{html.escape(n)}</p>' for n in notes))


def _selected_html(final: dict[str, Any], active: list[int]) -> str:
  sel = final['selected']
  keys = [(k, name) for k, name in _METRIC_COLUMNS[:4]]
  rows = [(['all non-frozen', ', '.join(map(str, active))]
           + [_fmt(final['ensemble'].get(k)) for k, _ in keys], 'ensemble'),
          ([f'top {sel["top_k"]} by {sel["by"]}', ', '.join(map(str, sel['members']))]
           + [_fmt(sel['ensemble'].get(k)) for k, _ in keys], 'selected')]
  return _html_table(['ensemble', 'members'] + [name for _, name in keys], rows)


def _hparams_html(final: dict[str, Any], active: list[int]) -> str:
  hparams = final['hyperparameters']
  chosen = set(final.get('selected', {}).get('members', []))
  splits = [('validation', final['validation']['members'])] if 'validation' in final else []
  splits.append(('test', final['members']))
  header = (['member'] + list(hparams)
            + [f'{split} {k}' for split, _ in splits for k in ('accuracy', 'NLL')]
            + (['selected'] if chosen else []))
  rows = []
  for i in range(final['num_members']):
    cells = [str(i) if i in active else f'{i} (frozen)']
    cells += [_fmt(values[i], '.4g') for values in hparams.values()]
    cells += [_fmt(metrics[k][i]) for _, metrics in splits for k in ('accuracy', 'nll')]
    cells += (['yes' if i in chosen else ''] if chosen else [])
    rows.append((cells, 'member' if i in active else 'frozen'))
  return _html_table(header, rows)


def _figure_html(out: Path, figure: _Figure) -> str:
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


def _html(run: _Run, out: Path) -> str:
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


def make_report(workdir: str | Path, devices: Sequence[jax.Device] | None = None) -> Path:
  """Writes WORKDIR/report/ (the figures as PNG and SVG, report.md, report.html); returns it.

  Example:
    make_report('/tmp/run')  # -> Path('/tmp/run/report'); open report/report.html

  Args:
    workdir: a finished run's workdir (final_metrics.json, config.json, checkpoints/).
    devices: where to run the predictions (default: all devices).

  Raises:
    FileNotFoundError: the run has not finished (no final_metrics.json) or has no
      restorable checkpoint.
  """
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise ImportError("dist-ens report draws with matplotlib: pip install 'dist_ens[report]'"
                      ) from None
  workdir = Path(workdir)
  final_path = workdir / 'final_metrics.json'
  if not final_path.is_file():
    raise FileNotFoundError(f'{final_path} does not exist: the run in {workdir} has not '
                            'finished; run (or resume) its training command first.')
  final = _nan_for_null(json.loads(final_path.read_text()))
  ensemble = Ensemble.load(workdir, devices=devices)
  test = data.load_dataset(ensemble.config.data.name, ensemble.config.data).test
  prediction = ensemble.predict(test.x, preprocessed=True)
  frozen = set(final.get('frozen_members', []))
  active = [m for m in range(final['num_members']) if m not in frozen]
  out = workdir / 'report'
  out.mkdir(parents=True, exist_ok=True)

  _plot_reliability(out, _reliability_panels(final, prediction.probs, prediction.member_probs,
                                             test.y, active))
  _plot_members_vs_ensemble(out, final)
  _plot_learning_curves(out, _read_events(workdir / 'metrics.jsonl'), frozen)
  spread = ensemble_size_spread(prediction.member_probs, test.y, active)
  _plot_ensemble_size(out, spread, {k: _finite_mean(final['members'][k], active)
                                    for k in ('accuracy', 'nll')})
  if final.get('hyperparameters'):
    _plot_sweep(out, final)

  config = ensemble.config
  summary = (f'{config.num_members} x {config.model.name} on {config.data.name}, step '
             f'{ensemble.step} of {config.train.steps}, test split of {len(test.y)} examples'
             + (f'; frozen members {sorted(frozen)} are left out of the ensemble'
                if frozen else '') + '.')
  run = _Run(workdir, final, summary, active, _figures(final, spread, active))
  (out / 'report.md').write_text(_markdown(run), encoding='utf-8')
  (out / 'report.html').write_text(_html(run, out), encoding='utf-8')
  return out


def main(argv: Sequence[str] | None = None) -> int:
  """Command line: `dist-ens report --workdir DIR` or `python -m dist_ens.io.report --workdir DIR`."""
  parser = argparse.ArgumentParser(
      prog='dist-ens report',
      description='Write WORKDIR/report/: reliability diagrams, member-vs-ensemble bars, '
                  'learning curves, accuracy vs ensemble size, and report.md.')
  parser.add_argument('--workdir', required=True, help='the workdir of a finished run')
  args = parser.parse_args(argv)
  try:
    out = make_report(args.workdir)
  except FileNotFoundError as e:
    print(f'dist-ens report: error: {e}', file=sys.stderr)
    return 1
  print(f'wrote {out / "report.md"} and {", ".join(FIGURES)}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
