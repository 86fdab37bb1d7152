"""What one epoch's per-member orders cost: numpy on the host against XLA on the devices.

  python -m benchmarks.order_draws                 # M = 16, 64, 256; n = 4,000 (MNIST-1D)
  python -m benchmarks.order_draws --members 64 --examples 50000

data/orders.py computes 'shuffled' and 'bootstrap' orders identically in numpy
(`host_block`, what the host pipeline and resident data on CPU devices use) and in XLA
(`device_block`, what resident data derives on an accelerator, data.resident's
derive_orders='auto'); before them each member drew its order with numpy's generators
(`default_rng((seed, member, epoch))`, timed here as 'numpy generators'). Prints ms an epoch
for M members of n examples, the median of --rounds, on the default backend's first device,
and writes benchmarks/results/order_draws.json (order_draws_<platform>.json off a CPU).
"""

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from dist_ens.data import orders

ROOT = Path(__file__).resolve().parents[1]


def _generators(kind: str, members: int, epoch: int, n: int) -> None:
  """The orders' definition before data/orders.py (numpy generators, one per member)."""
  for member in range(members):
    if kind == 'shuffled':
      np.random.default_rng([0, 1, member, epoch]).permutation(n)
    else:
      bag = np.random.default_rng([0, 2, member]).integers(0, n, n)
      bag[np.random.default_rng([0, 3, member, epoch]).permutation(n)]


def _median_ms(run, rounds: int) -> float:
  run(0)  # compiled or warm
  times = []
  for epoch in range(1, rounds + 1):
    start = time.perf_counter()
    run(epoch)
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--members', default='16,64,256')
  parser.add_argument('--examples', type=int, default=4000)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  n, platform = args.examples, jax.devices()[0].platform
  rows = []
  print(f'ms an epoch for M members of n = {n} ({platform}, median of {args.rounds})')
  print(f'{"M":>5s} {"order":>10s} {"numpy generators":>17s} {"host_block":>11s} '
        f'{"device_block":>13s}')
  for m in map(int, args.members.split(',')):
    for kind in ('shuffled', 'bootstrap'):
      derive = jax.jit(lambda e, kind=kind, m=m: orders.device_block(kind, 0, jnp.arange(m), e, n))
      row = {'members': m, 'order': kind, 'examples': n,
             'generators_ms': _median_ms(lambda e: _generators(kind, m, e, n), args.rounds),
             'host_block_ms': _median_ms(
                 lambda e: orders.host_block(kind, 0, np.arange(m), e, n), args.rounds),
             'device_block_ms': _median_ms(
                 lambda e: jax.block_until_ready(derive(jnp.int32(e))), args.rounds)}
      rows.append(row)
      print(f'{m:5d} {kind:>10s} {row["generators_ms"]:17.1f} {row["host_block_ms"]:11.1f} '
            f'{row["device_block_ms"]:13.1f}')
  default = 'order_draws.json' if platform == 'cpu' else f'order_draws_{platform}.json'
  path = harness.write_results(args.out or ROOT / 'benchmarks' / 'results' / default,
                               {**harness.run_header(), 'platform': platform, 'rows': rows})
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
