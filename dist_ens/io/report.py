"""`dist-ens report --workdir DIR`: plots and a Markdown report of a finished run.

  python -m dist_ens.io.report --workdir /tmp/run     # the same as `dist-ens report ...`

Writes DIR/report/:
  reliability.png          reliability diagrams: the ensemble, its best and worst member
  members_vs_ensemble.png  test accuracy, NLL and ECE of every member next to the ensemble
  learning_curves.png      train loss and test accuracy/NLL of every member over steps
  ensemble_size.png        test accuracy and NLL of the ensemble of the first k members
  report.md                the final metrics table with the figures embedded

Tables come from final_metrics.json and metrics.jsonl; the figures that need
predictions (reliability, ensemble size) load the final checkpoint with
dist_ens.inference.Ensemble and predict the test split, on whatever devices exist.
Plots use matplotlib's Agg canvas directly (no pyplot, no display, no global state).
"""

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from dist_ens import data
from dist_ens.io import tables, writers
from dist_ens.inference import Ensemble
from dist_ens.eval.metrics import NUM_ECE_BINS

FIGURES = ('reliability.png', 'members_vs_ensemble.png', 'learning_curves.png',
           'ensemble_size.png')
_MEMBER_COLOR, _ENSEMBLE_COLOR = '#4c72b0', '#dd8452'


class Reliability(NamedTuple):
  """Equal-width confidence bins of one predictor (empty bins have count 0)."""
  accuracy: np.ndarray  # [NUM_ECE_BINS] fraction correct per bin (0 where empty)
  confidence: np.ndarray  # [NUM_ECE_BINS] mean confidence per bin (0 where empty)
  count: np.ndarray  # [NUM_ECE_BINS]
  ece: float


def reliability(probs: np.ndarray, labels: np.ndarray,
                num_bins: int = NUM_ECE_BINS) -> Reliability:
  """Binned accuracy and confidence, with bins and ECE as in dist_ens.eval.metrics.

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
  confidence = probs.max(-1)
  correct = (probs.argmax(-1) == labels).astype(np.float64)
  index = np.clip(np.floor(confidence * num_bins).astype(int), 0, num_bins - 1)
  count = np.bincount(index, minlength=num_bins)
  conf_sum = np.bincount(index, confidence, minlength=num_bins)
  correct_sum = np.bincount(index, correct, minlength=num_bins)
  safe = np.maximum(count, 1)
  return Reliability(correct_sum / safe, conf_sum / safe, count,
                     float(np.abs(correct_sum - conf_sum).sum() / len(labels)))


def ensemble_size_curve(member_probs: np.ndarray, labels: np.ndarray,
                        members: Sequence[int]) -> dict[str, np.ndarray]:
  """Accuracy and NLL of the ensembles of the first k of `members`, k = 1..len(members).

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
  rows = np.arange(len(labels))
  for k, m in enumerate(members, start=1):
    running += member_probs[m]
    mean = running / k
    accuracy.append(float(np.mean(mean.argmax(-1) == labels)))
    nll.append(float(-np.mean(np.log(np.maximum(mean[rows, labels], 1e-300)))))
  return {'size': np.arange(1, len(members) + 1), 'accuracy': np.array(accuracy),
          'nll': np.array(nll)}


def _figure(width: float, height: float, ncols: int):
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(width, height), dpi=100, layout='constrained')
  return fig, fig.subplots(1, ncols, squeeze=False)[0]


def _plot_reliability(path: Path, panels: list[tuple[str, Reliability]]) -> None:
  fig, axes = _figure(4.0 * len(panels), 4.0, len(panels))
  edges = np.linspace(0.0, 1.0, NUM_ECE_BINS + 1)
  width = edges[1] - edges[0]
  for ax, (title, r) in zip(axes, panels):
    filled = r.count > 0
    ax.bar(edges[:-1][filled], r.accuracy[filled], width=width, align='edge',
           color=_MEMBER_COLOR, edgecolor='white', label='accuracy')
    # The gap between confidence and accuracy: what ECE averages (weighted by count).
    # Hatched, not filled: under-confident bins draw the gap over the accuracy bar.
    ax.bar(edges[:-1][filled], r.confidence[filled] - r.accuracy[filled],
           bottom=r.accuracy[filled], width=width, align='edge', color='none',
           edgecolor='#c44e52', hatch='///', linewidth=0.8, label='gap to mean confidence')
    ax.plot([0, 1], [0, 1], '--', color='gray', lw=1, label='perfect calibration')
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel='confidence (top-class probability)',
           title=f'{title}\nECE {r.ece:.3f}, {int(r.count.sum())} examples')
    ax.set_aspect('equal')
  axes[0].set_ylabel('accuracy')
  axes[0].legend(loc='upper left', fontsize=8)
  fig.savefig(path)


def _plot_members_vs_ensemble(path: Path, final: dict[str, Any]) -> None:
  metrics = (('accuracy', 'test accuracy (higher is better)'), ('nll', 'test NLL'),
             ('ece', 'test ECE'))
  fig, axes = _figure(12.0, 3.6, len(metrics))
  num = final['num_members']
  frozen = set(final.get('frozen_members', []))
  for ax, (key, title) in zip(axes, metrics):
    values = np.asarray(final['members'][key], np.float64)
    ax.bar(np.arange(num), np.nan_to_num(values),
           color=['#bbbbbb' if i in frozen else _MEMBER_COLOR for i in range(num)])
    ax.bar([num + 0.5], [final['ensemble'][key]], color=_ENSEMBLE_COLOR)
    kept = [v for i, v in enumerate(values) if i not in frozen and np.isfinite(v)]
    if kept:
      ax.axhline(np.mean(kept), ls='--', color='black', lw=1, label='member mean')
    ax.set_xticks(list(range(num)) + [num + 0.5], [str(i) for i in range(num)] + ['ens'],
                  fontsize=8 if num <= 16 else 5)
    ax.set(title=title, xlabel='member')
  axes[0].legend(loc='lower right', fontsize=8)
  fig.savefig(path)


def _plot_learning_curves(path: Path, events: list[dict[str, Any]]) -> None:
  train = [e for e in events if e.get('split') == 'train' and 'loss' in e.get('members', {})]
  test = [e for e in events if e.get('split') == 'test']
  fig, axes = _figure(12.0, 3.6, 3)
  panels = ((axes[0], train, 'loss', 'train loss (mean over each log interval)'),
            (axes[1], test, 'accuracy', 'test accuracy'), (axes[2], test, 'nll', 'test NLL'))
  for ax, series, key, title in panels:
    ax.set(title=title, xlabel='step')
    if not series:
      ax.text(0.5, 0.5, 'no events', ha='center', transform=ax.transAxes)
      continue
    steps = [e['step'] for e in series]
    per_member = np.array([e['members'][key] for e in series], np.float64)  # [T, M]
    for m in range(per_member.shape[1]):
      ax.plot(steps, per_member[:, m], color=_MEMBER_COLOR, lw=0.8, alpha=0.6, marker='.',
              label='members' if m == 0 else None)
    if series[0].get('ensemble', {}).get(key) is not None:
      ax.plot(steps, [e['ensemble'][key] for e in series], color=_ENSEMBLE_COLOR, lw=2,
              marker='o', label='ensemble')
    ax.legend(fontsize=8)
  fig.savefig(path)


def _plot_ensemble_size(path: Path, curve: dict[str, np.ndarray],
                        member_mean: dict[str, float]) -> None:
  fig, axes = _figure(8.0, 3.4, 2)
  for ax, key, title in ((axes[0], 'accuracy', 'test accuracy'), (axes[1], 'nll', 'test NLL')):
    ax.plot(curve['size'], curve[key], marker='o', color=_ENSEMBLE_COLOR,
            label='ensemble of the first k members')
    ax.axhline(member_mean[key], ls='--', color=_MEMBER_COLOR, lw=1, label='member mean')
    ax.set(title=title, xlabel='ensemble size k')
    ax.set_xticks(curve['size'] if len(curve['size']) <= 16 else curve['size'][::4])
  axes[0].legend(fontsize=8)
  fig.savefig(path)


def _read_events(path: Path) -> list[dict[str, Any]]:
  if not path.exists():
    return []
  events = []
  for line in path.read_text(encoding='utf-8').splitlines():
    try:
      events.append(json.loads(line))
    except json.JSONDecodeError:
      continue  # A line torn by a crash.
  return events


def _ood_table(ood: dict[str, Any]) -> str:
  ens = ood['ensemble']
  return '\n'.join([
      f'OOD set: `{ood.get("dataset", "?")}` (positive class), scored by the ensemble\'s '
      'uncertainty:', '',
      '| score | AUROC | AUPR | mean in-dist. | mean OOD |', '|---|---|---|---|---|',
      f'| predictive entropy | {ens["auroc_entropy"]:.4f} | {ens["aupr_entropy"]:.4f} | '
      f'{ens["entropy_in"]:.4f} | {ens["entropy_out"]:.4f} |',
      f'| mutual information | {ens["auroc_mi"]:.4f} | {ens["aupr_mi"]:.4f} | '
      f'{ens["mi_in"]:.4f} | {ens["mi_out"]:.4f} |',
      f'| member entropy (mean of members) | {np.mean(ood["members"]["auroc_entropy"]):.4f} | '
      f'{np.mean(ood["members"]["aupr_entropy"]):.4f} | | |'])


def make_report(workdir: str | Path, devices: Sequence[jax.Device] | None = None) -> Path:
  """Writes WORKDIR/report/ (the figures in FIGURES and report.md); returns its path.

  Example:
    make_report('/tmp/run')  # -> Path('/tmp/run/report')

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
  final = json.loads(final_path.read_text())
  ensemble = Ensemble.load(workdir, devices=devices)
  test = data.load_dataset(ensemble.config.data.name, ensemble.config.data).test
  prediction = ensemble.predict(test.x, preprocessed=True)
  frozen = set(final.get('frozen_members', []))
  active = [m for m in range(final['num_members']) if m not in frozen]
  out = workdir / 'report'
  out.mkdir(parents=True, exist_ok=True)

  nll = np.asarray(final['members']['nll'], np.float64)
  panels = [('ensemble', reliability(prediction.probs, test.y))]
  if active:
    best = min(active, key=lambda m: nll[m] if np.isfinite(nll[m]) else np.inf)
    worst = max(active, key=lambda m: nll[m] if np.isfinite(nll[m]) else -np.inf)
    panels += [(f'best member ({best}, test NLL {nll[best]:.3f})',
                reliability(prediction.member_probs[best], test.y)),
               (f'worst member ({worst}, test NLL {nll[worst]:.3f})',
                reliability(prediction.member_probs[worst], test.y))]
  _plot_reliability(out / 'reliability.png', panels)
  _plot_members_vs_ensemble(out / 'members_vs_ensemble.png', final)
  _plot_learning_curves(out / 'learning_curves.png', _read_events(workdir / 'metrics.jsonl'))
  curve = ensemble_size_curve(prediction.member_probs, test.y, active)
  member_mean = {k: float(np.mean([final['members'][k][m] for m in active]))
                 for k in ('accuracy', 'nll')} if active else {'accuracy': np.nan, 'nll': np.nan}
  _plot_ensemble_size(out / 'ensemble_size.png', curve, member_mean)

  config = ensemble.config
  lines = [
      f'# dist_ens report: `{workdir}`', '',
      f'{config.num_members} x {config.model.name} on {config.data.name}, step '
      f'{ensemble.step} of {config.train.steps}, test split of {len(test.y)} examples'
      + (f'; frozen members {sorted(frozen)} are left out of the ensemble' if frozen else '')
      + '.', '',
      '## Test metrics', '', tables.results_table(final), '']
  if 'ood' in final:
    lines += ['## Out-of-distribution detection', '', _ood_table(final['ood']), '']
  lines += [
      '## Reliability', '',
      'Accuracy per confidence bin (15 equal-width bins) against the diagonal of perfect '
      'calibration; the hatched red part is the gap to the bin\'s mean confidence.', '',
      '![reliability](reliability.png)', '',
      '## Members and the ensemble', '', '![members vs ensemble](members_vs_ensemble.png)', '',
      '## Learning curves', '', '![learning curves](learning_curves.png)', '',
      '## Ensemble size', '',
      'The ensemble of the first k members (in member order) for k = 1..'
      f'{len(active)}: the full ensemble reaches accuracy {curve["accuracy"][-1]:.4f} and NLL '
      f'{curve["nll"][-1]:.4f}.' if active else 'No member is left to ensemble.', '',
      '![ensemble size](ensemble_size.png)', '']
  (out / 'report.md').write_text('\n'.join(lines), encoding='utf-8')
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
