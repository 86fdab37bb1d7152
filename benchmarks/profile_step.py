"""Where a step's time goes on a CPU: dist_ens's step against the Python loop, by kind of work.

  python -m benchmarks.profile_step                       # big MLP, M=16, 'map' (~1 min)
  python -m benchmarks.profile_step --model cnn2d --members 4 --form map
  python -m benchmarks.profile_step --model wide --out benchmarks/results/profile_step_wide.json

Runs --steps steps of dist_ens's step (built as training builds it, in the given form)
and of the loop (benchmarks/throughput.py's: one jitted optax update per member) under
jax.profiler, and sums the device time of XLA:CPU's thunks by what they do, read from
the compiled programs:
  matmul       dots (XLA's own, or its YNN fusions that hold a dot);
  reduction    YNN fusions without a dot (sums);
  elementwise  other loop fusions: activations, the loss, the optimizer's arithmetic;
  write-back   fusions that write a member's results into the stacked state
               (dynamic-update-slice);
  slice-out    fusions that only copy a member's arrays out of the stacked state
               (dynamic-slice, no arithmetic);
  copy         whole-array copies;
  control      the conditional and while-loop thunks' own events, which span part of
               their bodies' work (whose thunks are counted in the rows above): not a
               cost of their own (a lax.cond around a member's work in a fori_loop ran
               as fast as the same loop without it, in a probe), so the comparison
               below leaves it out.
--model wide is benchmarks/run_vs_loop.py's case instead: the wide MLP 40-1024-1024-10,
batch 128, dist_ens's step as a run builds it (benchmarks.overhead.Bare, its 'auto' form
unless --form says otherwise), against run_vs_loop's donating loop (one jitted optax Adam
step a member, donate_argnums=(0, 1)).
Thunk times overlap where XLA runs thunks concurrently, and the profiler adds its own
cost, so the rows are shares of the summed thunk time, not of the wall time; the wall
time per step is also timed, without the profiler (--rounds rotating rounds: the speed
against the loop is the median of the per-round ratios), and summed thunk time / wall time
says how much the program's thunks overlapped. With --model wide and --candidate, the
candidate is profiled and timed side by side with the installed step and the loop.
Prints a table and writes benchmarks/results/profile_step.json.
"""

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import tempfile
import time

from benchmarks import harness, throughput

ROOT = throughput.ROOT
KINDS = ('matmul', 'reduction', 'elementwise', 'write-back', 'slice-out', 'copy', 'control')


def _computations(hlo: str) -> dict[str, str]:
  """Computation name -> its body, from a compiled module's text."""
  bodies, name, lines = {}, None, []
  for line in hlo.splitlines():
    start = re.match(r'^(?:ENTRY )?%?([\w.-]+) .*\{$', line)
    if start:
      name, lines = start.group(1), []
    elif line.startswith('}') and name:
      bodies[name] = '\n'.join(lines)
      name = None
    elif name:
      lines.append(line)
  return bodies


def instruction_kinds(hlo: str) -> dict[str, str]:
  """Instruction name -> KINDS entry, for every instruction a thunk can be named after."""
  bodies, kinds = _computations(hlo), {}
  for body in bodies.values():
    for line in body.splitlines():
      control = re.match(r'\s*(?:ROOT )?%([\w.-]+) = .*? (?:conditional|while)\(', line)
      if control:
        kinds[control.group(1)] = 'control'
        continue
      m = re.match(r'\s*(?:ROOT )?%([\w.-]+) = \S+ (?:\S+ )?([\w-]+)\(', line)
      if not m:
        continue
      name, op = m.groups()
      called = re.search(r'calls=%([\w.-]+)', line)
      inner = bodies.get(called.group(1), '') if called else ''
      arithmetic = re.search(r'= f32\[[^\]]*\]\S* (?!bitcast|dynamic|parameter|constant|'
                             r'broadcast|reshape|copy|transpose)[\w-]+\(', inner)
      if op == 'dot' or (op == 'fusion' and ' dot(' in inner):
        kinds[name] = 'matmul'
      elif op == 'fusion' and 'dynamic-update-slice(' in inner:
        kinds[name] = 'write-back'
      elif op == 'fusion' and 'dynamic-slice(' in inner and not arithmetic:
        kinds[name] = 'slice-out'
      elif op == 'fusion' and '__ynn_fusion' in line:
        kinds[name] = 'reduction'
      elif op in ('fusion', 'reduce', 'select', 'add', 'multiply'):
        kinds[name] = 'elementwise'
      elif op == 'copy':
        kinds[name] = 'copy'
  return kinds


def profile(run, steps: int) -> collections.Counter:
  """Thunk name -> summed microseconds over `steps` calls of run(), under jax.profiler."""
  import jax
  with tempfile.TemporaryDirectory() as folder:
    jax.profiler.start_trace(folder, create_perfetto_trace=True)
    for _ in range(steps):
      out = run()
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    trace = json.load(gzip.open(glob.glob(f'{folder}/**/*.json.gz', recursive=True)[0]))
  times = collections.Counter()
  for event in trace['traceEvents'] if isinstance(trace, dict) else trace:
    if event.get('ph') == 'X' and 'dur' in event:
      times[event['name']] += event['dur']
  return times


def wall_ms(run, steps: int, rounds: int = 5) -> float:
  """Median milliseconds per step of run(), over `rounds` timings of `steps` steps."""
  import jax
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(steps):
      out = run()
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) * 1e3 / steps)
  return statistics.median(times)


def by_kind(times: collections.Counter, kinds: dict[str, str], steps: int) -> dict[str, float]:
  """Milliseconds per step of each kind of work (thunks named after no instruction of
  the program, the runtime's own events, are left out)."""
  totals = dict.fromkeys(KINDS, 0.0)
  for name, micros in times.items():
    if name in kinds:
      totals[kinds[name]] += micros / 1e3 / steps
  return totals


def _dist_ens_run(spec, members: int, form: tuple[str, int | None], step_module=None):
  """(run, compiled HLO text) of dist_ens's step, built as training builds it (with
  `step_module`'s make_train_step: a candidate, see throughput.load_candidate)."""
  import jax
  from dist_ens.run import initial_state
  from dist_ens.parallel import mesh as mesh_lib
  _, parts = throughput._jax_setup(spec, members)  # pylint: disable=protected-access
  step = throughput.make_step(parts, form, step_module)
  holder = [initial_state.init_sharded(parts)]
  hparams = parts.device_hparams()
  x, y = (jax.device_put(a, mesh_lib.batch_sharding(parts.mesh))
          for a in throughput._batch(spec))  # pylint: disable=protected-access
  hlo = step.fn.lower(holder[0], hparams, x, y).compile().as_text()

  def run():
    holder[0], metrics = step(holder[0], hparams, x, y)
    return metrics.loss
  return run, hlo


WIDE = 'wide'  # benchmarks/run_vs_loop.py's model and anchor (see the module doc)


def _wide_runs(members: int, form: str, step_module=None, loop: bool = True):
  """{'dist_ens': (run, HLO), 'loop': (run, HLO)} for run_vs_loop's wide MLP: dist_ens's
  step as a run builds it, and run_vs_loop's donating loop (each run() one step of every
  member, on run_vs_loop's device-resident batches)."""
  import itertools
  from unittest import mock
  from benchmarks import overhead, run_vs_loop
  from dist_ens.run import assemble
  config = run_vs_loop.make_config(members, 1)
  name, _, chunk = form.partition('/')
  if name != 'auto':
    config.ensemble.member_parallelism = name
    config.ensemble.map_batch_size = int(chunk) if chunk else 0
  if step_module is None:
    bare = overhead.Bare(config)
  else:
    with mock.patch.object(assemble, 'make_train_step', step_module.make_train_step):
      bare = overhead.Bare(config)
  batches = itertools.cycle(bare.batches)

  def dist_ens_run():
    bare.state, metrics = bare.step(bare.state, bare.hparams, *next(batches))
    return metrics.loss

  programs = {'dist_ens': (dist_ens_run, bare.step.fn.lower(
      bare.state, bare.hparams, *bare.batches[0]).compile().as_text())}
  if not loop:
    return programs
  loop = run_vs_loop.Loop(members, donate=True)
  steps = itertools.count()

  def loop_run():
    x, y = loop.batches[next(steps) % len(loop.batches)]
    for m in range(members):
      loop.params[m], loop.opt[m] = loop.step(loop.params[m], loop.opt[m], x, y)
    return loop.params[-1]

  x, y = loop.batches[0]
  return {**programs, 'loop': (loop_run, loop.step.lower(loop.params[0], loop.opt[0], x, y)
                               .compile().as_text())}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--model', default='mlp_big', choices=[*throughput.MODELS, WIDE])
  parser.add_argument('--members', type=int, default=16)
  parser.add_argument('--form', default='map', help="'vmap', 'map' or 'map/K'")
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--rounds', type=int, default=5,
                      help='rotating rounds of --steps steps each, timed without the profiler')
  parser.add_argument('--candidate', default='', help='profile a candidate change of dist_ens '
                      'instead (a changed copy of core/step.py, or a folder; see throughput.py)')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'profile_step.json'))
  args = parser.parse_args(argv)
  header = harness.run_header()
  import jax
  candidate = throughput.load_candidate(args.candidate) if args.candidate else None
  if args.model == WIDE:
    programs = {label: (run, instruction_kinds(hlo))
                for label, (run, hlo) in _wide_runs(args.members, args.form).items()}
    if candidate is not None:  # Side by side with the installed step, in the same rounds.
      run, hlo = _wide_runs(args.members, args.form, candidate, loop=False)['dist_ens']
      programs = {'dist_ens': programs['dist_ens'], 'candidate': (run, instruction_kinds(hlo)),
                  'loop': programs['loop']}
  else:
    spec = throughput.MODELS[args.model]
    name, _, chunk = args.form.partition('/')
    dist_ens_run, hlo = _dist_ens_run(spec, args.members, (name, int(chunk) if chunk else None),
                                      candidate)
    loop_run = throughput.build_loop(spec, args.members)
    programs = {'dist_ens': (dist_ens_run, instruction_kinds(hlo)),
                'loop': (loop_run, instruction_kinds(loop_run.lower().compile().as_text()))}
  rows, walls = {}, {label: [] for label in programs}
  for label, (run, kinds) in programs.items():
    for _ in range(3):
      jax.block_until_ready(run())  # Compiled and warm before the trace.
    rows[label] = by_kind(profile(run, args.steps), kinds, args.steps)
  loads = []
  for _, label in harness.rotating_rounds(programs, args.rounds):
    loads.append(harness.load_average()[0])
    walls[label].append(wall_ms(programs[label][0], args.steps, rounds=1))
  wall = {label: statistics.median(times) for label, times in walls.items()}
  labels = list(programs)
  print(f'{args.model}, M={args.members}, dist_ens {args.form} against the loop, '
        f'{args.steps} steps: ms of thunk time per step (share)')
  print(f'{"kind":12s} ' + ' '.join(f'{label:>16s}' for label in labels))
  totals = {label: sum(row.values()) for label, row in rows.items()}
  for kind in KINDS:
    cells = [f'{rows[k][kind]:8.2f} ({rows[k][kind] / totals[k]:4.0%})' for k in rows]
    print(f'{kind:12s} ' + ' '.join(f'{c:>16s}' for c in cells))
  print(f'{"total":12s} ' + ' '.join(f'{totals[k]:8.2f}       ' for k in rows))
  work = {k: totals[k] - rows[k]['control'] for k in rows}
  speed = {}  # The loop's ms / each program's, per round: > 1 where it is faster.
  for label in labels[:-1]:
    ratios = [b / a for a, b in zip(walls[label], walls['loop'])]
    speed[label] = {'median': statistics.median(ratios), 'range': [min(ratios), max(ratios)]}
    print(f'{label}: thunk time without control {work[label]:.2f} ms, loop {work["loop"]:.2f} '
          f'ms (loop / {label} {work["loop"] / work[label]:.2f}); wall time without the '
          f'profiler, median of {args.rounds} rotating rounds: {wall[label]:.2f} ms, loop '
          f'{wall["loop"]:.2f}; speed against the loop {speed[label]["median"]:.3f} '
          f'({speed[label]["range"][0]:.3f}-{speed[label]["range"][1]:.3f}); thunk time / '
          f'wall time {work[label] / wall[label]:.2f}, loop {work["loop"] / wall["loop"]:.2f}')
  print(f'load average (1 min) before the timed rounds: {min(loads):.2f}-{max(loads):.2f}')
  harness.write_results(args.out, dict(
      header, jax=jax.__version__, device=str(jax.devices()[0].device_kind), model=args.model,
      members=args.members, form=args.form, candidate=args.candidate or None, steps=args.steps,
      ms_per_step=rows, wall_ms_per_step=wall, wall_ms_per_round=walls,
      speed_against_loop=speed, rounds=args.rounds, load_averages=loads, kinds=list(KINDS),
      load_average_end=harness.load_average()))
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
