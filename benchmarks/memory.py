"""`dist-ens plan`'s predicted peak memory per device against the measured peak, on this CPU.

  python -m benchmarks.memory              # 3 models x 2-3 M, 2 processes a cell (~2.5 min on
                                           # a shared 2-core CPU; results/memory.json)
  python -m benchmarks.memory --warm       # also with the programs from a cache (~20 min)
  python -m benchmarks.memory --models mlp --members 4,16 --out /tmp/m.json

Three configs as shipped, on ONE CPU device (jax.devices()[:1]), each at a few
ensemble sizes M (config.num_members; member_parallelism 'auto', as the configs say):
  mlp        configs/default.py          (MLP 256-256 on MNIST-1D, Adam)       M = 4, 16, 64
  cnn        configs/mnist1d_cnn.py      (1-D CNN on MNIST-1D, Adam)           M = 4, 16, 64
  resnet20   configs/digits_resnet20.py  (ResNet-20 on 8x8 digits, SGD)        M = 4, 16
all with their batch of 128, one batch shared by all members.

Predicted: dist_ens.plan.make_plan, what `dist-ens plan` prints, run in a fresh process of
this script as the command runs: its peak_bytes, on a CPU the peak RSS over its baseline
that plan's dry run reached (dist_ens/plan/dry_run.py: compile the step and init programs,
initialise the state, two steps on zeros), with program_bytes (what compiling added) and
XLA's memory analysis of the compiled train step (arguments + outputs - aliased
(donated) + temporaries bytes per device) beside it; bytes_per_member (the step peak's
growth per member, from M and 2M) and the largest M that fits --memory_gb. The init program's output
+ temp bytes (XLA) are shown too: it runs once, before the first step.

Measured: every (model, M) runs in a fresh process of this script (`timeout -k` bounded,
same interpreter). After importing jax and dist_ens, creating the CPU device, loading the
data set, building the abstract parts and the step function, and running a tiny jitted
program (XLA:CPU's one-time set-up), it reads its RSS, the baseline, and resets VmHWM to
it (5 > /proc/self/clear_refs; ru_maxrss is inherited across fork and useless here). It
then puts a batch and the hyperparameters on the device, lowers and compiles the step as
plan does (step.fn.lower(...).compile()) and the init program as initial_state.init_sharded
compiles it, creates the state with that program and runs --steps train steps
(TrainStep, as training calls it, each waited for; no evaluation step). VmHWM is reset
after each phase, so each phase's peak is read apart:
  measured   max VmHWM - baseline: everything the run added: the buffers plan's step
             peak counts, the 'programs' (compiling keeps the lowered module, the
             executables and the compiler's freed working memory in glibc's heap), and
             what the first execution of the step leaves allocated (~7-13 MB);
  programs   RSS growth from compiling (or loading) the programs ('live': what stays
             after malloc_trim(0) hands glibc's free pages back);
  buffers    the peak over init and the steps - RSS with the programs loaded: the
             state, batch and step buffers, and the first-execution part.
The headline measurement, 'cold', compiles in the process with glibc's default malloc, as
a dist-ens run does (no persistent compilation cache by default). --warm adds three
processes a cell whose programs come from a persistent compilation cache (filled by one
more process; hits and misses are counted): 'default' malloc; 'clean', with
MALLOC_MMAP_THRESHOLD_=131072 (every block >= 128 KiB is mmapped and unmapped when freed,
so RSS follows the live buffers) and malloc_trim after loading the programs; 'no YNN',
clean and with XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= (XLA:CPU's YNNPACK dot
fusions allocate outside XLA's buffer assignment). RSS counts touched pages only: a buffer
XLA assigned but never wrote is not seen.

Prints the table (model, M, form, predicted MB, measured MB, measured / predicted,
within 20%, and the parts above), the growth per added member between consecutive M (the
fixed parts cancel) against plan's bytes_per_member, with the largest M that fits
--memory_gb by plan and by the line through the measured peaks, and writes
benchmarks/results/memory.json: every reading, each cell's plan, jax's version and
harness.run_header's fields (date, commit, load averages, machine). MB = 1e6 bytes.
"""

import argparse
import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import harness
# benchmarks/resnet20.py: VmRSS/VmHWM from /proc, the VmHWM reset and the compilation cache.
from benchmarks.resnet20 import _reset_peak, _status_bytes, enable_cache

ROOT = harness.ROOT

MODELS = {'mlp': 'configs/default.py', 'cnn': 'configs/mnist1d_cnn.py',
          'resnet20': 'configs/digits_resnet20.py'}
MEMBERS = {'mlp': (4, 16, 64), 'cnn': (4, 16, 64), 'resnet20': (4, 16)}
TOLERANCE = 0.20
MB = 1e6
# Seconds to wait after a program's outputs are ready before RSS is read: XLA:CPU frees
# the program's temporaries on its own thread just after.
SETTLE = 0.2
# glibc malloc with a fixed mmap threshold: every block >= 128 KiB is its own mmap, unmapped
# when freed, so RSS follows the live buffers (by default the threshold rises to the
# largest block freed, up to 32 MiB, and freed blocks stay resident in the arenas).
MMAP_ENV = {'MALLOC_MMAP_THRESHOLD_': str(128 * 1024)}
# XLA:CPU without its YNNPACK fusions (the dots they run allocate outside XLA's buffer
# assignment, so memory_analysis does not see it).
NO_YNN_FLAG = '--xla_cpu_experimental_ynn_fusion_type='


def load(model: str, members: int) -> Any:
  """The shipped config of `model` with num_members = members."""
  from dist_ens.config.loading import load_config
  config = load_config(ROOT / MODELS[model])
  config.num_members = members
  return config


# ---------------------------------------------------------------------------------------------
# Prediction (parent process)


def predict_worker(model: str, members: int, memory_bytes: float) -> dict[str, Any]:
  """Runs in its own fresh process, as `dist-ens plan` does: dist_ens.plan's plan of the
  config at M on one device (largest M for memory_bytes). peak is plan's peak_bytes: the
  peak of its dry run in this process (compile, init, two steps on zeros). Also
  returns XLA's analysis of the init program."""
  import jax
  from dist_ens import plan
  from dist_ens.run import assemble, initial_state, mesh_layout
  config = load(model, members)
  start = time.perf_counter()
  p = plan.make_plan(config, jax.devices()[:1], memory_bytes=memory_bytes)
  seconds = time.perf_counter() - start
  mesh = mesh_layout.build_mesh(config, jax.devices()[:1])
  parts = assemble.build_parts(config, mesh, *plan.data_shape(config))
  init = initial_state.compile_init(parts)
  stats = init.memory_analysis()
  d = p.to_dict()
  return dict(peak=p.peak_bytes, step_peak=p.step.peak, program_bytes=p.program_bytes,
              dry_run_peak=p.dry_run_peak_bytes,
              step=d['step'], step_doubled=d['step_doubled'],
              init_peak=stats.output_size_in_bytes + stats.temp_size_in_bytes,
              init=dict(output=stats.output_size_in_bytes, temp=stats.temp_size_in_bytes),
              bytes_per_member=p.bytes_per_member, fixed_bytes=p.fixed_bytes,
              max_members=p.max_members, memory_bytes=p.memory_bytes,
              parallelism=p.parallelism, map_batch_size=p.map_batch_size,
              params_per_member=p.params_per_member,
              state_bytes_per_member=p.state_bytes_per_member, seconds=seconds)


def predict(model: str, members: int, args: argparse.Namespace) -> dict[str, Any]:
  """predict_worker() in a fresh process (plan's program_bytes is what compiling adds to a
  fresh process), bounded by `timeout -k`, with no compilation cache."""
  return _subprocess(['--_predict', model, '--members', str(members),
                      '--memory_gb', str(args.memory_gb)], args.timeout, dict(os.environ))


def _subprocess(flags: list[str], timeout: int, env: dict[str, str]) -> dict[str, Any]:
  """This script in a fresh process with `flags`: the JSON line it prints, or an error.
  The child runs as `-m benchmarks.memory` from the repository root (cwd), which puts the
  root on its sys.path for `from benchmarks import ...`."""
  command = ['timeout', '-k', '10', str(timeout), sys.executable, '-m', 'benchmarks.memory',
             *flags]
  start = time.perf_counter()
  done = subprocess.run(command, capture_output=True, text=True, check=False, env=env,
                        cwd=ROOT)
  lines = [l for l in done.stdout.splitlines() if l.startswith('{')]
  if done.returncode or not lines:
    return dict(error=f'rc {done.returncode}' + (' (timed out)' if done.returncode in (124, 137)
                                                 else '') + ': ' + done.stderr.strip()[-400:])
  result = json.loads(lines[-1])
  result['process_seconds'] = time.perf_counter() - start
  return result


# ---------------------------------------------------------------------------------------------
# Measurement (a fresh process per cell)


def _setup(model: str, members: int) -> tuple[Any, Any, Any, Any]:
  """(run data, parts, form, step) as training builds them; nothing on the device yet."""
  import jax
  from dist_ens.run import assemble, member_forms, mesh_layout
  from dist_ens.run.run_data import build_data
  config = load(model, members)
  run_data = build_data(config)
  mesh = mesh_layout.build_mesh(config, jax.devices()[:1])
  parts = assemble.build_parts(config, mesh, run_data.dataset.input_shape,
                               run_data.dataset.num_classes)
  form = member_forms.member_form(parts, config.data.batch_size)
  step = assemble.build_step(parts, per_member_batches=run_data.order.per_member, form=form)
  return run_data, parts, form, step


def _reading() -> dict[str, int]:
  """RSS now, its peak since the last reset, and the anonymous / file-backed parts."""
  return {k.lower(): _status_bytes(k) for k in ('VmRSS', 'VmHWM', 'RssAnon', 'RssFile')}


def _malloc_trim() -> bool:
  """Returns glibc's free heap pages to the system (malloc_trim(0)); False if unavailable."""
  try:
    return bool(ctypes.CDLL('libc.so.6').malloc_trim(0) or True)
  except (OSError, AttributeError):
    return False


def _baseline() -> tuple[int, int]:
  """(RSS growth of XLA:CPU's one-time set-up, the baseline RSS), VmHWM reset to it.

  The set-up (compiler or code loader, thread pool) is the runtime's, not the step's:
  a tiny program is compiled and run before the baseline is read."""
  import jax
  gc.collect()
  before = _status_bytes('VmRSS')
  jax.block_until_ready(jax.jit(lambda v: v + 1)(jax.numpy.zeros(8)))
  gc.collect()
  base = _status_bytes('VmRSS')
  if not _reset_peak():
    raise OSError('cannot reset VmHWM (/proc/self/clear_refs); the peak would be wrong')
  return base - before, base


def _train(step: Any, state: Any, hparams: Any, batches: Any, steps: int
           ) -> tuple[list[dict[str, int]], bool, int]:
  """`steps` steps of the step as training calls it, each waited for: (the reading after
  each, whether the state's buffers were donated, bytes of the live jax arrays)."""
  import jax
  readings, donated = [], True
  for _ in range(steps):
    old = jax.tree.leaves(state)[0]
    state, metrics = step(state, hparams, *next(batches))
    jax.block_until_ready(metrics.loss)
    time.sleep(SETTLE)
    donated = donated and old.is_deleted()
    readings.append(_reading())
  return readings, donated, sum(a.nbytes for a in jax.live_arrays())


def _load_programs(parts: Any, step: Any, hparams: Any, batch: Any) -> tuple[Any, Any]:
  """(the step compiled as plan compiles it (step.fn.lower(...).compile()), the init
  program as init_sharded compiles it (initial_state.compile_init)): from the cache, or
  compiled here."""
  from dist_ens.run import initial_state
  compiled = step.fn.lower(parts.abstract_state, hparams, *batch).compile()
  init = initial_state.compile_init(parts)
  gc.collect()
  return compiled, init


def worker(model: str, members: int, steps: int, cache_dir: str, trim: bool) -> dict[str, Any]:
  """Runs in its own process: the RSS growth of loading (or compiling) the programs,
  initialising the state and stepping one cell, over a baseline taken after imports,
  device, data and the abstract parts. VmHWM is reset after each phase, so each phase's
  peak is read apart. `trim`: malloc_trim(0) after loading the programs, so that the
  buffers are measured from the RSS the programs keep live."""
  import jax
  from dist_ens import data
  cache = enable_cache(cache_dir) if cache_dir else {}
  jax.devices()
  run_data, parts, form, step = _setup(model, members)
  runtime_setup, base = _baseline()
  cache_before = dict(cache)
  batches = data.Batches(run_data.dataset.train, run_data.order, parts.mesh, members,
                         prefetch=0, with_index=step.uses_index)
  hparams = parts.device_hparams()
  compiled, init = _load_programs(parts, step, hparams, next(batches))
  programs = _reading()
  trimmed = _reading() if trim and _malloc_trim() else programs
  _reset_peak()
  state = jax.block_until_ready(init())  # What initial_state.init_sharded(parts) runs.
  time.sleep(SETTLE)
  initialised = _reading()
  _reset_peak()
  per_step, donated, live = _train(step, state, hparams, batches, steps)
  hwm = max(programs['vmhwm'], initialised['vmhwm'], per_step[-1]['vmhwm'])
  buffers = max(initialised['vmhwm'], per_step[-1]['vmhwm']) - trimmed['vmrss']
  stats = compiled.memory_analysis()
  return dict(model=model, members=members, steps=steps, base_rss=base,
              runtime_setup=runtime_setup, programs=programs, trimmed=trimmed,
              initialised=initialised, per_step=per_step, peak=hwm - base,
              programs_bytes=programs['vmrss'] - base,
              programs_live=trimmed['vmrss'] - base, buffers=buffers,
              init_peak=initialised['vmhwm'] - trimmed['vmrss'],
              steps_peak=per_step[-1]['vmhwm'] - trimmed['vmrss'], live_array_bytes=live,
              donated=donated, parallelism=form[0], map_batch_size=form[1],
              xla_peak_memory=int(getattr(stats, 'peak_memory_in_bytes', 0) or 0),
              malloc_env={k: v for k, v in os.environ.items() if k.startswith('MALLOC_')},
              trim=trim, compilation_cache={k: v - cache_before.get(k, 0)
                                            for k, v in cache.items()})


def measure(model: str, members: int, args: argparse.Namespace, cache_dir: str,
            variant: str = 'cold', steps: int | None = None) -> dict[str, Any]:
  """worker() in a fresh process of this interpreter, bounded by `timeout -k`. variant:
  'cold' (no cache: compiles in the process, as a dist-ens run does), 'default' (programs
  from the cache), 'clean' (MMAP_ENV, malloc_trim after loading) or 'clean_no_ynn'
  (clean, and NO_YNN_FLAG: compiled in the process)."""
  flags = ['--_worker', model, '--members', str(members), '--steps',
           str(steps or args.steps), '--_cache_dir', '' if variant == 'cold' else cache_dir]
  env = {k: v for k, v in os.environ.items() if not k.startswith('MALLOC_')}
  if variant.startswith('clean'):
    flags.append('--_trim')
    env.update(MMAP_ENV)
  if variant == 'clean_no_ynn':
    env['XLA_FLAGS'] = f'{env.get("XLA_FLAGS", "")} {NO_YNN_FLAG}'.strip()
  result = _subprocess(flags, args.timeout, env)
  if 'process_seconds' in result:
    result['seconds'] = result.pop('process_seconds')
  return result


# ---------------------------------------------------------------------------------------------
# The run


# measured_cold is the headline: a dist-ens run compiles its programs in its process (no
# persistent cache by default). The others take the programs from a cache (--warm).
VARIANTS = ('measured_cold', 'measured', 'measured_clean', 'measured_clean_no_ynn')
HEADLINE = 'measured_cold'


def run_cell(model: str, members: int, args: argparse.Namespace, cache_dir: str) -> dict:
  """One (model, M): plan's prediction, then the measured peaks (see measure's variants)."""
  pred = predict(model, members, args)
  if 'error' in pred:
    raise RuntimeError(f'plan of {model} at M={members} failed: {pred["error"]}')
  row = dict(model=model, config=MODELS[model], members=members, predicted=pred)
  if args.warm:  # Fills the cache the warm variants load from (one step; not reported).
    measure(model, members, args, cache_dir, 'default', steps=1)
  for key in VARIANTS:
    variant = key.replace('measured_', '') if key != 'measured' else 'default'
    skip = key != HEADLINE and not args.warm or (variant == 'clean_no_ynn' and not args.ynn)
    r = row[key] = None if skip else measure(model, members, args, cache_dir, variant)
    if r and 'error' not in r:
      r.update(ratio=r['peak'] / pred['peak'],
               buffers_ratio=r['buffers'] / pred['step_peak'],
               same_form=[r['parallelism'], r['map_batch_size']] ==
               [pred['parallelism'], pred['map_batch_size']])
  if 'error' not in row[HEADLINE]:
    ratio = row[HEADLINE]['ratio']
    row.update(ratio=ratio, within=abs(ratio - 1) <= TOLERANCE)
  print(f'{model} M={members}: predicted {pred["peak"] / MB:.1f} MB ({pred["seconds"]:.0f} s); '
        + ', '.join(f'{k} ' + (row[k]['error'] if 'error' in row[k] else
                               f'{row[k]["peak"] / MB:.1f} MB ({row[k]["seconds"]:.0f} s)')
                    for k in VARIANTS if row[k]), flush=True)
  return row


def _slope(lo: dict, hi: dict, key: str, field: str) -> float | None:
  if not lo.get(key) or not hi.get(key) or 'error' in lo[key] or 'error' in hi[key]:
    return None
  return (hi[key][field] - lo[key][field]) / (hi['members'] - lo['members'])


def growth(rows: list[dict], memory_bytes: float) -> list[dict]:
  """Per model, between consecutive M: the growth per added member of the measured and of
  the predicted peaks, plan's bytes_per_member (fitted on M -> 2M) at both M, and where
  both M run the same form, the largest M that fits memory_bytes by plan and by the line
  through the two measured peaks."""
  out = []
  for lo, hi in zip(rows, rows[1:]):
    if lo['model'] != hi['model']:
      continue
    g = dict(model=lo['model'], members=[lo['members'], hi['members']],
             same_form=_form(lo['predicted']) == _form(hi['predicted']),
             predicted=(hi['predicted']['peak'] - lo['predicted']['peak'])
             / (hi['members'] - lo['members']),
             plan_bytes_per_member=[lo['predicted']['bytes_per_member'],
                                    hi['predicted']['bytes_per_member']],
             **{key: _slope(lo, hi, key, 'peak') for key in VARIANTS},
             **{f'{key}_buffers': _slope(lo, hi, key, 'buffers') for key in VARIANTS})
    slope = g[HEADLINE]
    if slope is not None:
      g['ratio'] = slope / g['predicted']
      if g['same_form'] and slope > 0:
        fixed = lo[HEADLINE]['peak'] - slope * lo['members']
        g['max_members'] = dict(memory_bytes=memory_bytes,
                                plan=hi['predicted']['max_members'],
                                measured=int((memory_bytes - fixed) // slope))
    out.append(g)
  return out


def _form(pred: dict) -> str:
  return pred['parallelism'] + (f'/{pred["map_batch_size"]}' if pred['map_batch_size'] else '')


def _mb(cell: dict | None, field: str, ratio: str = '') -> str:
  if not cell or 'error' in cell:
    return cell['error'][:30] if cell else '-'
  return f'{cell[field] / MB:.1f}' + (f' ({cell[ratio]:.2f})' if ratio else '')


def print_tables(result: dict) -> None:
  print(f'\npeak bytes per device, MB (1e6 bytes), over init and {result["steps"]} steps. '
        'predicted: dist-ens plan\'s peak (its dry run\'s peak RSS in its own fresh process: '
        'compile, init, two steps on zeros); measured: VmHWM - baseline in a fresh process '
        'that compiles its programs, as a dist-ens run does; programs: RSS growth from '
        'compiling the step and init programs (plan\'s / the run\'s); buffers: peak RSS over '
        'init and the steps - RSS with the programs loaded (x plan\'s step peak). With '
        f'--warm, from a compilation cache: default malloc; clean: {MMAP_ENV} and '
        f'malloc_trim after loading; no YNN: clean, XLA_FLAGS={NO_YNN_FLAG}')
  print('| model | M | form | predicted | measured | measured / predicted | within 20% | '
        'programs, plan / run | step peak (XLA) | buffers | init (XLA) | warm: peak | '
        'programs | programs live | buffers, clean | buffers, no YNN |')
  print('|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
  for r in result['rows']:
    cold, w, c, p = r[HEADLINE], r['measured'], r['measured_clean'], r['predicted']
    within = '-' if 'within' not in r else ('yes' if r['within'] else 'no')
    ratio = f'{r["ratio"]:.2f}' if 'ratio' in r else '-'
    plan_programs = '-' if p['program_bytes'] is None else f'{p["program_bytes"] / MB:.1f}'
    print(f'| {r["model"]} | {r["members"]} | {_form(p)} | {p["peak"] / MB:.1f} | '
          f'{_mb(cold, "peak")} | {ratio} | {within} | {plan_programs} / '
          f'{_mb(cold, "programs_bytes")} | {p["step_peak"] / MB:.1f} | '
          f'{_mb(cold, "buffers", "buffers_ratio")} | {p["init_peak"] / MB:.1f} | '
          f'{_mb(w, "peak")} | {_mb(w, "programs_bytes")} | {_mb(c, "programs_live")} | '
          f'{_mb(c, "buffers", "buffers_ratio")} | '
          f'{_mb(r["measured_clean_no_ynn"], "buffers", "buffers_ratio")} |')
  print_growth(result)


def print_growth(result: dict) -> None:
  gb = result['memory_gb']
  print('\ngrowth per added member, MB: (value at M2 - value at M1) / (M2 - M1); plan\'s '
        'bytes_per_member is fitted on M -> 2M at M1 and at M2; largest M in '
        f'{gb:g} GB: plan at M2 / the line through the two measured peaks (same form only)')
  print('| model | M1 -> M2 | plan bytes_per_member | predicted peaks | measured | '
        'measured / predicted | buffers | warm | buffers, clean | buffers, no YNN | '
        f'largest M in {gb:g} GB |')
  print('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
  f = lambda v: '-' if v is None else f'{v / MB:.3f}'
  for g in result['growth']:
    bpm = ' / '.join(f'{v / MB:.3f}' for v in g['plan_bytes_per_member'])
    ratio = f'{g["ratio"]:.2f}' if 'ratio' in g else '-'
    fit = g.get('max_members')
    fit = f'{fit["plan"]:,} / {fit["measured"]:,}' if fit else '- (form changes)'
    print(f'| {g["model"]} | {g["members"][0]} -> {g["members"][1]} | {bpm} | '
          f'{f(g["predicted"])} | {f(g[HEADLINE])} | {ratio} | '
          f'{f(g[HEADLINE + "_buffers"])} | {f(g["measured"])} | '
          f'{f(g["measured_clean_buffers"])} | {f(g["measured_clean_no_ynn_buffers"])} | '
          f'{fit} |')


def machine_info() -> dict[str, Any]:
  """jax, its device and XLA_FLAGS (harness.run_header has the date, commit and machine)."""
  import jax
  device = jax.devices()[0]
  return dict(jax=jax.__version__, device=f'1 {device.platform} device ({device.device_kind})',
              xla_flags=os.environ.get('XLA_FLAGS', ''))


NOTES = dict(
    predicted='dist_ens.plan.make_plan on 1 CPU device in a fresh process (no compilation '
    'cache): peak_bytes = dry_run_peak: the peak RSS over that process\'s baseline through '
    'compiling the step and init programs, initialising the state and two steps on zeros '
    '(dist_ens/plan/dry_run.py); program_bytes: the RSS compiling added; step_peak: arguments + '
    'outputs - aliased + temp bytes of the compiled train step (XLA memory_analysis); '
    'init_peak: output + temp of the init program',
    measured='max VmHWM - VmRSS at the baseline (after jax import, device init, data load, '
    'the abstract parts and a tiny jitted program), in a fresh process: batch and '
    'hyperparameters on the device, step and init programs compiled (measured_cold) or '
    'loaded from a cache (the others), the state initialised, `steps` steps each waited '
    'for; no evaluation',
    programs_bytes='RSS growth from compiling (or loading) the step and init programs '
    '(programs_live: after malloc_trim(0), clean runs only)',
    buffers='peak RSS over init and the steps - RSS with the programs loaded: state, batch, '
    'step temporaries, plus what the first execution leaves allocated',
    variants='measured_cold: no compilation cache, default malloc, as a dist-ens run; with '
    '--warm, programs from a cache: measured: default glibc malloc; measured_clean: '
    'MALLOC_MMAP_THRESHOLD_=131072 and malloc_trim after loading; measured_clean_no_ynn: '
    'clean and XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= (compiled in the process)')


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--models', default=','.join(MODELS), help='comma-separated, of '
                      + ', '.join(MODELS))
  parser.add_argument('--members', default='', help='comma-separated M for every model '
                      '(default: ' + '; '.join(f'{k} {v}' for k, v in MEMBERS.items()) + ')')
  parser.add_argument('--steps', type=int, default=20, help='train steps per measurement')
  parser.add_argument('--warm', action='store_true',
                      help='also measure each cell with its programs from a compilation '
                      'cache (three more processes a cell)')
  parser.add_argument('--no_ynn_check', dest='ynn', action='store_false',
                      help=f'with --warm, skip the clean measurement with XLA_FLAGS={NO_YNN_FLAG}')
  parser.add_argument('--memory_gb', type=float, default=1.0,
                      help='device memory for the largest-M comparison (GB, 1e9 bytes)')
  parser.add_argument('--timeout', type=int, default=300, help='seconds per measuring process')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'memory.json'))
  parser.add_argument('--_worker', default='', help=argparse.SUPPRESS)
  parser.add_argument('--_predict', default='', help=argparse.SUPPRESS)
  parser.add_argument('--_cache_dir', default='', help=argparse.SUPPRESS)
  parser.add_argument('--_trim', action='store_true', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.models = [m for m in args.models.split(',') if m]
  args.members = tuple(int(m) for m in args.members.split(',') if m)
  return args


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args._worker:
    print(json.dumps(worker(args._worker, args.members[0], args.steps, args._cache_dir,
                            args._trim)))
    return
  if args._predict:
    print(json.dumps(predict_worker(args._predict, args.members[0], args.memory_gb * 1e9)))
    return
  header, start = harness.run_header(), time.perf_counter()
  cache_dir = tempfile.mkdtemp(prefix='memory_xla_cache_')
  try:
    import jax
    print(f'jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cores; '
          f'{args.steps} steps per measurement', flush=True)
    rows = [run_cell(model, m, args, cache_dir) for model in args.models
            for m in args.members or MEMBERS[model]]
  finally:
    shutil.rmtree(cache_dir, ignore_errors=True)
  result = dict(header, **machine_info(), steps=args.steps, tolerance=TOLERANCE, notes=NOTES,
                rows=rows, memory_gb=args.memory_gb, growth=growth(rows, args.memory_gb * 1e9),
                seconds=time.perf_counter() - start, load_average_end=harness.load_average())
  print_tables(result)
  misses = [f'{r["model"]}@{r["members"]}' for r in rows for k in ('measured', 'measured_clean')
            if (r[k] or {}).get('compilation_cache', {}).get('cache_misses')]
  print(f'\nwarm runs with a compilation-cache miss (their peak includes a compile): '
        f'{", ".join(misses) or "none"}; {result["seconds"]:.0f} s in all')
  out = harness.write_results(args.out, result)
  print(f'wrote {out}')


if __name__ == '__main__':
  main(sys.argv[1:])
