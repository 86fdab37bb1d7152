"""Step time of a hyperparameter sweep vs a plain ensemble of the same M.

  python benchmarks/sweep_overhead.py [--members 16] [--steps 200] [--repeats 5]

Per-member learning rates and weight decays live in the optimizer state, so a sweep
should cost what a plain ensemble costs. Both steps run side by side, alternating,
on the first device; prints the median step times and their ratio and writes
benchmarks/results/sweep_overhead.json.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import jax

from dist_ens import data, models
from dist_ens.core import hparams
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.core import optim
from dist_ens.configuration import load_config
from dist_ens.training.step import init_state, make_train_step

ROOT = Path(__file__).resolve().parents[1]


def build(config, dataset):
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
  model = models.get_model(config.model, dataset.num_classes)
  tx = optim.make_optimizer(config.optim, config.train.steps)
  values = hparams.resolve(config)
  sharding = mesh_lib.member_sharding(mesh)
  state = jax.jit(lambda: init_state(model, tx, config.seed, config.num_members,
                                     dataset.input_shape, values), out_shardings=sharding)()
  smoothing = jax.device_put(values['train.label_smoothing'], sharding)
  return make_train_step(model, tx, mesh), state, smoothing, mesh_lib.batch_sharding(mesh)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--members', type=int, default=16)
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--repeats', type=int, default=5)
  args = parser.parse_args()
  dataset = data.load_dataset('mnist1d')
  plain = load_config(ROOT / 'configs' / 'default.py')
  plain.num_members = args.members
  sweep = load_config(ROOT / 'configs' / 'default.py')
  sweep.num_members = args.members
  sweep.optim.learning_rate = 'logspace(1e-4,1e-2)'
  sweep.optim.weight_decay = 'linspace(0,0.3)'
  runs = {'plain': build(plain, dataset), 'sweep': build(sweep, dataset)}
  batches = data.BatchIterator(dataset.train, plain.data.batch_size, 0)
  times = {name: [] for name in runs}
  for repeat in range(args.repeats + 1):
    for name, (step, state, smoothing, sharding) in runs.items():
      x, y = next(batches)
      x, y = data.to_global(x, sharding), data.to_global(y, sharding)
      state, m = step(state, x, y, smoothing)  # Warm: compiled, caches hot.
      jax.block_until_ready(m)
      start = time.perf_counter()
      for _ in range(args.steps):
        state, m = step(state, x, y, smoothing)
      jax.block_until_ready(m)
      if repeat:
        times[name].append((time.perf_counter() - start) / args.steps)
      runs[name] = (step, state, smoothing, sharding)
  med = {name: statistics.median(t) for name, t in times.items()}
  ratio = med['sweep'] / med['plain']
  print(f'M={args.members} MLP on MNIST-1D, 1 {jax.devices()[0].platform} device, '
        f'median of {args.repeats} x {args.steps} steps')
  print(f'{"ensemble":8s} {"step ms":>8s}')
  for name, t in med.items():
    print(f'{name:8s} {t * 1e3:8.3f}')
  print(f'sweep / plain step time: {ratio:.3f}')
  out = ROOT / 'benchmarks' / 'results' / 'sweep_overhead.json'
  out.write_text(json.dumps(dict(members=args.members, steps=args.steps, repeats=args.repeats,
                                 step_seconds=med, ratio=ratio), indent=2))
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
