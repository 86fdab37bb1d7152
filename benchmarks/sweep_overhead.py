"""Step time of a hyperparameter sweep vs a plain ensemble of the same M.

  python -m benchmarks.sweep_overhead [--members 16] [--steps 200] [--repeats 5] [--out PATH]

Per-member learning rates and weight decays are data: the per-member hyperparameters
({field: [M]}, parts.device_hparams()) that every call of the step takes beside the
state, so a sweep should cost what a plain ensemble costs. Both steps are built as
training builds them (dist_ens.run.assemble) and run side by side, alternating, on the
first device; prints the median step times and their ratio and writes
benchmarks/results/sweep_overhead.json (or --out).
"""

import argparse
import statistics
import time
from pathlib import Path

import jax

from benchmarks import harness
from dist_ens.run import mesh_layout
from dist_ens.run import member_forms
from dist_ens import data
from dist_ens.run import assemble, initial_state
from dist_ens.config.loading import load_config
from dist_ens.parallel import mesh as mesh_lib

ROOT = Path(__file__).resolve().parents[1]


def build(config, dataset):
  """(step, state, per-member hyperparameters, batch sharding), built as training builds them."""
  mesh = mesh_layout.build_mesh(config, jax.devices()[:1])
  parts = assemble.build_parts(config, mesh, dataset.input_shape, dataset.num_classes)
  step = assemble.build_step(parts, per_member_batches=False,
                             form=member_forms.member_form(parts, config.data.batch_size))
  return step, initial_state.init_sharded(parts), parts.device_hparams(), mesh_lib.batch_sharding(mesh)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--members', type=int, default=16)
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'sweep_overhead.json'))
  args = parser.parse_args()
  header = harness.run_header()
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
    for name, (step, state, hparams, sharding) in runs.items():
      x, y = next(batches)
      x, y = data.to_global(x, sharding), data.to_global(y, sharding)
      state, m = step(state, hparams, x, y)  # Warm: compiled, caches hot.
      jax.block_until_ready(m)
      start = time.perf_counter()
      for _ in range(args.steps):
        state, m = step(state, hparams, x, y)
      jax.block_until_ready(m)
      if repeat:
        times[name].append((time.perf_counter() - start) / args.steps)
      runs[name] = (step, state, hparams, sharding)
  med = {name: statistics.median(t) for name, t in times.items()}
  ratio = med['sweep'] / med['plain']
  print(f'M={args.members} MLP on MNIST-1D, 1 {jax.devices()[0].platform} device, '
        f'median of {args.repeats} x {args.steps} steps')
  print(f'{"ensemble":8s} {"step ms":>8s}')
  for name, t in med.items():
    print(f'{name:8s} {t * 1e3:8.3f}')
  print(f'sweep / plain step time: {ratio:.3f}')
  out = harness.write_results(args.out, dict(
      header, members=args.members, steps=args.steps, repeats=args.repeats, step_seconds=med,
      ratio=ratio, load_average_end=harness.load_average()))
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
