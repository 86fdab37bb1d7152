"""End-to-end overhead: a whole dist_ens.train run's member-examples/s against its bare step's.

  python -m benchmarks.overhead                       # M=16, 5 rounds, default run
  python -m benchmarks.overhead --members 16,4 --rounds 5 --steps 800
  python -m benchmarks.overhead --variants 'default;train.sync_every=1;data.prefetch=0'
  python -m benchmarks.overhead --profile 'default'   # cProfile of one whole run's loop
  python -m benchmarks.overhead --devices 8 --members 8,64 --bare_k 1,10 \
      --variants "default;data.member_order='shuffled';data.member_order='bootstrap'"
  python -m benchmarks.overhead --devices 8 --members 64 --bare_k 10 --pipeline 2 \
      --variants "data.member_order='bootstrap'"   # + the anchor that gathers its batches

For configs/default.py (MLP 40-256-256-10 on MNIST-1D, batch 128, Adam) on ONE device
(jax.devices()[:1]; --devices N for the first N, on a CPU N fake ones), in one process, it
times side by side:
  bare   dist_ens's own compiled train step of ONE step a call, or K with --bare_k K
         (the run's automatic K, say, which the run's row records; assemble.build_parts,
         init_sharded, member_form, build_step, as a run builds them) called in a Python
         loop on device-resident batches made beforehand (the run's own
         data.Batches, prefetch off), blocking only at the end of each timed block.
         It is the run's step program (the same StableHLO at the same K) but not all
         of the run's device work: the batches are gathered before the timing, so the
         per-call gather from the resident split (data/resident.py, a program of its
         own; [K, M, B] rows for a per-member order, [K, B] for 'shared') is left out;
  bare on a live pipeline (--pipeline P)
         the same bare step at the same K fed by a live data.Batches, P batches ahead
         (0: made in the loop): the step and the input work the run must do, gather
         included, without the loop's actions, an anchor of its own. A diagnosis, not
         a fairer bar: at P = 2 it measured slower than the run itself (M = 8 and 64,
         8 CPU devices, quiet: 0.78-0.87x the bare step, the runs 1.06-1.25x it), as
         a loop that never waits runs the gather beside the step differently;
  run    a whole dist_ens.train of --steps steps (eval_every=0, a checkpoint at the
         end only, logging, writers and train.steps_per_call as configured: 'auto'
         runs K steps a call where that holds little work), timed by an action that
         blocks on the step's results at the first call at or past step --warmup and
         at the last step and reads time.perf_counter() there: compile, the first
         steps, the final checkpoint and the final evaluation are left out.
All are member-examples/s (M x batch x steps / seconds). Each round times the bare
step (as many steps as the run's timed part), its live-pipeline forms and one run of
every variant, in a rotating order; the ratio run/anchor of every round, its median and
its range are printed, against each anchor of the run's order.

--variants: ';'-separated runs, each 'default' or '+'-separated config overrides
(key=value, the value parsed as a Python literal), e.g. 'train.steps_per_call=1' or
"data.prefetch=0+writers=('jsonl',)". A variant with data.member_order other than
'shared' gets its own bare step (per-member batches). The run action also records the
host's time between calls of the loop and the input pipeline's busy time, for the
diagnosis.

Writes benchmarks/results/overhead.json (--out to change): harness.run_header's fields
(date, commit, load averages, machine), the device and jax version, and one row per
(M, variant, anchor) with every round's figures (the run's and the anchor's details).
"""

import argparse
import ast
import cProfile
import gc
import itertools
import os
import pstats
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging

import dist_ens
from benchmarks import harness
from dist_ens.run.run_data import build_data
from dist_ens.run import mesh_layout
from dist_ens.run import member_forms
from dist_ens import data
from dist_ens.run import assemble, initial_state
from dist_ens.config.loading import load_config

ROOT = Path(__file__).resolve().parents[1]
BARE_BATCHES = 64  # distinct device-resident batches the bare step cycles through
# A round counts as clean when other processes kept fewer cores than this busy during
# both its bare and its run measurement.
CLEAN_CORES = 0.1
_DEVICES = [1]  # how many of jax.devices() the runs and bare steps use (--devices)


def devices() -> list[Any]:
  """The devices every run and bare step of this benchmark uses (--devices)."""
  return jax.devices()[:_DEVICES[0]]


BASE: dict[str, Any] = {}  # --base: overrides under every config (bare steps and runs)


def make_config(members: int, steps: int, overrides: dict[str, Any]) -> Any:
  """configs/default.py for M members and `steps` steps: no evaluation before the end, one
  checkpoint at the end, then --base's overrides and `overrides` (dotted keys)."""
  config = load_config(ROOT / 'configs' / 'default.py')
  config.update_from_flattened_dict(BASE)
  config.num_members = members
  config.train.steps = steps
  config.train.eval_every = 0
  config.checkpoint.every = steps
  config.update_from_flattened_dict(overrides)
  return config


def parse_variants(text: str) -> dict[str, dict[str, Any]]:
  """'default;a.b=1+c.d=x' -> {'default': {}, 'a.b=1+c.d=x': {'a.b': 1, 'c.d': 'x'}}."""
  variants = {}
  for spec in filter(None, (s.strip() for s in text.split(';'))):
    overrides = {}
    if spec != 'default':
      for item in spec.split('+'):
        key, value = item.split('=', 1)
        try:
          overrides[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
          overrides[key.strip()] = value.strip()
    variants[spec] = overrides
  return variants


def thread_cpu() -> dict[str, float]:
  """CPU seconds (user + system) of this process's threads so far, by group: Python
  threads by name (the main thread, the input pipeline's, ...), XLA's compute pool
  ('tf_XLAEigen'), and 'native' for the runtime's other threads. From /proc (Linux);
  {} elsewhere. Resolution: a clock tick (10 ms)."""
  names = {t.native_id: t.name for t in threading.enumerate()}
  tick = os.sysconf('SC_CLK_TCK')
  groups: dict[str, float] = {}
  try:
    tids = os.listdir('/proc/self/task')
  except OSError:
    return groups
  for tid in tids:
    try:
      with open(f'/proc/self/task/{tid}/comm') as f:
        comm = f.read().strip()
      with open(f'/proc/self/task/{tid}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()
    except OSError:  # the thread ended meanwhile
      continue
    name = names.get(int(tid)) or (comm if comm != 'python' else 'native')
    name = 'pipeline' if name.startswith('Thread-') and '_produce' in name else name
    groups[name] = groups.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
  return groups


def cpu_per_step(before: dict[str, float], after: dict[str, float], steps: int
                 ) -> dict[str, float]:
  """Milliseconds of CPU per step of each thread group between two thread_cpu() calls."""
  return {k: round(1e3 * (after[k] - before.get(k, 0.0)) / steps, 3) for k in after
          if after[k] - before.get(k, 0.0) > 0 and not k.startswith('_')}


def machine_busy() -> tuple[float, float, float]:
  """(wall, CPU seconds every process on the machine used, this process's), for
  `foreign_cores`. The first is /proc/stat's busy time (user, nice, system, irq, softirq,
  steal); 0 where there is no /proc/stat."""
  busy = 0.0
  try:
    with open('/proc/stat') as f:
      fields = [int(v) for v in f.readline().split()[1:]]
    busy = sum(fields[i] for i in (0, 1, 2, 5, 6, 7)) / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError):
    pass
  mine = os.times()
  return time.perf_counter(), busy, mine.user + mine.system


def foreign_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
  """Cores other processes kept busy on average between two machine_busy() calls: a round
  measured while something else ran on the machine shows here."""
  wall = after[0] - before[0]
  return round(((after[1] - before[1]) - (after[2] - before[2])) / wall, 3) if wall > 0 else 0.0


class Bare:
  """dist_ens's compiled step as a run builds it, on batches already on the device."""

  def __init__(self, config: Any, steps_per_call: int = 1):
    mesh = mesh_layout.build_mesh(config, devices())
    run_data = build_data(config)
    dataset = run_data.dataset
    parts = assemble.build_parts(config, mesh, dataset.input_shape, dataset.num_classes)
    form = member_forms.member_form(parts, config.data.batch_size)
    self.step = assemble.build_step(parts, per_member_batches=run_data.order.per_member,
                                    form=form, steps_per_call=steps_per_call)
    self.state = initial_state.init_sharded(parts)
    self.hparams = parts.device_hparams()
    self._pipeline_args = (dataset.train, run_data.order, mesh, config.num_members)
    source = data.Batches(*self._pipeline_args, prefetch=0, steps_per_call=steps_per_call)
    self.batches = [next(source) for _ in range(max(1, BARE_BATCHES // steps_per_call))]
    source.close()
    jax.block_until_ready(self.batches)
    # Member-examples a call: K steps of M members' batches.
    self.examples_per_step = steps_per_call * config.num_members * config.data.batch_size
    self.steps_per_call = steps_per_call
    self.members = config.num_members
    self.form = form
    self.time(2)  # compile

  def _timed(self, next_batch, steps: int, warm: int = 0) -> dict[str, Any]:
    """Member-examples/s over `steps` calls on next_batch()'s batches (after `warm`
    untimed ones), blocking once at the end, and the CPU per step of each thread group."""
    state = self.state
    for _ in range(warm):
      state, metrics = self.step(state, self.hparams, *next_batch())
    jax.block_until_ready(state)
    cpu, busy, start = thread_cpu(), machine_busy(), time.perf_counter()
    for _ in range(steps):
      state, metrics = self.step(state, self.hparams, *next_batch())
    jax.block_until_ready((state, metrics))
    seconds = time.perf_counter() - start
    self.state = state
    return dict(rate=self.examples_per_step * steps / seconds,
                cpu_ms_per_step=cpu_per_step(cpu, thread_cpu(), steps * self.steps_per_call),
                foreign_cores=foreign_cores(busy, machine_busy()))

  def time(self, steps: int) -> dict[str, Any]:
    """On the device-resident batches made beforehand: `steps` steps, in calls of K."""
    batches = itertools.cycle(self.batches)
    return self._timed(lambda: next(batches), max(1, steps // self.steps_per_call))

  def time_host_arrays(self, steps: int) -> dict[str, Any]:
    """On numpy batches read in the loop (the data.Batches order, no prefetch) and
    handed to the jitted step as they are: the jit's own C++ path transfers them, with
    no jax.make_array_from_process_local_data per array."""
    source, order = self._pipeline_args[0], self._pipeline_args[1]
    position = data.IteratorState()

    def next_batch():
      nonlocal position
      batch = source.read(order.indices(position, range(self.members)))
      position = order.advance(position)
      return batch

    return self._timed(next_batch, steps, warm=4)

  def time_pipeline(self, steps: int, prefetch: int) -> dict[str, Any]:
    """On batches from a live input pipeline (data.Batches at this step's K, `prefetch`
    ahead; prefetch 0 makes each in the loop), as the run takes them: with a resident
    split (data.resident, the default here) each call's batch is gathered on the devices
    by the pipeline's own compiled gather, as in the run. `steps` steps, in calls of K;
    4 untimed calls first fill the prefetch queue."""
    source = data.Batches(*self._pipeline_args, prefetch=prefetch,
                          steps_per_call=self.steps_per_call)
    try:
      return self._timed(lambda: next(source), max(1, steps // self.steps_per_call), warm=4)
    finally:
      source.close()


class Timer:
  """An action (see dist_ens.training.loop) timing a run from its first call at or past
  step `warmup` to its last step.

  It blocks on the step's results at those two calls only. Between them it records
  the host's wall time between successive calls of the loop (each runs the run's
  steps_per_call steps) and
  the input pipeline's busy time (data.Batches.stats)."""

  def __init__(self, warmup: int):
    self.warmup = warmup
    self.start = self.end = None
    self.gaps: list[float] = []
    self._last = None
    self._stats = None

  def on_step(self, call: dist_ens.Call) -> None:
    now = time.perf_counter()
    if self.start is not None and self.end is None:
      self.gaps.append(now - self._last)
    self._last = now
    starts = self.start is None and call.step >= self.warmup  # The first call past warmup.
    if starts or call.step == call.session.total_steps:
      jax.block_until_ready((call.state, call.metrics))
      now = self._last = time.perf_counter()
      if starts:
        self.start, self.first, self._stats = now, call.step, call.session.batches.stats
        self._cpu, self._busy = thread_cpu(), machine_busy()
      else:
        self.end, self.steps_per_call = now, call.session.steps_per_call
        self.cpu = cpu_per_step(self._cpu, thread_cpu(), call.step - self.first)
        self.foreign = foreign_cores(self._busy, machine_busy())
        stats = call.session.batches.stats
        self.pipeline = (stats.examples - self._stats.examples,
                         stats.busy_seconds - self._stats.busy_seconds)

  def on_end(self, call: dist_ens.Call) -> None:
    pass

  def close(self) -> None:
    pass


def time_run(config: Any, warmup: int) -> dict[str, float]:
  """One dist_ens.train: member-examples/s over steps (warmup, last], and what the Timer saw."""
  timer = Timer(warmup)
  workdir = tempfile.mkdtemp(prefix='dist_ens_overhead_')
  try:
    final = dist_ens.train(config, workdir, devices=devices(), actions=[timer])
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  steps = config.train.steps - timer.first
  seconds = timer.end - timer.start
  examples, busy = timer.pipeline
  gaps = np.asarray(timer.gaps)
  return dict(rate=config.num_members * config.data.batch_size * steps / seconds,
              seconds=seconds, host_gap_median_ms=1e3 * float(np.median(gaps)),
              host_gap_mean_ms=1e3 * float(gaps.mean()), host_gap_max_ms=1e3 * float(gaps.max()),
              pipeline_busy_share=busy / seconds, pipeline_ms_per_step=1e3 * busy / steps,
              train_seconds=final['train_seconds'], cpu_ms_per_step=timer.cpu,
              steps_per_call=timer.steps_per_call,
              foreign_cores=timer.foreign)


def bare_key(overrides: dict[str, Any]) -> str:
  return overrides.get('data.member_order', 'shared')


def measure(members: int, variants: dict[str, dict[str, Any]], args: Any) -> list[dict]:
  """Rotating rounds of the bare step(s), the optional bare-step-on-a-live-pipeline jobs
  and every variant's run, for M members. Ratios are to the anchors of the same order:
  the bare step at each K of --bare_k and, with --pipeline, the bare step at that K on a
  live pipeline with each prefetch (one row for each anchor)."""
  keys = {(bare_key(overrides), k) for overrides in variants.values() for k in args.bare_k}
  if args.host_arrays:  # This feeds the shared order's bare step at K = 1.
    keys.add(('shared', 1))
  bares = {key: Bare(make_config(members, args.steps, {'data.member_order': key[0]}), key[1])
           for key in sorted(keys)}
  timed = args.steps - args.warmup
  jobs: dict[str, Any] = {}
  base: dict[str, list[str]] = {}  # job -> the anchors its rows divide by
  anchor_key: dict[str, tuple[str, int]] = {}  # anchor -> (order, K) of its bare step
  pipelines: dict[tuple[str, int], list[str]] = {}  # (order, K) -> its pipeline anchors
  for (order, k), bare in bares.items():
    name = f'bare[{order}, K={k}]'
    jobs[name] = lambda bare=bare: bare.time(timed)
    anchor_key[name] = (order, k)
  for (order, k), bare in bares.items():
    for prefetch in args.pipeline:
      name = f'bare on a live pipeline[{order}, K={k}, prefetch={prefetch}]'
      jobs[name] = lambda bare=bare, p=prefetch: bare.time_pipeline(timed, p)
      base[name] = [f'bare[{order}, K={k}]']
      anchor_key[name] = (order, k)
      pipelines.setdefault((order, k), []).append(name)
  if args.host_arrays:
    name = 'bare on numpy batches read in the loop[shared]'
    jobs[name] = lambda: bares['shared', 1].time_host_arrays(timed)
    base[name] = ['bare[shared, K=1]']
  for name, overrides in variants.items():
    jobs[name] = lambda o=overrides: time_run(make_config(members, args.steps, o), args.warmup)
    order = bare_key(overrides)
    base[name] = [a for k in args.bare_k
                  for a in [f'bare[{order}, K={k}]', *pipelines.get((order, k), [])]]
  results = harness.run_rounds(jobs, args.rounds, lambda r, name, got: (
      f'M={members} round {r} {name}: {got["rate"]:,.0f} member-ex/s; other processes '
      f'{got["foreign_cores"]:.2f} cores; CPU ms/step {got["cpu_ms_per_step"]}'))
  rows = []
  for name, anchors in base.items():
    for anchor in anchors:
      order, k = anchor_key[anchor]
      bare = [x['rate'] for x in results[anchor]]
      run = [x['rate'] for x in results[name]]
      ratios = [b / a for a, b in zip(bare, run)]
      foreign = [max(a['foreign_cores'], b['foreign_cores'])
                 for a, b in zip(results[anchor], results[name])]
      clean = [q for q, f in zip(ratios, foreign) if f < CLEAN_CORES]
      rows.append(dict(members=members, variant=name, overrides=variants.get(name, {}),
                       anchor=anchor, bare_steps_per_call=k, devices=len(devices()),
                       foreign_cores=foreign, clean_rounds=len(clean),
                       ratio_median_clean=statistics.median(clean) if clean else None,
                       form=list(bares[order, k].form), steps=args.steps, timed_steps=timed,
                       bare=bare, run=run, ratio=ratios, bare_median=statistics.median(bare),
                       run_median=statistics.median(run), ratio_median=statistics.median(ratios),
                       ratio_min=min(ratios), ratio_max=max(ratios),
                       anchor_details=results[anchor], run_details=results[name]))
  return rows


def print_rows(rows: list[dict]) -> None:
  for row in rows:
    print(f'\nM={row["members"]} {row["variant"]!r} against {row["anchor"]} '
          f'({row["timed_steps"]} timed steps of {row["steps"]}, '
          f'{row["devices"]} device(s); member-examples/s)')
    print(f'{"round":>6s} {"(a) anchor":>12s} {"(b) run":>12s} {"(b)/(a)":>8s} '
          f'{"others, cores":>14s}')
    for r, (a, b, q, f) in enumerate(zip(row['bare'], row['run'], row['ratio'],
                                         row['foreign_cores'])):
      print(f'{r:6d} {a:12,.0f} {b:12,.0f} {q:8.3f} {f:14.2f}')
    print(f'{"median":>6s} {row["bare_median"]:12,.0f} {row["run_median"]:12,.0f} '
          f'{row["ratio_median"]:8.3f}  (rounds {row["ratio_min"]:.3f}-{row["ratio_max"]:.3f})')
    clean = row['ratio_median_clean']
    print(f'median of the {row["clean_rounds"]} clean rounds (others < {CLEAN_CORES} cores): '
          + ('-' if clean is None else f'{clean:.3f}'))


def profile_run(members: int, overrides: dict[str, Any], args: Any) -> None:
  """cProfile of one whole run (the main thread: the loop, its actions, the step's dispatch),
  and Python's garbage collections in it (each generation's count, total and longest pause:
  a collection stops every thread that holds the GIL)."""
  config = make_config(members, args.steps, overrides)
  time_run(config, args.warmup)  # warm caches (dataset, jit of helpers)
  pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
  started = [0.0]

  def on_collect(phase, info):
    if phase == 'start':
      started[0] = time.perf_counter()
    else:
      pauses[info['generation']].append(time.perf_counter() - started[0])

  profiler = cProfile.Profile()
  gc.callbacks.append(on_collect)
  profiler.enable()
  result = time_run(config, args.warmup)
  profiler.disable()
  gc.callbacks.remove(on_collect)
  print(f'profiled run: {result["rate"]:,.0f} member-ex/s (slowed by the profiler)')
  for generation, times in pauses.items():
    print(f'gc generation {generation}: {len(times)} collections, {sum(times) * 1e3:.1f} ms in '
          f'all, longest {max(times, default=0) * 1e3:.1f} ms')
  stats = pstats.Stats(profiler).strip_dirs()
  stats.sort_stats('tottime').print_stats(25)
  stats.sort_stats('cumulative').print_stats(40)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--members', default='16')
  parser.add_argument('--steps', type=int, default=800)
  parser.add_argument('--warmup', type=int, default=100)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--variants', default='default')
  parser.add_argument('--base', default='',
                      help="'+'-separated overrides under every config, e.g. "
                           "'model.widths=(8,)+data.batch_size=16' (members whose step "
                           "is short beside the host's work)")
  parser.add_argument('--pipeline', default='',
                      help="prefetch values (e.g. '2,0'): also time each bare step (every "
                      'order and K) on a live data.Batches with each, an anchor of its own')
  parser.add_argument('--host_arrays', action='store_true',
                      help='also time the bare step on numpy batches passed to the jit as they are')
  parser.add_argument('--profile', default='', help='a variant to cProfile instead of timing')
  parser.add_argument('--devices', type=int, default=1,
                      help='use the first N devices (on a CPU, N fake ones: jax_num_cpu_devices)')
  parser.add_argument('--bare_k', default='1',
                      help="steps a call of the bare step, e.g. '1,10' (a row for each)")
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'overhead.json'))
  args = parser.parse_args()
  if args.base:
    BASE.update(parse_variants(args.base)[args.base])
  if args.devices > 1:  # Before jax starts its backend; counts only on a CPU.
    jax.config.update('jax_num_cpu_devices', args.devices)
  _DEVICES[0] = args.devices
  args.bare_k = [int(k) for k in args.bare_k.split(',')]
  header = harness.run_header()
  members = [int(m) for m in args.members.split(',')]
  args.pipeline = [int(p) for p in args.pipeline.split(',') if p]
  if args.profile:
    profile_run(members[0], parse_variants(args.profile)[args.profile], args)
    return
  logging.set_verbosity(logging.INFO)  # the run's own log lines, as a default run shows them
  variants = parse_variants(args.variants)
  rows = [row for m in members for row in measure(m, variants, args)]
  print_rows(rows)
  device = devices()[0]
  out = harness.write_results(args.out, dict(
      header, device=f'{len(devices())} {device.platform} device(s) ({device.device_kind})',
      jax=jax.__version__,
      config='configs/default.py', base=BASE, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
      rows=rows, load_average_end=harness.load_average()))
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
