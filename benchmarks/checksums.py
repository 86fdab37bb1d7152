"""The checkpoint checksums on CPU devices: numpy on the host against the device program.

  python -m benchmarks.checksums              # 64 MB float32 leaf, 5 rounds, 8 fake devices

Every save and restore sums each leaf of the state (dist_ens/io/checkpoint.py). On CPU
devices a leaf this process holds whole is summed by numpy (`_host_checksum`); elsewhere by
a small jitted program per leaf shape, dtype and sharding (`_checksum_program`), which is
what CPU devices ran before too. For one leaf of --mb MB, on one device and split 4 x 2
over 8 fake CPU devices, this times both in rotating rounds (the program compiled before
the rounds; its compile timed apart, as a new shape pays it in every process) and checks
they agree. Writes benchmarks/results/checksums.json.
"""

import argparse
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import harness
from dist_ens.io import checksums
from dist_ens.parallel import once

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--mb', type=float, default=64.0, help='the leaf: float32, MB')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'checksums.json'))
  args = parser.parse_args()
  jax.config.update('jax_num_cpu_devices', 8)  # for the split leaf
  rows = int(args.mb * 2**20 / 4 / 1024) // 8 * 8
  values = np.random.default_rng(0).standard_normal((rows, 1024), np.float32)
  mesh = jax.make_mesh((4, 2), ('member', 'data'))
  leaves = {'one device': jax.device_put(values, jax.devices()[0]),
            'split 4 x 2': jax.device_put(values, NamedSharding(mesh, P('member', 'data')))}
  options = checksums._hashable(once.options_for('cpu'))
  out = {}
  for name, leaf in leaves.items():
    start = time.perf_counter()
    program = checksums._checksum_program.__wrapped__(options)  # a fresh jit: compiles
    device_sum = int(program(leaf))
    compile_s = time.perf_counter() - start
    host_sum = checksums._host_checksum(leaf)
    assert host_sum == device_sum, (name, host_sum, device_sum)
    ways = {'host (numpy)': lambda leaf=leaf: checksums._host_checksum(leaf),
            'device program': lambda leaf=leaf, program=program: int(program(leaf))}
    times = {way: [] for way in ways}
    for _, way in harness.rotating_rounds(list(ways), args.rounds):
      start = time.perf_counter()
      ways[way]()
      times[way].append(time.perf_counter() - start)
    out[name] = {'first_call_with_compile_s': compile_s,
                 **{way: statistics.median(t) for way, t in times.items()},
                 'rounds': times}
  print(f'checksum of one {rows * 1024 * 4 / 2**20:.0f} MB float32 leaf, median of '
        f'{args.rounds} rounds (s)')
  print(f'{"leaf":>12s} {"host (numpy)":>13s} {"device program":>15s} {"its first call":>15s}')
  for name, row in out.items():
    print(f'{name:>12s} {row["host (numpy)"]:13.3f} {row["device program"]:15.3f} '
          f'{row["first_call_with_compile_s"]:15.3f}')
  path = harness.write_results(args.out, {**harness.run_header(), 'mb': args.mb,
                                          'rounds': args.rounds, 'leaves': out})
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
