"""The 1-D toy of Lakshminarayanan et al. (2017), with a gap: docs/regression_toy.png.

  python -m benchmarks.toy_regression [--workdir /tmp/toy_regression]

Trains 5 members (one hidden layer of 100 ReLUs, Gaussian NLL) on y = x^3 + N(0, 3^2) with x
drawn uniformly from [-4, -1] U [1, 4], predicts on [-6, 6], and plots the ensemble's mean
+- 2 total standard deviations and its epistemic standard deviation (the spread of the
members' means). Prints the mean epistemic std on the data, in the gap (-1, 1) and outside
[-4, 4]: the members agree where they saw data and disagree away from it.
"""

import argparse
import shutil
from pathlib import Path

import ml_collections
import numpy as np

import dist_ens
from dist_ens import data

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / 'docs' / 'regression_toy.png'
NOISE_STD = 3.0


def toy_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """n points of y = x^3 + N(0, 9), x uniform on [-4, -1] U [1, 4] (half on each side)."""
  rng = np.random.default_rng(seed)
  x = rng.uniform(1.0, 4.0, n) * np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
  y = x ** 3 + NOISE_STD * rng.standard_normal(n)
  return x[:, None].astype(np.float32), y.astype(np.float32)


def toy_config() -> ml_collections.ConfigDict:
  """The paper's toy setup: one hidden layer of 100 ReLUs, Adam, every member its own
  batch order (the paper's members differ by initialisation and data order)."""
  config = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  config.task = 'regression'
  config.num_members = 5
  config.model.name, config.model.widths = 'mlp', (100,)
  config.optim.learning_rate, config.optim.weight_decay = 1e-2, 0.0
  config.data.batch_size, config.data.member_order = 10, 'shuffled'
  config.train.steps, config.train.log_every, config.train.eval_every = 2000, 500, 0
  config.checkpoint.every = 2000
  config.writers = ('jsonl',)
  return config


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', default='/tmp/toy_regression')
  workdir = Path(parser.parse_args().workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  (x, y), (xt, yt) = toy_data(40, 0), toy_data(200, 1)
  dist_ens.train(toy_config(), str(workdir), dataset=data.from_arrays(x, y, xt, yt, name='toy'))
  grid = np.linspace(-6, 6, 601, dtype=np.float32)
  out = dist_ens.Ensemble.load(workdir).predict(grid[:, None])
  epistemic_std = np.sqrt(out.epistemic)
  regions = {'on the data, 1 <= |x| <= 4': (np.abs(grid) >= 1) & (np.abs(grid) <= 4),
             'in the gap, |x| < 1': np.abs(grid) < 1, 'outside, |x| > 4': np.abs(grid) > 4}
  for name, where in regions.items():
    print(f'mean epistemic std {name}: {epistemic_std[where].mean():.2f}')
  print('epistemic std at x = -6 and 6: '
        + ' and '.join(f'{v:.1f}' for v in epistemic_std[[0, -1]]))
  print(f'mean aleatoric std on the data: '
        f'{np.sqrt(out.aleatoric)[regions["on the data, 1 <= |x| <= 4"]].mean():.2f} '
        f'(the noise is {NOISE_STD})')
  plot(grid, out, x[:, 0], y)
  print(f'wrote {OUT}')


def plot(grid: np.ndarray, out, x: np.ndarray, y: np.ndarray) -> None:
  """The mean +- 2 total std over the data and the true curve; the epistemic std below."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(7.0, 5.6), dpi=100, layout='constrained')
  top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2.2, 1.0))
  std = np.sqrt(out.variance)
  top.fill_between(grid, out.mean - 2 * std, out.mean + 2 * std, color='#dd8452', alpha=0.3,
                   lw=0, label='ensemble mean +- 2 total std')
  top.plot(grid, out.mean, color='#dd8452', lw=2, label='ensemble mean')
  for i, member in enumerate(out.member_mean):
    top.plot(grid, member, color='#4c72b0', lw=0.7, alpha=0.6,
             label='members\' means' if i == 0 else None)
  top.plot(grid, grid ** 3, ':', color='black', lw=1, label='y = x^3')
  top.scatter(x, y, s=8, color='black', zorder=3, label='training data')
  top.set(ylim=(-250, 250), ylabel='y', title='5 members, trained on x in [-4, -1] U [1, 4]')
  top.legend(fontsize=7, loc='upper left')
  bottom.plot(grid, np.sqrt(out.epistemic), color='#c44e52', lw=1.5, label='epistemic std')
  bottom.plot(grid, np.sqrt(out.aleatoric), color='#55a868', lw=1.5,
              label='aleatoric std (the noise is 3)')
  for edge in (-4, -1, 1, 4):
    for ax in (top, bottom):
      ax.axvline(edge, color='gray', lw=0.5, ls='--')
  bottom.set(xlabel='x', ylabel='std', yscale='log', xlim=(-6, 6))
  bottom.legend(fontsize=7, loc='upper center')
  fig.savefig(OUT, dpi=90)


if __name__ == '__main__':
  main()
