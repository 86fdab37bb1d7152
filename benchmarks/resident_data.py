"""Resident data against the host input pipeline, side by side in one process.

  python -m benchmarks.resident_data                  # M=16, every member order, 3 rounds
  python -m benchmarks.resident_data --members 16,64 --orders shuffled --rounds 5 --steps 400

For configs/default.py (MLP 40-256-256-10 on MNIST-1D, batch 128, Adam) on ONE device, for
each member order it times, in rotating rounds (benchmarks/harness.py):
  pipeline  batches/s data.Batches delivers (prefetch off, each item waited for), with
            the split resident on the device (data.resident=True: the host sends the
            indices, the device gathers) and from the host (False: numpy reads and a
            transfer of x and y); per second of wall time;
  run       a whole dist_ens.train of --steps steps with each setting, timed from step
            --warmup to the end as benchmarks/overhead.py times it (compile, first steps,
            final checkpoint and evaluation left out), in member-examples/s;
  bare      dist_ens's compiled step on device batches made beforehand (overhead.py's
            Bare): the anchor both runs are a fraction of.
  images    the pipeline alone (batches/s) on CIFAR-10-shaped float32 images held in
            memory, 'shuffled', batch 128, resident or not: where host reads cost more.
The same batches either way (tests/test_resident.py): only where they are made differs.
Writes benchmarks/results/resident_data.json (--out) and prints a table of medians and
ratios (resident / host, run / bare). The machine is shared: ratios measured side by side
are the figures; absolute rates move with the load (recorded per round by overhead.py's
'foreign_cores').
"""

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging

from benchmarks import harness, overhead
from dist_ens import data
from dist_ens.data import resident
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.run import mesh_layout
from dist_ens.run.run_data import build_data

ROOT = Path(__file__).resolve().parents[1]


def pipeline_rate(config: Any, items: int) -> dict[str, float]:
  """Batches/s (and member-examples/s) of data.Batches for the config's data.resident."""
  mesh = mesh_layout.build_mesh(config, jax.devices()[:1])
  run_data = build_data(config)
  return _items_rate(run_data.dataset.train, run_data.order, mesh, config.num_members, items)


def _items_rate(source: Any, order: data.Order, mesh: Any, members: int,
                items: int) -> dict[str, float]:
  batches = data.Batches(source, order, mesh, members, prefetch=0)
  try:
    jax.block_until_ready(next(batches))  # compile the gather, warm the order's cache
    busy = overhead.machine_busy()
    start = time.perf_counter()
    for _ in range(items):
      jax.block_until_ready(next(batches))
    seconds = time.perf_counter() - start
  finally:
    batches.close()
  batch = order._batch_size  # pylint: disable=protected-access
  per_item = batch * (members if order.per_member else 1)
  return dict(rate=items / seconds, examples_per_s=items * per_item / seconds,
              resident=resident.is_resident(source),
              foreign_cores=overhead.foreign_cores(busy, overhead.machine_busy()))


def image_pipeline(examples: int, members: int, args: Any) -> dict[str, Any]:
  """The pipeline alone on CIFAR-10-shaped float32 images held in memory (32x32x3, 12 kB a
  row): batch 128, the 'shuffled' order (every member its own batch), resident or not."""
  rng = np.random.default_rng(0)
  split = data.Split(rng.random((examples, 32, 32, 3), np.float32),
                     rng.integers(0, 10, examples).astype(np.int32))
  mesh = mesh_lib.make_mesh(mesh_lib.MeshSpec(member=1, data=1), jax.devices()[:1])
  order = data.Order('shuffled', examples, 128, 0)
  jobs = {'resident': lambda: _items_rate(resident.ResidentSource(split), order, mesh, members,
                                          args.items),
          'host': lambda: _items_rate(split, order, mesh, members, args.items)}
  results = harness.run_rounds(jobs, args.rounds, lambda r, name, got: (
      f'images M={members} round {r} {name}: {got["rate"]:,.1f} batches/s'))
  ratios = [a['rate'] / b['rate'] for a, b in zip(results['resident'], results['host'])]
  return dict(examples=examples, members=members, member_order='shuffled', batch=128,
              medians={k: statistics.median(x['rate'] for x in v) for k, v in results.items()},
              resident_over_host=statistics.median(ratios), rounds=results)


def measure(members: int, order: str, args: Any) -> dict[str, Any]:
  config = lambda resident: overhead.make_config(
      members, args.steps, {'data.member_order': order, 'data.resident': resident})
  bare = overhead.Bare(config(False))
  timed = args.steps - args.warmup
  jobs = {'bare': lambda: bare.time(timed)}
  for resident, name in ((True, 'resident'), (False, 'host')):
    jobs[f'pipeline[{name}]'] = lambda r=resident: pipeline_rate(config(r), args.items)
    jobs[f'run[{name}]'] = lambda r=resident: overhead.time_run(config(r), args.warmup)
  results = harness.run_rounds(jobs, args.rounds, lambda r, name, got: (
      f'M={members} {order} round {r} {name}: {got["rate"]:,.1f}/s '
      f'(other processes {got["foreign_cores"]:.2f} cores)'))
  med = {name: statistics.median(x['rate'] for x in got) for name, got in results.items()}
  ratio = lambda a, b: [x['rate'] / y['rate'] for x, y in zip(results[a], results[b])]
  return dict(
      members=members, member_order=order, steps=args.steps, timed_steps=timed,
      medians=med,
      pipeline_resident_over_host=statistics.median(ratio('pipeline[resident]',
                                                          'pipeline[host]')),
      run_resident_over_host=statistics.median(ratio('run[resident]', 'run[host]')),
      run_resident_over_bare=statistics.median(ratio('run[resident]', 'bare')),
      run_host_over_bare=statistics.median(ratio('run[host]', 'bare')),
      rounds=results)


def print_table(rows: list[dict]) -> None:
  print(f'\n{"M":>4s} {"order":9s} {"pipeline batches/s":>22s} {"ratio":>6s} '
        f'{"run member-ex/s":>22s} {"ratio":>6s} {"bare":>9s} {"res/bare":>8s} '
        f'{"host/bare":>9s}')
  print(f'{"":4s} {"":9s} {"resident":>11s}{"host":>11s} {"":6s} {"resident":>11s}'
        f'{"host":>11s}')
  for row in rows:
    m = row['medians']
    print(f'{row["members"]:4d} {row["member_order"]:9s} {m["pipeline[resident]"]:11,.0f}'
          f'{m["pipeline[host]"]:11,.0f} {row["pipeline_resident_over_host"]:6.2f} '
          f'{m["run[resident]"]:11,.0f}{m["run[host]"]:11,.0f} '
          f'{row["run_resident_over_host"]:6.2f} {m["bare"]:9,.0f} '
          f'{row["run_resident_over_bare"]:8.3f} {row["run_host_over_bare"]:9.3f}')
  print('(medians over rounds; ratios are medians of each round\'s side-by-side ratio)')


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--members', default='16')
  parser.add_argument('--orders', default=','.join(data.MEMBER_ORDERS))
  parser.add_argument('--steps', type=int, default=300, help='steps of each whole run')
  parser.add_argument('--warmup', type=int, default=60, help='untimed steps of each run')
  parser.add_argument('--items', type=int, default=100, help='pipeline items timed')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--image_examples', type=int, default=8192,
                      help='CIFAR-shaped images for the pipeline-alone rows (0: none)')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' /
                                           'resident_data.json'))
  args = parser.parse_args()
  header = harness.run_header()
  logging.set_verbosity(logging.WARNING)
  rows = [measure(int(m), order, args) for m in args.members.split(',')
          for order in args.orders.split(',')]
  images = [image_pipeline(args.image_examples, int(m), args)
            for m in args.members.split(',')] if args.image_examples else []
  print_table(rows)
  for row in images:
    m = row['medians']
    print(f'pipeline alone, {row["examples"]} CIFAR-shaped float32 images in memory, '
          f'M={row["members"]} shuffled, batch 128: resident {m["resident"]:,.1f} batches/s, '
          f'host {m["host"]:,.1f}; ratio {row["resident_over_host"]:.2f}')
  device = jax.devices()[0]
  out = harness.write_results(args.out, dict(
      header, device=f'1 {device.platform} device ({device.device_kind})', jax=jax.__version__,
      config='configs/default.py', rows=rows, images=images,
      load_average_end=harness.load_average()))
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
