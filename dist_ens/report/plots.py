"""The report's figures, each written as NAME.png (at DPI) and NAME.svg.

Plots use matplotlib's Agg canvas directly (no pyplot, no display, no global state).
Non-finite metrics (members frozen when they diverged) are drawn apart, so that they
do not set an axis' scale.
"""

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from dist_ens.eval.metrics import NUM_ECE_BINS
from dist_ens.report.data import floats
from dist_ens.report.stats import Reliability, SizeSpread, reliability
from dist_ens.io.tables import MAX_ROWS

DPI = 150
_MEMBER_COLOR, _ENSEMBLE_COLOR, _SELECTED_COLOR = '#4c72b0', '#dd8452', '#55a868'
_FROZEN_COLOR = '#999999'
# Learning curves draw a line per member up to this many members, their spread beyond
# (the console's and the report's tables summarise beyond the same count).
MAX_CURVES = MAX_ROWS


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
  """A figure (inches) and its axes: a row of ncols, or an [nrows, ncols] grid."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(width, height), dpi=100, layout='constrained')
  axes = fig.subplots(nrows, ncols, squeeze=False, **grid)
  return fig, (axes[0] if nrows == 1 else axes)


def _save(fig: Any, out: Path, name: str) -> None:
  """NAME.png at DPI and NAME.svg (vector, text as paths: no fonts needed to view it)."""
  path = out / name
  fig.savefig(path.with_suffix('.png'), dpi=DPI)
  # The SVG keeps the layout the PNG's save computed (within half a point): laid out once.
  fig.set_layout_engine('none')
  fig.savefig(path.with_suffix('.svg'), metadata={'Date': None})



def reliability_panels(final: dict[str, Any], probs: np.ndarray, member_probs: np.ndarray,
                       labels: np.ndarray, active: list[int]) -> list[tuple[str, Reliability]]:
  """The ensemble, and its best and worst non-frozen member by test NLL."""
  panels = [('ensemble', reliability(probs, labels))]
  nll = floats(final['members']['nll'])
  if active:
    best = min(active, key=lambda m: nll[m] if np.isfinite(nll[m]) else np.inf)
    worst = max(active, key=lambda m: nll[m] if np.isfinite(nll[m]) else -np.inf)
    panels += [(f'best member ({best}, test NLL {nll[best]:.3f})',
                reliability(member_probs[best], labels)),
               (f'worst member ({worst}, test NLL {nll[worst]:.3f})',
                reliability(member_probs[worst], labels))]
  return panels


def plot_reliability(out: Path, panels: list[tuple[str, Reliability]]) -> None:
  """reliability: one diagram per (title, Reliability) panel, its bin counts below."""
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


# (key, title, axis floor, axis ceiling) of the classification report's panels.
MEMBER_PANELS = (('accuracy', 'test accuracy (higher is better)', 0.0, 1.0),
                 ('nll', 'test NLL (lower is better)', 0.0, None),
                 ('ece', 'test ECE (lower is better)', 0.0, 1.0))
TEST_PANELS = (('accuracy', 'test accuracy', 0.0, 1.0), ('nll', 'test NLL', 0.0, None))


def plot_members_vs_ensemble(out: Path, final: dict[str, Any],
                             metrics: tuple = MEMBER_PANELS) -> None:
  """members_vs_ensemble: every member's test metrics (one panel per (key, title, floor,
  ceiling) of `metrics`; accuracy, NLL and ECE by default) beside the ensemble."""
  fig, axes = _figure(12.0, 3.8, len(metrics))
  num = final['num_members']
  index = np.arange(num)
  frozen = np.isin(index, final.get('frozen_members', []))
  selected = final.get('selected')
  for ax, (key, title, floor, ceil) in zip(axes, metrics):
    values = floats(final['members'][key])
    ens = final['ensemble'].get(key, np.nan)
    sel = selected['ensemble'].get(key, np.nan) if selected else np.nan
    ok = np.isfinite(values) & ~frozen
    low, high = _limits(np.concatenate([values[ok], floats([ens, sel])]), floor, ceil)
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


def plot_learning_curves(out: Path, events: list[dict[str, Any]], frozen: set[int],
                         test_panels: tuple = TEST_PANELS, loss_floor: float | None = 0.0
                         ) -> None:
  """learning_curves: train loss and the test metrics of `test_panels` (key, title, floor,
  ceiling; accuracy and NLL by default) of every member over steps. loss_floor=None for a
  loss that can be negative (a Gaussian NLL)."""
  train = [e for e in events if e.get('split') == 'train' and 'loss' in e.get('members', {})]
  test = [e for e in events if e.get('split') == 'test']
  fig, axes = _figure(12.0, 3.6, 1 + len(test_panels))
  panels = ((axes[0], train, 'loss', 'train loss (mean over each log interval)', loss_floor,
             None),
            *((ax, test, *panel) for ax, panel in zip(axes[1:], test_panels)))
  for ax, series, key, title, floor, ceil in panels:
    ax.set(title=title, xlabel='step')
    if not series:
      ax.text(0.5, 0.5, 'no events', ha='center', transform=ax.transAxes)
      continue
    steps = [e['step'] for e in series]
    per_member = np.array([floats(e['members'][key]) for e in series])  # [T, M]
    # A diverged (frozen) member's huge loss would flatten every other curve.
    kept = [m for m in range(per_member.shape[1]) if m not in frozen]
    if per_member.shape[1] <= MAX_CURVES:
      _member_curves(ax, steps, per_member, frozen)
    else:
      _member_spread(ax, steps, per_member[:, kept])
    ens = floats([e.get('ensemble', {}).get(key) for e in series])
    if np.isfinite(ens).any():
      ax.plot(steps, ens, color=_ENSEMBLE_COLOR, lw=2, marker='o', label='ensemble')
    ax.set_ylim(*_limits(np.concatenate([per_member[:, kept].ravel(), ens]), floor, ceil))
    ax.legend(fontsize=8)
  _save(fig, out, 'learning_curves')


def learning_curves_members(num_members: int) -> str:
  """How the learning curves show the members, for the figure's caption."""
  if num_members <= MAX_CURVES:
    return 'every member (a line each)'
  return (f'the {num_members} members\' median, interquartile range and range (non-frozen '
          'members; metrics.jsonl holds each)')


def _member_curves(ax: Any, steps: list[int], per_member: np.ndarray, frozen: set[int]) -> None:
  """One line per member of [T, M] values, frozen members in grey."""
  labelled = set()
  for m in range(per_member.shape[1]):
    group = 'frozen members' if m in frozen else 'members'
    ax.plot(steps, per_member[:, m], color=_FROZEN_COLOR if m in frozen else _MEMBER_COLOR,
            lw=0.8, alpha=0.6, marker='.', label=None if group in labelled else group)
    labelled.add(group)


def _member_spread(ax: Any, steps: list[int], per_member: np.ndarray) -> None:
  """The members' spread per step of [T, M] values: median, interquartile range, range
  (non-finite values left out): hundreds of lines would be one blot, slow to draw."""
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', RuntimeWarning)  # A step with no finite member.
    low, q25, median, q75, high = np.nanquantile(per_member, (0, 0.25, 0.5, 0.75, 1), axis=1)
  m = per_member.shape[1]
  ax.fill_between(steps, low, high, color=_MEMBER_COLOR, alpha=0.15, lw=0,
                  label=f'{m} members: range')
  ax.fill_between(steps, q25, q75, color=_MEMBER_COLOR, alpha=0.35, lw=0, label='25-75%')
  ax.plot(steps, median, color=_MEMBER_COLOR, lw=1.2, marker='.', label='median member')


def plot_ensemble_size(out: Path, spread: SizeSpread, member_mean: dict[str, float],
                       panels: tuple = TEST_PANELS) -> None:
  """ensemble_size: test metrics against ensemble size, over member subsets: one panel per
  (key, title, floor, ceiling) of `panels` (accuracy and NLL by default); `spread` is any
  object with SizeSpread's size, num_subsets and stat(key, name)."""
  fig, axes = _figure(4.5 * len(panels), 3.6, len(panels))
  size = spread.size
  if not len(size):
    for ax in axes:
      ax.text(0.5, 0.5, 'no member left to ensemble', ha='center', transform=ax.transAxes)
    _save(fig, out, 'ensemble_size')
    return
  for ax, (key, title, floor, ceil) in zip(axes, panels):
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


def shift_by_severity(final: dict[str, Any], key: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """[member mean, ensemble] x severity 0..5 of metric `key` (0: the clean test split; k: the
  mean over the corruption families run at severity k, NaN where none was), and each
  family's ensemble curve."""
  corruptions = final['shift']['corruptions']
  frozen = set(final.get('frozen_members', []))

  def member_mean(result):
    values = floats(result['members'][key])
    return np.nanmean([v for i, v in enumerate(values) if i not in frozen])

  curves = np.full((2, 6), np.nan)
  curves[:, 0] = member_mean(final), final['ensemble'][key]
  for severity in range(1, 6):
    found = [sev[str(severity)] for sev in corruptions.values() if str(severity) in sev]
    if found:
      curves[:, severity] = (np.mean([member_mean(r) for r in found]),
                             np.mean([r['ensemble'][key] for r in found]))
  families = {name: np.array([final['ensemble'][key]] + [
      sev[str(s)]['ensemble'][key] if str(s) in sev else np.nan for s in range(1, 6)])
              for name, sev in corruptions.items()}
  return curves, families


def plot_shift(out: Path, final: dict[str, Any]) -> None:
  """shift: test accuracy, NLL and ECE against corruption severity (0 = clean)."""
  metrics = (('accuracy', 'accuracy (higher is better)'), ('nll', 'NLL (lower is better)'),
             ('ece', 'ECE (lower is better)'))
  fig, axes = _figure(12.0, 3.8, len(metrics))
  severity = np.arange(6)
  for ax, (key, title) in zip(axes, metrics):
    curves, families = shift_by_severity(final, key)
    for values in families.values():
      ok = np.isfinite(values)
      ax.plot(severity[ok], values[ok], color=_ENSEMBLE_COLOR, alpha=0.25, lw=1)
    ok = np.isfinite(curves[1])  # severities no family ran are skipped, not gaps
    ax.plot(severity[ok], curves[0, ok], 'o--', color='black', lw=1, label='member mean')
    ax.plot(severity[ok], curves[1, ok], 'D-', color=_ENSEMBLE_COLOR, lw=2, label='ensemble')
    ax.set(title=f'test {title}', xlabel='corruption severity (0 = clean)',
           ylim=_limits(np.concatenate([curves.ravel(), *families.values()]), 0.0))
  fig.legend(handles=axes[0].get_legend_handles_labels()[0], loc='outside lower center',
             ncols=2, fontsize=8, frameon=False)
  _save(fig, out, 'shift')
