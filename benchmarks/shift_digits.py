"""Clean and corrupted test metrics of configs/digits_resnet20.py, as uncertainty-baselines'
tables put them side by side: the table in docs/evaluation.md.

  python -m benchmarks.shift_digits                 # ~5 min on 2 CPU cores
  python -m benchmarks.shift_digits --steps 20      # a quick look
  python -m benchmarks.shift_digits --table         # the tables of the saved results

Trains the config as it is with eval.shift='all' (12 corruption families x 5 severities on
8x8 grey digits; saturate needs colour) and data.validation_size=300 (carved from the
1,437 training images, so it trains on 1,137), seed 0, on whatever devices exist. Prints
Markdown tables and writes benchmarks/results/shift_digits.json:
  1. member mean and ensemble: clean accuracy / NLL / ECE beside cA / cNLL / cCE, AURC by
     confidence clean and shifted, conformal (APS, alpha 0.1) coverage and set size;
  2. the ensemble's accuracy, NLL and conformal coverage per severity (mean over families).
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault('MPLBACKEND', 'Agg')

import jax  # pylint: disable=g-import-not-at-top
import numpy as np

import dist_ens
from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / 'benchmarks' / 'results' / 'shift_digits.json'


def train(steps: int | None) -> tuple[dict, float]:
  config = dist_ens.load_config(ROOT / 'configs' / 'digits_resnet20.py')
  config.eval.shift, config.data.validation_size = 'all', 300
  config.writers = ('jsonl',)
  if steps:
    config.train.steps, config.checkpoint.every = steps, steps
    config.train.log_every = min(config.train.log_every, steps)
  start = time.perf_counter()
  final = dist_ens.train(config, tempfile.mkdtemp(prefix='shift_digits_'))
  return final, time.perf_counter() - start


def _pairs(final: dict) -> list[tuple[int, dict]]:
  return [(int(s), r) for sev in final['shift']['corruptions'].values() for s, r in sev.items()]


def summary(final: dict) -> dict:
  shift, members = final['shift'], final['members']
  mean = shift['mean']
  rows = {
      'member mean': {'accuracy': np.mean(members['accuracy']), 'nll': np.mean(members['nll']),
                      'ece': np.mean(members['ece']),
                      'cA': np.mean(mean['members']['accuracy']),
                      'cNLL': np.mean(mean['members']['nll']),
                      'cCE': np.mean(mean['members']['ece'])},
      'ensemble': {'accuracy': final['ensemble']['accuracy'], 'nll': final['ensemble']['nll'],
                   'ece': final['ensemble']['ece'], 'cA': shift['cA'], 'cNLL': shift['cNLL'],
                   'cCE': shift['cCE'], 'aurc': final['aurc']['confidence'],
                   'c_aurc': mean['selective']['aurc']['confidence'],
                   'coverage': final['conformal']['coverage'],
                   'set_size': final['conformal']['mean_set_size'],
                   'c_coverage': mean['conformal']['coverage'],
                   'c_set_size': mean['conformal']['mean_set_size']}}
  by_severity = {}
  for severity in range(1, 6):
    results = [r for s, r in _pairs(final) if s == severity]
    by_severity[severity] = {
        'accuracy': np.mean([r['ensemble']['accuracy'] for r in results]),
        'nll': np.mean([r['ensemble']['nll'] for r in results]),
        'coverage': np.mean([r['conformal']['coverage'] for r in results])}
  as_float = lambda d: {k: float(v) for k, v in d.items()}
  return {'rows': {k: as_float(v) for k, v in rows.items()},
          'by_severity': {str(k): as_float(v) for k, v in by_severity.items()},
          'pairs': shift['pairs']}


def tables(result: dict) -> str:
  columns = ('accuracy', 'nll', 'ece', 'cA', 'cNLL', 'cCE', 'aurc', 'c_aurc', 'coverage',
             'set_size', 'c_coverage', 'c_set_size')
  lines = ['| | ' + ' | '.join(columns) + ' |', '|---|' + '---|' * len(columns)]
  for name, row in result['rows'].items():
    lines.append(f'| {name} | ' + ' | '.join(f'{row[c]:.4f}' if c in row else '' for c in columns)
                 + ' |')
  lines += ['', '| severity | ensemble accuracy | NLL | conformal coverage |', '|---|---|---|---|']
  for severity, row in result['by_severity'].items():
    lines.append(f"| {severity} | {row['accuracy']:.4f} | {row['nll']:.4f} | "
                 f"{row['coverage']:.4f} |")
  return '\n'.join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=None, help='override train.steps')
  parser.add_argument('--table', action='store_true', help='print the saved results only')
  args = parser.parse_args()
  if args.table:
    print(tables(json.loads(OUT.read_text())))
    return
  header = harness.run_header()
  final, wall = train(args.steps)
  result = {**header, **summary(final), 'steps': final['step'], 'wall_seconds': wall,
            'devices': f'{jax.device_count()} x {jax.devices()[0].platform}',
            'load_average_end': harness.load_average()}
  print(tables(result))
  if not args.steps:
    harness.write_results(OUT, result)
    print(f'wrote {OUT}')


if __name__ == '__main__':
  main()
