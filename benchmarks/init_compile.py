"""The init program's compile time at XLA:CPU's default LLVM -O2 against
dist_ens.run.initial_state.INIT_COMPILER_OPTIONS (-O1), and whether the two give the same state.

  python -m benchmarks.init_compile               # every shipped config, ~2 min on 2 cores
  python -m benchmarks.init_compile --members 8 --configs default,mnist1d_cnn

For each config in configs/ (config.num_members = --members; a sweep config keeps its own M,
which its grid fixes), on one CPU device: builds the parts as training does, then per
round compiles the init program (parts.init with the state's shardings, under a new name
each time so that nothing comes from a cache) once with XLA's default options and once with
INIT_COMPILER_OPTIONS, in a rotating order; medians of --rounds. A tiny program is
compiled first, so that XLA:CPU's one-time set-up is in no timing. Then runs both programs
and compares every leaf of the two states bit for bit. Prints a table and writes
benchmarks/results/init_compile.json.
"""

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dist_ens.run import mesh_layout
from dist_ens.run import assemble, initial_state
from dist_ens.config import loading
from benchmarks import harness
from dist_ens.plan import data_shape

ROOT = Path(__file__).resolve().parents[1]


def parts_of(name: str, members: int):
  config = loading.load_config(ROOT / 'configs' / f'{name}.py')
  if 'grid(' not in repr(config):  # A sweep's grid fixes its M.
    config.num_members = members
  config.mesh.member = config.mesh.data = 1
  mesh = mesh_layout.build_mesh(config, jax.devices()[:1])
  return config.num_members, assemble.build_parts(config, mesh, *data_shape(config))


def compile_seconds(parts, options, tag: str) -> tuple[float, object]:
  """Seconds to compile the init program, and the program. `tag` names the program, so
  that no two compiles share jax's in-process cache of executables."""
  def init():
    return parts.init()
  init.__name__ = f'init_{tag}'
  lowered = jax.jit(init, out_shardings=parts.state_shardings).lower()
  start = time.perf_counter()
  compiled = lowered.compile(compiler_options=options)
  return time.perf_counter() - start, compiled


def measure(name: str, members: int, rounds: int) -> dict:
  m, parts = parts_of(name, members)
  variants = {'default': None, 'init options': initial_state.INIT_COMPILER_OPTIONS}
  seconds = {k: [] for k in variants}
  programs = {}
  for r, key in harness.rotating_rounds(variants, rounds):
    s, programs[key] = compile_seconds(parts, variants[key], f'{key[0]}{r}')
    seconds[key].append(s)
  a, b = (jax.tree.leaves(programs[k]()) for k in variants)
  same = len(a) == len(b) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                  for x, y in zip(a, b))
  med = {k: statistics.median(v) for k, v in seconds.items()}
  return dict(config=name, members=m, seconds=seconds, median=med,
              speedup=med['default'] / med['init options'], bit_identical=same)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--configs', default='', help='comma-separated names in configs/ '
                      '(default: all)')
  parser.add_argument('--members', type=int, default=4)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'init_compile.json'))
  args = parser.parse_args()
  header = harness.run_header()
  names = [n for n in args.configs.split(',') if n] or sorted(
      p.stem for p in (ROOT / 'configs').glob('*.py'))
  jax.block_until_ready(jax.jit(lambda v: v + 1)(jnp.zeros(8)))  # XLA's one-time set-up.
  rows = []
  print(f'init program compile seconds, one CPU device, medians of {args.rounds}')
  print('| config | M | default (-O2) | INIT_COMPILER_OPTIONS | speed-up | same bits |')
  print('|---|---:|---:|---:|---:|---|')
  for name in names:
    row = measure(name, args.members, args.rounds)
    rows.append(row)
    med = row['median']
    print(f'| {name} | {row["members"]} | {med["default"]:.2f} | {med["init options"]:.2f} | '
          f'{row["speedup"]:.2f}x | {"yes" if row["bit_identical"] else "NO"} |', flush=True)
  harness.write_results(args.out, dict(
      header, jax=jax.__version__, device=str(jax.devices()[0].device_kind),
      options=initial_state.INIT_COMPILER_OPTIONS, rounds=args.rounds, rows=rows,
      load_average_end=harness.load_average()))
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
