"""The README's results tables: train the configs that run here (the default config,
configs/mnist1d_cnn.py, and the ResNet recipes configs/digits_resnet20.py and
configs/mnist1d_resnet.py) as they are, with the current code, and print one Markdown table.

  python -m benchmarks.readme_results --write         # every config, ~30 min on 2 CPU cores
  python -m benchmarks.readme_results --configs digits_resnet20,mnist1d_resnet --write  # ResNets
  python -m benchmarks.readme_results --configs default --steps 200   # a quick look

Each config is trained by `dist_ens.train` on whatever devices exist (seed 0, nothing
overridden unless --steps is given), into a workdir in a temporary folder that is removed
at the end (the runs' checkpoints and events, ~14 MB, are not what the table needs). Per
config the table has the mean over members and the ensemble (mean of the members'
probabilities) of test accuracy, NLL and ECE, and the training time (`train_seconds`: wall
time of the loop, evaluation left out, compilation included).

It prints the table and writes nothing else unless --write is given: then it updates --out
(the tracked benchmarks/results/readme_results.json, whose table the README shows): the rows
of the configs run replace theirs, the others' rows stay, and the table is remade from all
of them. So a quick look (--steps) cannot overwrite the published figures by accident.
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
CONFIGS = {name: ROOT / 'configs' / f'{name}.py'
           for name in ('default', 'mnist1d_cnn', 'digits_resnet20', 'mnist1d_resnet')}
METRICS = ('accuracy', 'nll', 'ece')


def _member_mean(final: dict, metric: str) -> float:
  frozen = set(final.get('frozen_members', []))
  values = [v for i, v in enumerate(final['members'][metric]) if i not in frozen and v is not None]
  return float(np.mean(values))


def run(name: str, steps: int | None, parent: str | None = None) -> dict:
  """Trains config `name` into a fresh workdir under `parent`; its row of the table."""
  config = dist_ens.load_config(CONFIGS[name])
  if steps:
    config.train.steps = steps
    config.train.eval_every = 0
    config.train.log_every = min(config.train.log_every, steps)
    config.checkpoint.every = steps
  workdir = tempfile.mkdtemp(prefix=f'readme_results_{name}_', dir=parent)
  start = time.perf_counter()
  final = dist_ens.train(config, workdir)
  wall = time.perf_counter() - start
  row = {'config': f'configs/{CONFIGS[name].name}',
         'num_members': config.num_members, 'model': config.model.name,
         'steps': config.train.steps, 'train_seconds': final['train_seconds'],
         'wall_seconds': wall, 'frozen_members': final['frozen_members']}
  for metric in METRICS:
    row[f'member_mean_{metric}'] = _member_mean(final, metric)
    row[f'ensemble_{metric}'] = float(final['ensemble'][metric])
  return row


def _saved_rows(path: Path) -> list[dict]:
  """The rows a previous run wrote to `path` (none if it is missing or unreadable)."""
  try:
    return json.loads(path.read_text())['rows']
  except (OSError, ValueError, KeyError):
    return []


def _merge(saved: list[dict], new: list[dict]) -> list[dict]:
  """`saved` with each config's row replaced by its `new` one, in CONFIGS order."""
  by_config = {r['config']: r for r in saved}
  by_config.update({r['config']: r for r in new})
  order = [f'configs/{path.name}' for path in CONFIGS.values()]
  return sorted(by_config.values(),
                key=lambda r: order.index(r['config']) if r['config'] in order else len(order))


def table(rows: list[dict]) -> str:
  lines = ['| config | members | steps | accuracy: member mean / ensemble | NLL: member mean / '
           'ensemble | ECE: member mean / ensemble | training time |',
           '|---|---|---|---|---|---|---|']
  for r in rows:
    cells = [f'`{r["config"]}` ({r["model"]})', str(r['num_members']), f'{r["steps"]:,}']
    for metric in METRICS:
      cells.append(f'{r[f"member_mean_{metric}"]:.3f} / {r[f"ensemble_{metric}"]:.3f}')
    cells.append(f'{r["train_seconds"]:.0f} s')
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--configs', default=','.join(CONFIGS),
                      help=f'comma-separated, from {sorted(CONFIGS)}')
  parser.add_argument('--steps', type=int, default=0, help='override train.steps (0: the config\'s)')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'readme_results.json'),
                      help="the results file: its other configs' rows join the table, and "
                           '--write updates it')
  parser.add_argument('--write', action='store_true',
                      help='update --out (the tracked results file by default) with these rows')
  args = parser.parse_args(argv)
  header = harness.run_header()
  with tempfile.TemporaryDirectory(prefix='readme_results_') as parent:  # Removed after.
    new = [run(name, args.steps, parent) for name in args.configs.split(',')]
  rows = _merge(_saved_rows(Path(args.out)), new)
  devices = jax.devices()
  out = {**header, 'rows': rows, 'markdown': table(rows),
         'devices': f'{len(devices)} x {devices[0].platform} ({devices[0].device_kind})',
         'jax': jax.__version__, 'dist_ens': dist_ens.__version__,
         'load_average_end': harness.load_average()}
  if args.write:
    harness.write_results(args.out, out)
  print(out['markdown'])
  print(f'\n{out["devices"]}, {out["machine"]["cores"]} CPU cores; '
        + (f'wrote {args.out}' if args.write else f'{args.out} left as it was (--write updates it)'))


if __name__ == '__main__':
  main()
