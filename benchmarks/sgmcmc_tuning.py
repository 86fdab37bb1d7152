"""Cyclical SG-MCMC's setting chosen on the validation split, then its row at three seeds.

  python -m benchmarks.sgmcmc_tuning            # the grid at seed 0, the best at seeds 0-2
  python -m benchmarks.sgmcmc_tuning --config configs/digits_resnet20.py --steps 112 --seeds 0

benchmarks/methods.py's sgmcmc row (4 SGHMC chains on MNIST-1D, T = 1000 steps, 4 cycles,
the last 20% of each sampling, one sample a cycle, weight decay 5e-4) ran one untuned
setting, the paper's temperature 1 at peak rate 0.05. Here the grid of the temperature T
and the peak rate runs at seed 0, each scored by the ensemble's NLL on the validation
split (500 of the 4,000 training examples, which no run trains on: never the test split);
the best setting then runs at seeds 0, 1 and 2, its test figures as methods.py gives them
(mean +- sd). Writes benchmarks/results/sgmcmc_tuning[_CONFIG].json: the grid's validation
NLLs, the choice and its rows. A setting whose chains all go non-finite is recorded as
diverged. With --config another preset (the digits ResNet-20) runs the same grid on its data,
its validation split as benchmarks/methods.py sizes it (300); the chosen setting's seed-0 row
is the grid's own run (the same config trains the same bits), not a second one.
"""

import argparse
import itertools
from pathlib import Path

import dist_ens
from benchmarks import harness
from benchmarks import methods as methods_bench

ROOT = Path(__file__).resolve().parents[1]
TEMPERATURES = (1.0, 0.1, 0.01)
RATES = (0.05, 0.2, 0.5)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default=str(ROOT / 'configs' / 'default.py'))
  parser.add_argument('--steps', type=int, default=1000)
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--temperatures', default=','.join(map(str, TEMPERATURES)))
  parser.add_argument('--rates', default=','.join(map(str, RATES)))
  parser.add_argument('--out', default='',
                      help='default: benchmarks/results/sgmcmc_tuning[_CONFIG].json')
  args = parser.parse_args()
  header = harness.run_header()
  base = Path(args.config)
  suffix = '' if base.stem == 'default' else f'_{base.stem}'
  args.out = args.out or str(ROOT / 'benchmarks' / 'results' / f'sgmcmc_tuning{suffix}.json')
  validation_size = 500 if base.stem == 'default' else 300  # as benchmarks/methods.py
  row = methods_bench.methods(args.steps)['sgmcmc']
  temperatures = [float(t) for t in args.temperatures.split(',')]
  rates = [float(r) for r in args.rates.split(',')]
  grid, seed0 = [], {}
  for t, rate in itertools.product(temperatures, rates):
    overrides = {**row, 'ensemble.sgmcmc.temperature': t, 'optim.learning_rate': rate, 'seed': 0}
    try:
      result = methods_bench.run(base, 'sgmcmc', overrides, validation_size)
    except dist_ens.TrainingError as e:  # every chain went non-finite: the rate is too high
      grid.append({'temperature': t, 'learning_rate': rate, 'validation_nll': None,
                   'diverged': str(e).split(';')[0]})
      print(f'T {t} rate {rate}: diverged', flush=True)
      continue
    grid.append({'temperature': t, 'learning_rate': rate,
                 'validation_nll': result['validation_nll'], 'test_nll': result['nll']})
    seed0[t, rate] = result
    print(f'T {t} rate {rate}: validation NLL {result["validation_nll"]:.4f}', flush=True)
  best = min((g for g in grid if g['validation_nll'] is not None),
             key=lambda g: g['validation_nll'])
  chosen = {**row, 'ensemble.sgmcmc.temperature': best['temperature'],
            'optim.learning_rate': best['learning_rate']}
  runs = [(seed0[best['temperature'], best['learning_rate']] if s == 0 else
           methods_bench.run(base, 'sgmcmc', {**chosen, 'seed': s}, validation_size)) | {'seed': s}
          for s in (int(s) for s in args.seeds.split(','))]
  rows = [methods_bench.over_seeds(runs)]
  print(methods_bench.table(rows))
  harness.write_results(args.out, {**header, 'grid': grid, 'chosen': best, 'rows': rows,
                                   'markdown': methods_bench.table(rows), 'steps': args.steps,
                                   'config': base.name,
                                   'validation_size': validation_size,
                                   'load_average_end': harness.load_average()})
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
