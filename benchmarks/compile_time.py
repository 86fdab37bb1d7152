"""Time to the first train step, M=1 against M=64: does compile time grow with M?

  python -m benchmarks.compile_time [--members 1,64] [--repeats 3] [--quick]

For each model of benchmarks/throughput.py and each member parallelism, builds a
fresh step (a new jax.jit, so it traces and compiles again) and times, on one
device: trace + lower, XLA compile, and the first step's run; their sum is the
time to the first step. Cells alternate in a rotating order and each is
repeated; medians are reported with the ratio of the largest M to the smallest,
for the whole time to the first step and for trace + lower + compile alone (the
first run itself does M times the work, so it grows with M whatever the compiler
does).
Prints a table and writes benchmarks/results/compile_time.json.
"""

import argparse
import statistics
import sys
import time

from benchmarks import harness, throughput

ROOT = throughput.ROOT


def time_first_step(spec: throughput.ModelSpec, members: int, form: str,
                    step_module) -> dict[str, float]:
  """Seconds to trace+lower, compile and run the first step of a fresh step function.

  The step is built as training builds it (dist_ens.run.assemble), with `step_module`'s
  make_train_step for a candidate (None: the installed dist_ens.core.step).
  """
  import jax
  from dist_ens.run import initial_state
  from dist_ens.parallel import mesh as mesh_lib
  _, parts = throughput._jax_setup(spec, members)  # pylint: disable=protected-access
  state = initial_state.init_sharded(parts)
  hparams = parts.device_hparams()
  x, y = (jax.device_put(a, mesh_lib.batch_sharding(parts.mesh))
          for a in throughput._batch(spec))  # pylint: disable=protected-access
  jax.block_until_ready((state, hparams, x, y))
  start = time.perf_counter()
  step = throughput.make_step(parts, (form, None), step_module)
  lowered = step.fn.lower(state, hparams, x, y)
  traced = time.perf_counter()
  compiled = lowered.compile()
  built = time.perf_counter()
  _, metrics = compiled(state, hparams, x, y)
  jax.block_until_ready(metrics)
  done = time.perf_counter()
  return dict(trace_lower=traced - start, compile=built - traced, first_run=done - built,
              total=done - start)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--models', default=','.join(throughput.MODELS))
  parser.add_argument('--members', default='1,64')
  parser.add_argument('--forms', default='vmap,map')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--quick', action='store_true', help='mlp_small and cnn1d, 2 repeats')
  parser.add_argument('--candidate', default='',
                      help='NAME=PATH of a candidate dist_ens change (see throughput.py); its '
                      'forms are timed as FORM@NAME')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'compile_time.json'))
  args = parser.parse_args(argv)
  header = harness.run_header()
  models = ['mlp_small', 'cnn1d'] if args.quick else args.models.split(',')
  repeats = 2 if args.quick else args.repeats
  member_counts = [int(m) for m in args.members.split(',')]
  forms = [(f, f, None) for f in args.forms.split(',')]  # None: the installed step.
  if args.candidate:
    name, path = args.candidate.split('=', 1)
    module = throughput.load_candidate(path)
    forms += [(f'{f}@{name}', f, module) for f in module.candidate_forms]

  import jax
  cells = [(m, members, label, form, module) for m in models for members in member_counts
           for label, form, module in forms]
  times = {(m, members, label): [] for m, members, label, _, _ in cells}
  for _, (m, members, label, form, module) in harness.rotating_rounds(cells, repeats):
    times[(m, members, label)].append(
        time_first_step(throughput.MODELS[m], members, form, module))
    print(f'{m} M={members} {label}: {times[(m, members, label)][-1]["total"]:.2f} s',
          flush=True)

  rows = []
  lo, hi = min(member_counts), max(member_counts)
  print(f'\ntime to the first step, 1 {jax.devices()[0].platform} device, median of {repeats}'
        f' (trace+lower / compile / first run)')
  print(f'{"model":10s} {"form":12s} ' + ' '.join(f'{"M=" + str(n):>26s}' for n in member_counts)
        + f' {"M=" + str(hi) + " / M=" + str(lo):>12s} {"compile only":>14s}')
  for m in models:
    for label, _, _ in forms:
      med = {n: {k: statistics.median(t[k] for t in times[(m, n, label)])
                 for k in ('trace_lower', 'compile', 'first_run', 'total')}
             for n in member_counts}
      ratio = med[hi]['total'] / med[lo]['total']
      build = {n: d['trace_lower'] + d['compile'] for n, d in med.items()}
      compile_ratio = build[hi] / build[lo]
      rows.append(dict(model=m, form=label, seconds=med, ratio=ratio,
                       compile_ratio=compile_ratio,
                       all={n: times[(m, n, label)] for n in member_counts}))
      cols = ' '.join(f'{d["total"]:6.2f} ({d["trace_lower"]:.2f}/{d["compile"]:.2f}/'
                      f'{d["first_run"]:.2f})'.rjust(26) for d in med.values())
      print(f'{m:10s} {label:12s} {cols} {ratio:12.2f} {compile_ratio:14.2f}')
  out = harness.write_results(args.out, dict(
      header, jax=jax.__version__, device=f'1 {jax.devices()[0].platform} device',
      repeats=repeats, rows=rows, load_average_end=harness.load_average()))
  print(f'wrote {out}')


if __name__ == '__main__':
  main(sys.argv[1:])
