"""Population-based training vs the static sweep vs the best single configuration, at equal compute.

  python -m benchmarks.pbt [--steps 1000] [--seeds 0 1 2] [--out PATH]
  python -m benchmarks.pbt --config configs/digits_resnet20.py   # ResNet-20 on digits:
      # 8 members, 110 steps, seeds 0 1; writes benchmarks/results/pbt_digits.json

The default MLP on MNIST-1D, 16 members, a learning-rate x weight-decay sweep, each run
`--steps` steps (16 x steps member-steps), 500 validation examples carved from train:

  grid     the static 4 x 4 grid of configs/sweep_lr_wd.py;
  random   16 static draws, learning rate loguniform(3e-4, 1e-2), weight decay uniform(0, 0.3);
  pbt      the same 16 draws with config.pbt on: every steps / 10 steps the worst quarter copy
           one of the best quarter and perturb (x0.8 / x1.2) or resample (p = 0.25) both fields;
  single   the best configuration the grid found (best validation NLL), i.e. the grid's best
           member: what the same compute buys when a sweep only serves to pick one config.

For each: the best member's test NLL and accuracy (best by validation NLL), the whole
ensemble's, and the ensemble of the 4 best on validation; the run's training time (evaluation
left out) and wall time (compile, PBT's validation rounds and the final evaluation in), and
the wall time of ONE separate 1-member run of `steps` steps (compile included) times 16:
what the same member-steps cost as separate runs. Writes benchmarks/results/pbt.json and
prints the Markdown table of docs/sweeps.md.

With --config configs/digits_resnet20.py (SGD-Nesterov, step decay, 110 steps = 10 epochs):
a reduced grid, to stay near 10 minutes on 2 cores: 8 members (learning rate grid 0.02, 0.05,
0.1, 0.2 x weight decay grid 1e-3, 5e-3; random: loguniform(0.02, 0.2) x uniform(0, 0.01)),
300 validation examples carved from the 1,437 training images, the 4 best forming the
selected ensemble, PBT every 11 steps; the separate run uses the config's own 0.1 / 5e-3.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import dist_ens
from benchmarks import harness
from dist_ens.config.loading import load_config

ROOT = Path(__file__).resolve().parents[1]


# Per base config: the sweep file, the random draws' specs and the separate run's (lr, wd).
SETUPS = {
    'default': {'sweep': 'sweep_lr_wd.py', 'overrides': {}, 'steps': 1000, 'seeds': [0, 1, 2],
                'random': ('loguniform(3e-4,1e-2)', 'uniform(0.0,0.3)'), 'single': (3e-3, 0.1),
                'out': 'pbt.json', 'name': 'MLP on MNIST-1D'},
    'digits_resnet20': {
        'sweep': 'digits_resnet20.py', 'steps': 110, 'seeds': [0, 1],
        'overrides': {'num_members': 8, 'optim.learning_rate': 'grid(0.02,0.05,0.1,0.2)',
                      'optim.weight_decay': 'grid(1e-3,5e-3)', 'data.validation_size': 300,
                      'select.metric': 'nll', 'select.top_k': 4},
        'random': ('loguniform(0.02,0.2)', 'uniform(0.0,0.01)'), 'single': (0.1, 5e-3),
        'out': 'pbt_digits.json', 'name': 'ResNet-20 on digits'},
}


def _config(setup: dict, kind: str, steps: int, seed: int):
  config = load_config(ROOT / 'configs' / setup['sweep'])  # members, validation, top 4
  config.update_from_flattened_dict(setup['overrides'])
  config.seed = seed
  config.train.steps = steps
  config.train.log_every = steps // 4
  config.train.eval_every = 0
  config.checkpoint.every = steps
  config.writers = ('jsonl',)
  if kind != 'grid':
    config.optim.learning_rate, config.optim.weight_decay = setup['random']
  if kind == 'pbt':
    config.pbt.enabled = True
    config.pbt.interval = steps // 10
  return config


def _best_member(result):
  """Index of the member best on validation NLL (frozen members excluded)."""
  nll = result['validation']['members']['nll']
  frozen = set(result['frozen_members'])
  return min((i for i in range(len(nll)) if i not in frozen), key=lambda i: nll[i])


def _summary(result):
  best = _best_member(result)
  return {'best_member_nll': result['members']['nll'][best],
          'best_member_accuracy': result['members']['accuracy'][best],
          'ensemble_nll': result['ensemble']['nll'],
          'ensemble_accuracy': result['ensemble']['accuracy'],
          'top4_nll': result['selected']['ensemble']['nll'],
          'top4_accuracy': result['selected']['ensemble']['accuracy'],
          'train_seconds': result['train_seconds']}


def _separate_run_seconds(setup: dict, steps: int, seed: int, workdir: Path) -> float:
  """Wall time of one 1-member run of `steps` steps (compile included)."""
  config = _config(setup, 'grid', steps, seed)
  config.num_members, config.select.top_k = 1, 0
  config.optim.learning_rate, config.optim.weight_decay = setup['single']
  start = time.perf_counter()
  dist_ens.train(config, str(workdir))
  return time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--config', default=str(ROOT / 'configs' / 'default.py'),
                      help='configs/default.py or configs/digits_resnet20.py')
  parser.add_argument('--steps', type=int, default=0, help='0: the setup\'s (1000 or 110)')
  parser.add_argument('--seeds', type=int, nargs='+', default=None)
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  header = harness.run_header()
  stem = Path(args.config).stem
  if stem not in SETUPS:
    parser.error(f'--config={args.config}: the setups are ' + ', '.join(
        f'configs/{name}.py' for name in SETUPS))
  setup = SETUPS[stem]
  args.steps, args.seeds = args.steps or setup['steps'], args.seeds or setup['seeds']
  args.out = args.out or str(ROOT / 'benchmarks' / 'results' / setup['out'])
  members = _config(setup, 'grid', args.steps, 0).num_members
  runs = {kind: [] for kind in ('grid', 'random', 'pbt', 'single')}
  with tempfile.TemporaryDirectory() as tmp:
    for seed in args.seeds:
      for kind in ('grid', 'random', 'pbt'):
        start = time.perf_counter()
        result = dist_ens.train(_config(setup, kind, args.steps, seed), f'{tmp}/{kind}{seed}')
        runs[kind].append({**_summary(result), 'wall_seconds': time.perf_counter() - start})
      grid = runs['grid'][-1]
      runs['single'].append({'best_member_nll': grid['best_member_nll'],
                             'best_member_accuracy': grid['best_member_accuracy']})
    separate = _separate_run_seconds(setup, args.steps, args.seeds[0], Path(tmp) / 'separate')
  mean = {kind: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for kind, rs in runs.items()}
  print(f'{members} members x {args.steps} steps, {setup["name"]}, seeds {args.seeds} (means)')
  print('| run | best member NLL / acc. | ensemble NLL / acc. | top-4 ensemble NLL / acc. '
        '| training / wall time |')
  print('|---|---|---|---|---|')
  for kind, m in mean.items():
    cells = [f'{m["best_member_nll"]:.3f} / {m["best_member_accuracy"]:.3f}']
    for key in ('ensemble', 'top4'):
      cells.append(f'{m[key + "_nll"]:.3f} / {m[key + "_accuracy"]:.3f}' if key + '_nll' in m
                   else '-')
    cells.append(f'{m["train_seconds"]:.1f} s / {m["wall_seconds"]:.1f} s' if 'train_seconds' in m
                 else '-')
    print(f'| {kind} | ' + ' | '.join(cells) + ' |')
  print(f'one separate 1-member run of {args.steps} steps: {separate:.1f} s wall '
        f'(x {members} = {members * separate:.0f} s for the same member-steps)')
  out = harness.write_results(args.out, {
      **header, 'config': setup['sweep'], 'members': members, 'steps': args.steps,
      'seeds': args.seeds, 'runs': runs, 'mean': mean, 'separate_run_seconds': separate,
      'load_average_end': harness.load_average()})
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
