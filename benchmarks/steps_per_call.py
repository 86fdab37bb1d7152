"""Whole training runs (dist_ens.train, input pipeline and logging included) for several
config.train.steps_per_call values, side by side.

  python -m benchmarks.steps_per_call [--values 1,10,100] [--members 8] [--steps 2000]
      [--repeats 3] [--config configs/default.py] [--out PATH]

The compiled step is not the only cost of a step: the host hands over a batch,
dispatches the step and does the loop's bookkeeping every call. For a small model
on an accelerator that host work is most of a step; steps_per_call=K runs K steps
per call (a lax.scan on the device). Each repeat runs every value once, in a
rotating order, on the first device, and reads the run's own train time
(train_seconds: evaluation excluded, the first call's compile included) from
final_metrics.json; the medians and their ratio to
steps_per_call=1 are printed and written to
benchmarks/results/steps_per_call_<platform>.json.
"""

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import jax
from absl import logging

import dist_ens
from benchmarks import harness
from dist_ens.config.loading import load_config

ROOT = Path(__file__).resolve().parents[1]


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default=str(ROOT / 'configs' / 'default.py'))
  parser.add_argument('--values', default='1,10,100')
  parser.add_argument('--members', type=int, default=8)
  parser.add_argument('--steps', type=int, default=2000)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--out', default=None)
  args = parser.parse_args()
  header = harness.run_header()
  logging.set_verbosity(logging.WARNING)
  values = [int(v) for v in args.values.split(',')]
  device = jax.devices()[0]
  seconds = {k: [] for k in values}
  nll = {}
  for r, k in harness.rotating_rounds(values, args.repeats):
    config = load_config(args.config)
    config.num_members = args.members
    config.train.steps = args.steps
    config.train.log_every = config.checkpoint.every = args.steps
    config.train.eval_every = 0
    config.train.steps_per_call = k
    workdir = tempfile.mkdtemp(prefix='dist_ens_spc_')
    try:
      final = dist_ens.train(config, workdir, devices=[device])
    finally:
      shutil.rmtree(workdir, ignore_errors=True)
    seconds[k].append(final['train_seconds'])
    nll[k] = final['ensemble']['nll']
    print(f'repeat {r} steps_per_call={k}: {final["train_seconds"]:.2f} s', flush=True)
  examples = args.members * load_config(args.config).data.batch_size * args.steps
  base = statistics.median(seconds[values[0]])
  rows = []
  print(f'\n{args.members} members, {args.steps} steps, 1 {device.platform} device '
        f'({device.device_kind}), medians of {args.repeats}')
  print(f'{"steps_per_call":>14s} {"train s":>8s} {"member-ex/s":>12s} {"speed-up":>9s} '
        f'{"ensemble NLL":>13s}')
  for k in values:
    med = statistics.median(seconds[k])
    rows.append(dict(steps_per_call=k, train_seconds=seconds[k], median_seconds=med,
                     member_examples_per_s=examples / med, speedup=base / med,
                     ensemble_nll=nll[k]))
    print(f'{k:14d} {med:8.2f} {examples / med:12,.0f} {base / med:9.2f} {nll[k]:13.6f}')
  out = Path(args.out or ROOT / 'benchmarks' / 'results' / f'steps_per_call_{device.platform}.json')
  harness.write_results(out, dict(
      header, jax=jax.__version__, device=f'1 {device.platform} device ({device.device_kind})',
      config=args.config, members=args.members, steps=args.steps, repeats=args.repeats,
      rows=rows, load_average_end=harness.load_average()))
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
