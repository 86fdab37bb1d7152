"""CIFAR-shaped PNGs through the host pipeline: the thread against grain's worker processes.

  python -m benchmarks.grain_pipeline [--examples 2048] [--members 8] [--items 24]
      [--rounds 3] [--workers 1,2] [--standardize cifar10|none] [--read_inputs] [--out PATH]

Writes a TFDS dataset of random 32x32x3 PNG images as ArrayRecord (as
benchmarks/input_pipeline.py does) and times data.Batches on one device, as a run builds
it (prefetch 2), reading it with config.data.loader='threads' and with 'grain' at each
--workers count, for the 'shared' order (one batch of 128 an item) and 'shuffled' (one
per member, --members of them). With --standardize cifar10 (the default) the set is
read with configs/cifar10_*.py's data.mean / std, so the inputs are standardised per
channel as the CIFAR configs ask. 'threads, TFDS decode' is the thread with every record
decoded by TFDS's own path (TfdsSource.tfds_decoding: the same batches, what every
pipeline did before the shorter PNG decode of dist_ens/data/tfds_source.py).

Each round starts every pipeline afresh (its start-up, worker processes included, is
reported apart), takes a few items to drain what it prepared while starting, then times
--items items: examples/s delivered, the consumer doing nothing else (with --read_inputs
it sums each item's inputs on the device, reading every value as a step would), the CPU
time an example took (this process's threads and grain's workers: what the machine
spends, however busy it is) and of that the main process's alone (the process that also
runs the step). Rounds rotate the order of the pipelines; the ratios to the thread (and
to the thread with TFDS's decode) are medians of each round's ratio. First, where one
thread's read of an item goes (read_profile: read_us_per_example in the results). Writes
benchmarks/results/grain_pipeline.json (or --out).
"""

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import harness
from benchmarks.input_pipeline import write_cifar_shaped
from dist_ens import data
from dist_ens.data import grain_loader
from dist_ens.parallel import mesh as mesh_lib

ROOT = Path(__file__).resolve().parents[1]
BATCH = 128
WARM_ITEMS = 4  # more than prefetch (2) plus what two workers prepare ahead
TFDS_THREADS = 'threads, TFDS decode'
# configs/cifar10_*.py's data.mean and data.std.
STANDARDIZE = {'cifar10': ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
               'none': ((), ())}


def cpu_seconds() -> float:
  """CPU time of this process (all its threads) and of its live child processes (grain's
  workers), user and system."""
  total = time.process_time()
  for child in multiprocessing.active_children():
    try:
      with open(f'/proc/{child.pid}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()
      total += (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')
    except (OSError, IndexError, ValueError):
      pass
  return total


def measure(source, order, mesh, members, loader, workers, items, consume):
  """(seconds to the first item, examples/s, CPU microseconds an example (this process
  and grain's workers) and this process's alone, over `items` items after the warm ones;
  `consume` takes each item)."""
  start = time.perf_counter()
  batches = data.Batches(source, order, mesh, members, prefetch=2, loader=loader,
                         workers=workers)
  try:
    jax.block_until_ready(consume(next(batches)))
    startup = time.perf_counter() - start
    for _ in range(WARM_ITEMS - 1):
      jax.block_until_ready(consume(next(batches)))
    start, cpu, main_cpu = time.perf_counter(), cpu_seconds(), time.process_time()
    for _ in range(items):
      jax.block_until_ready(consume(next(batches)))
    # Examples handed out in the timed items (stats also counts what was prefetched).
    examples = items * (BATCH * members if order.per_member else BATCH)
    return (startup, examples / (time.perf_counter() - start),
            1e6 * (cpu_seconds() - cpu) / examples,
            1e6 * (time.process_time() - main_cpu) / examples)
  finally:
    batches.close()


def read_profile(source, rounds: int = 5, reads: int = 16) -> dict[str, float]:
  """Microseconds an example (median over `rounds`) of one thread's reads of 128 random
  examples, as one item of the 'shared' order reads them: the ArrayRecord read alone
  (serialized records), TFDS's deserialize_example_np of those records, and the whole
  TfdsSource.read (sort, read, decode, stack, scale to float32) with TFDS's decode and with
  the shorter PNG decode, and of that the scaling to float32 alone (preprocess of an
  item's uint8 pixels, with the source's data.mean / std), beside numpy's broadcast
  expression that preprocess evaluated before 697481f (the same bits)."""
  rng = np.random.default_rng(0)
  batches = [rng.permutation(source.num_examples)[:BATCH] for _ in range(reads)]
  tfds_source = source.tfds_decoding()
  records = source._source.data_source  # pylint: disable=protected-access  # the raw reader
  features = source._source.dataset_info.features  # pylint: disable=protected-access
  serialized = [records.__getitems__(sorted(b.tolist())) for b in batches]
  pixels = np.random.default_rng(0).integers(0, 256, (BATCH, *source.read([0])[0].shape[1:]),
                                             dtype=np.uint8)
  spec = source._spec  # pylint: disable=protected-access
  mean, std = (np.asarray(v or d, np.float32) for v, d in ((spec.mean, 0.0), (spec.std, 1.0)))
  stages = {
      'array_record_read': lambda: [records.__getitems__(sorted(b.tolist())) for b in batches],
      'tfds_deserialize': lambda: [features.deserialize_example_np(r)
                                   for batch in serialized for r in batch],
      'read_tfds_decode': lambda: [tfds_source.read(b) for b in batches],
      'read_png_decode': lambda: [source.read(b) for b in batches],
      'scale': lambda: [data.preprocess(pixels, spec) for _ in batches],
      'scale_broadcast': lambda: [(pixels.astype(np.float32) * np.float32(1 / 255) - mean) / std
                                  for _ in batches]}
  times = {name: [] for name in stages}
  for _ in range(rounds):
    for name, stage in stages.items():
      start = time.perf_counter()
      stage()
      times[name].append(1e6 * (time.perf_counter() - start) / (reads * BATCH))
  return {name: statistics.median(t) for name, t in times.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--examples', type=int, default=2048, help='PNGs in the train split')
  parser.add_argument('--members', type=int, default=8, help="members of the 'shuffled' case")
  parser.add_argument('--items', type=int, default=24, help='items timed per pipeline a round')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--workers', default='1,2', help="grain's worker counts, comma-separated")
  parser.add_argument('--standardize', choices=sorted(STANDARDIZE), default='cifar10',
                      help='data.mean / std the set is read with')
  parser.add_argument('--read_inputs', action='store_true',
                      help="the consumer sums each item's inputs on the device")
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'grain_pipeline.json'))
  args = parser.parse_args()
  header = harness.run_header()
  mesh = mesh_lib.make_mesh(mesh_lib.MeshSpec(member=1, data=1), jax.devices()[:1])
  # name: (loader, workers, whether TFDS's own path decodes every record)
  variants = {TFDS_THREADS: ('threads', 0, True), 'threads': ('threads', 0, False)}
  variants.update({f'grain, {w} worker{"s" * (w > 1)}': ('grain', w, False)
                   for w in map(int, args.workers.split(','))})
  mean, std = STANDARDIZE[args.standardize]
  consume = jax.jit(lambda item: item[0].sum()) if args.read_inputs else (lambda item: item)
  rows = []
  with tempfile.TemporaryDirectory() as data_dir:
    write_cifar_shaped(data_dir, args.examples)
    source = data.load_dataset('cifar_shaped', data.DataSpec(
        'cifar_shaped', data_dir=data_dir, mean=mean, std=std)).train
    sources = {False: source, True: source.tfds_decoding()}
    profile = read_profile(source)
    print('one thread, us an example: ' + ', '.join(f'{k} {v:.1f}' for k, v in profile.items()))
    for kind in ('shared', 'shuffled'):
      members = args.members if kind == 'shuffled' else 1
      order = data.Order(kind, source.num_examples, BATCH, 0)
      jobs = {name: (lambda v=v: measure(sources[v[2]], order, mesh, members, *v[:2],
                                         args.items, consume))
              for name, v in variants.items()}
      results = harness.run_rounds(
          jobs, args.rounds, lambda r, name, res, kind=kind: (
              f'round {r} {kind:9s} {name:20s} start {res[0]:5.1f} s  {res[1]:9,.0f} ex/s  '
              f'{res[2]:6.0f} CPU us/ex  {res[3]:6.0f} main'))
      for name, (loader, workers, tfds_decode) in variants.items():
        rates = [res[1] for res in results[name]]
        cpu = [res[2] for res in results[name]]
        main_cpu = [res[3] for res in results[name]]

        def ratios(to, index, mine=results[name]):
          return [res[index] / base[index] for res, base in zip(mine, results[to])]

        rows.append(dict(member_order=kind, members=members, batch=BATCH, loader=loader,
                         workers=workers, tfds_decode=tfds_decode, pipeline=name,
                         examples_per_s=statistics.median(rates), examples_per_s_rounds=rates,
                         ratio_to_threads=statistics.median(ratios('threads', 1)),
                         ratio_to_threads_rounds=ratios('threads', 1),
                         ratio_to_tfds_decode_threads=statistics.median(ratios(TFDS_THREADS, 1)),
                         ratio_to_tfds_decode_threads_rounds=ratios(TFDS_THREADS, 1),
                         cpu_us_per_example=statistics.median(cpu),
                         cpu_us_per_example_rounds=cpu,
                         main_cpu_us_per_example=statistics.median(main_cpu),
                         main_cpu_us_per_example_rounds=main_cpu,
                         cpu_ratio_to_threads=statistics.median(ratios('threads', 2)),
                         cpu_ratio_to_tfds_decode_threads=statistics.median(
                             ratios(TFDS_THREADS, 2)),
                         startup_s=statistics.median(res[0] for res in results[name])))
  print(f'\n{"order":9s} {"pipeline":20s} {"ex/s (median)":>14s} {"x threads":>10s} '
        f'{"x TFDS dec.":>12s} {"CPU us/ex":>10s} {"x threads":>10s} {"main us/ex":>11s} '
        f'{"start s":>8s}')
  for row in rows:
    print(f'{row["member_order"]:9s} {row["pipeline"]:20s} {row["examples_per_s"]:14,.0f} '
          f'{row["ratio_to_threads"]:10.2f} {row["ratio_to_tfds_decode_threads"]:12.2f} '
          f'{row["cpu_us_per_example"]:10.0f} {row["cpu_ratio_to_threads"]:10.2f} '
          f'{row["main_cpu_us_per_example"]:11.0f} {row["startup_s"]:8.1f}')
  out = harness.write_results(args.out, dict(
      header, device=jax.devices()[0].platform, examples=args.examples, items=args.items,
      rounds=args.rounds, standardize=args.standardize, mean=mean, std=std,
      read_inputs=args.read_inputs, cpu_cores=grain_loader.default_workers(),
      read_us_per_example=profile, rows=rows,
      load_average_end=harness.load_average()))
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
