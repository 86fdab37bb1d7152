"""How long reading one call's metrics waits when the next call is already queued.

  python -m benchmarks.metrics_read            # 5 rounds, 2000x2000 matmuls as the calls

The training loop keeps the device one call ahead of Python, so a log step reads call n's
metrics while call n+1 is queued. Read directly (np.asarray, what Session.fetch does in
one process), the read returns once call n is done; read through a program that gathers
them (a jitted identity with replicated outputs, what Session.fetch needs across
processes, and what it used in one process too before), the program runs after call n+1
and the read waits for both: the device then sits idle while the host writes the log
step's record. Prints, for each way, how long the read waited and when call n+1 finished
after the read began (both medians over the rounds), and writes
benchmarks/results/metrics_read.json.
"""

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--size', type=int, default=2000, help='the calls: size x size matmuls')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'metrics_read.json'))
  args = parser.parse_args()
  call = jax.jit(lambda x: (x @ x) @ x / args.size ** 2)
  metric = jax.jit(jnp.sum)
  mesh = jax.make_mesh((1,), ('member',), devices=jax.devices()[:1])
  gather = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))
  x = jnp.ones((args.size, args.size))
  jax.block_until_ready((call(x), gather(metric(x))))  # compiled before the rounds
  reads = {'direct': np.asarray, 'through a gathering program': lambda m: np.asarray(gather(m))}
  waited = {name: [] for name in reads}
  next_done = {name: [] for name in reads}
  for _ in range(args.rounds):
    for name, read in reads.items():
      state = call(x)
      value = metric(state)  # call n's metric
      queued = call(state)  # call n+1, queued behind it
      start = time.perf_counter()
      read(value)
      waited[name].append(time.perf_counter() - start)
      jax.block_until_ready(queued)
      next_done[name].append(time.perf_counter() - start)
  rows = {name: {'read_waited_ms': 1e3 * statistics.median(waited[name]),
                 'next_call_done_ms': 1e3 * statistics.median(next_done[name]),
                 'rounds_read_waited_ms': [1e3 * t for t in waited[name]]} for name in reads}
  print(f'read of call n\'s metric with call n+1 queued ({jax.devices()[0].platform}, '
        f'{args.size}x{args.size} matmuls, median of {args.rounds} rounds)')
  print(f'{"read":>28s} {"read waited ms":>15s} {"call n+1 done ms":>17s}')
  for name, row in rows.items():
    print(f'{name:>28s} {row["read_waited_ms"]:15.1f} {row["next_call_done_ms"]:17.1f}')
  path = harness.write_results(args.out, {**harness.run_header(), 'size': args.size,
                                          'rounds': args.rounds, 'rows': rows})
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
