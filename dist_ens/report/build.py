"""`dist-ens report --workdir DIR`: plots, a Markdown report and one self-contained HTML page.

  python -m dist_ens.report.build --workdir /tmp/run     # the same as `dist-ens report ...`

Writes DIR/report/ (every figure as NAME.png at 150 dpi and NAME.svg):
  reliability              reliability diagrams with bin counts: the ensemble, its best and
                           worst member
  members_vs_ensemble      test accuracy, NLL and ECE of every member next to the ensemble
  learning_curves          train loss and test accuracy/NLL of every member over steps
  ensemble_size            test accuracy and NLL against ensemble size k: mean and spread over
                           random subsets of k members
  sweep_scatter            (runs whose members differ in hyperparameters) test accuracy vs NLL
                           per member, coloured by the first varying hyperparameter
  methods                  (runs with an ensemble method's members, MC dropout, temperature
                           scaling or selection) test accuracy, NLL and ECE of each way the
                           run predicted, beside the trained members' ensemble
  shift                    (runs with config.eval.shift) test accuracy, NLL and ECE against
                           corruption severity, the ensemble beside the member mean
  report.md                the final metrics table with the figures linked
  report.html              every table and figure in one file (figures inline), no server needed

A regression run (config.task='regression') gets its own figures instead of reliability
and the classification metrics: a calibration curve of its central intervals, predicted
against true with intervals, and RMSE and NLL in the others (dist_ens.report.regression).

Tables come from final_metrics.json and metrics.jsonl; the figures that need
predictions (reliability, ensemble size) load the final checkpoint with
dist_ens.Ensemble and predict the test split, on whatever devices exist.
Non-finite metrics (members frozen when they diverged) are drawn apart and printed as NaN.

The pieces: data.py reads the workdir, stats.py computes from the predictions, plots.py
and scatter.py draw the figures, pages.py writes report.md and report.html.
"""

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dist_ens.config import specs
from dist_ens import data
from dist_ens.errors import ConfigError
from dist_ens.inference.ensemble import Ensemble
from dist_ens.inference.prediction import GaussianPrediction, Prediction
from dist_ens.report import pbt, plots, regression, scatter
from dist_ens.report.data import finite_mean, method_rows, read_events, read_final_metrics
from dist_ens.report.pages import Figure, Run, html_page, markdown, report_figures
from dist_ens.report.stats import SizeSpread, ensemble_size_spread

PBT_CAPTION = ('Every member\'s explored hyperparameters over the run (a step line each) and '
               'the validation metric PBT ranked them by at each round; a dot marks a member '
               'that copied a better one\'s state there and took perturbed values.')


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
    ConfigError: final_metrics.json is damaged, or the task has no figures yet.
  """
  workdir = Path(workdir)
  try:  # First: a run that has not finished needs no matplotlib to say so.
    final = read_final_metrics(workdir)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:  # Truncated or overwritten.
    raise ConfigError(f'{workdir / "final_metrics.json"} is damaged ({e}); run the training '
                      'command again on this workdir to rewrite it.') from None
  try:
    importlib.import_module('matplotlib')  # Only whether it imports, before any work.
  except ImportError:
    raise ImportError("dist-ens report draws with matplotlib: pip install 'dist_ens[report]'"
                      ) from None
  ensemble = Ensemble.load(workdir, devices=devices)
  test = data.load_dataset(ensemble.config.data.name,
                           specs.data_spec(ensemble.config)).test
  prediction = ensemble.predict(test.x, preprocessed=True)
  frozen = set(final.get('frozen_members', []))
  active = [m for m in range(final['num_members']) if m not in frozen]
  out = workdir / 'report'
  out.mkdir(parents=True, exist_ok=True)

  if isinstance(prediction, GaussianPrediction):  # A regression task's mixture.
    figures = regression.draw(out, workdir, final, prediction, test.y, frozen, active)
  else:
    figures = report_figures(final, _draw_figures(out, workdir, final, prediction, test.y,
                                                  frozen, active), active)
  config = ensemble.config
  if final.get('pbt') and pbt.plot_pbt(out, config, read_events(workdir / 'metrics.jsonl')):
    figures.append(Figure('pbt', 'Population-based training', PBT_CAPTION))
  summary = (f'{_members_text(config, final)} on {config.data.name}, step '
             f'{ensemble.step} of {config.train.steps}, test split of {len(test.y)} examples'
             + (f'; frozen members {sorted(frozen)} are left out of the ensemble'
                if frozen else '') + '.')
  run = Run(workdir, final, summary, active, figures)
  (out / 'report.md').write_text(markdown(run), encoding='utf-8')
  (out / 'report.html').write_text(html_page(run, out), encoding='utf-8')
  return out


def _members_text(config: Any, final: dict[str, Any]) -> str:
  """'8 x mlp', or with member groups each group's count, name and model overrides."""
  groups = final.get('groups')
  if not groups:
    return f'{config.num_members} x {config.model.name}'

  def one(name: str, group: dict[str, Any]) -> str:
    model = dict(group['model'])
    text = f"{len(group['members'])} x {name}: {model.pop('name', config.model.name)}"
    return text + (f' {model}' if model else '')

  return (f'{config.num_members} members in {len(groups)} groups ('
          + ', '.join(one(name, group) for name, group in groups.items()) + ')')


def _draw_figures(out: Path, workdir: Path, final: dict[str, Any], prediction: Prediction,
                  labels: np.ndarray, frozen: set[int], active: list[int]) -> SizeSpread:
  """Every figure into `out`; returns the ensemble-size spread, which its caption quotes."""
  plots.plot_reliability(out, plots.reliability_panels(
      final, prediction.probs, prediction.member_probs, labels, active))
  plots.plot_members_vs_ensemble(out, final)
  plots.plot_learning_curves(out, read_events(workdir / 'metrics.jsonl'), frozen)
  spread = ensemble_size_spread(prediction.member_probs, labels, active)
  plots.plot_ensemble_size(out, spread, {k: finite_mean(final['members'][k], active)
                                         for k in ('accuracy', 'nll')})
  if final.get('hyperparameters'):
    scatter.plot_sweep(out, final)
  if final.get('shift'):
    plots.plot_shift(out, final)
  rows = method_rows(final)
  if len(rows) > 1:
    scatter.plot_methods(out, rows)
  return spread


def main(argv: Sequence[str] | None = None) -> int:
  """Command line: `dist-ens report --workdir DIR`, or `python -m dist_ens.report.build ...`."""
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
  print(f'wrote {out / "report.md"} and {", ".join(sorted(p.name for p in out.glob("*.png")))}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
