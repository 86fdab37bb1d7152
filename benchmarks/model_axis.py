"""The 'model' mesh axis (issue 34): the largest ViT member that trains at M=4 with Adam
under a per-device memory budget, model = 1, 2, 4, 8, and what model=2 costs in step time.

  python -m benchmarks.model_axis            # ~13 min on a shared 2-core CPU
  python -m benchmarks.model_axis --quick    # ~2 min: 3 sizes, model 1 and 8, fewer rounds
  python -m benchmarks.model_axis --budgets_gb 2,8 --models 1,2,4,8 --out /tmp/m.json

Memory (what is measured: XLA:CPU's buffer assignment of the compiled train step,
`compiled.memory_analysis()`, per device; fake CPU devices have no device memory, so
nothing is allocated or run). M=4 ViT members on 32x32x3 inputs, patches of 4 (64
tokens), MLP 4x hidden, heads of 64, mean pooling, 10 classes, batch 64 per member
(one batch shared by the members), configs/cifar10_vit_ti.py's training recipe (Adam
with weight decay, gradient clipping, label smoothing; no augmentation, no dropout).
A ladder of growing members at depth 12 (LADDER: ViT-Ti / S / B's widths, then wider,
so that every compile stays short), each on a mesh of member=4 groups x data=1 x
model devices, 4 x model devices in all (4, 8, 16, 32: one member per group, so a
member is given 1, 2, 4 or 8 devices); FSDP, the default rule (mesh.fsdp_min_size 4096;
--rules vit: models.vit.VIT_RULES, tensor parallel, FSDP for the rest). The member form
is what 'auto' resolves (vmap). Each cell builds the run from its config as `dist-ens
plan` does (assemble.build_run with shapes, no data), lowers the step on abstract
arguments (step.fn.lower(abstract state, hparams, x, y)) and compiles it at
xla_backend_optimization_level 0 (buffer assignment precedes LLVM, so its bytes are
those of the default -O2: --check_opt compares one cell). Per device:
  argument, output, alias, temp   memory_analysis()'s bytes;
  peak      argument + output - alias + temp (alias: the donated state written in place);
  state     the layout's bytes of the train state per device
            (placement.state_bytes_per_device: parameters + Adam's moments + step).
For each model size the ladder is walked up until a peak exceeds the largest budget.
For each --budgets_gb (GB = 1e9 bytes) the largest member whose peak fits is reported.

Speed: the step time of model=2 (mesh 4 x 1 x 2, 8 devices) against model=1 (4 x 1 x 1,
4 devices: the same members, each given one device) and model=1 with data=2 (4 x 2 x 1,
the same 8 devices), for a ViT that fits all (--speed_size, default hidden 64, depth 4,
4 heads, MLP 256: digits_vit's width on 32x32x3), M=4, batch 64, random inputs. Built as
training builds it (build_run, init_sharded, run.step(), batches via data.to_global), in
a fresh process with 8 fake CPU devices. After two warm-up steps (compile excluded), each
of --rounds rounds times every variant once in a rotating order over enough steps to last
--min_time seconds; medians over rounds. On a CPU the fake devices share the same 2
cores, so model=2 adds no compute: the ratio is the price of the collectives and of the
partitioned program on a CPU, not what a second GPU gives.

Prints the tables and writes benchmarks/results/model_axis.json (--quick:
model_axis_quick.json) with harness.run_header's fields (command, date, commit, load
averages, machine) and jax's version.
"""

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from importlib import metadata
from typing import Any

from benchmarks import harness

ROOT = harness.ROOT
CONFIG = ROOT / 'configs' / 'cifar10_vit_ti.py'
MEMBERS, BATCH, INPUT_SHAPE, NUM_CLASSES, PATCH = 4, 64, (32, 32, 3), 10, 4
# (name, hidden, depth): heads = hidden / 64, MLP 4 x hidden. Depth 12 throughout: a
# deeper member compiles proportionally longer (ViT-L's 24 blocks took 52 s at model=8).
LADDER = (('Ti', 192, 12), ('S', 384, 12), ('576', 576, 12), ('B', 768, 12),
          ('1024', 1024, 12), ('1280', 1280, 12), ('1536', 1536, 12), ('2048', 2048, 12),
          ('2560', 2560, 12), ('3072', 3072, 12))
QUICK_LADDER = LADDER[:2] + LADDER[3:4]
MODEL_SIZES, QUICK_MODEL_SIZES = (1, 2, 4, 8), (1, 8)
MEMORY_DEVICES = 4 * max(MODEL_SIZES)
SPEED_DEVICES = 8
# Buffer assignment (what memory_analysis reads) runs before LLVM's code generation.
MEMORY_COMPILER_OPTIONS = {'xla_backend_optimization_level': 0}
VIT_RULES = 'dist_ens.models.vit:VIT_RULES'
# (name, member, data, model) meshes of the speed comparison.
SPEED_MESHES = (('model=1', 4, 1, 1), ('model=2', 4, 1, 2), ('model=1,data=2', 4, 2, 1))
GB = 1e9


def vit_config(hidden: int, depth: int, heads: int, mlp: int, member: int, data: int,
               model: int, rules: str = 'fsdp', members: int = MEMBERS) -> Any:
  """configs/cifar10_vit_ti.py at this size and mesh, steps counted (no data to count
  epochs by), no augmentation (it needs per-example indices), one shared batch."""
  from dist_ens.config.loading import load_config
  config = load_config(CONFIG)
  config.num_members = members
  config.data.batch_size, config.data.augment, config.data.member_order = BATCH, 'none', 'shared'
  config.train.epochs, config.train.steps = 0, 39_000
  config.optim.warmup_epochs, config.optim.warmup_steps = 0.0, 1_950
  config.model.patch_size, config.model.hidden, config.model.depth = PATCH, hidden, depth
  config.model.heads, config.model.mlp_dim = heads, mlp
  config.mesh.member, config.mesh.data, config.mesh.model = member, data, model
  if rules == 'vit':
    config.mesh.rules = VIT_RULES
  return config


def build(config: Any) -> Any:
  """The run as `dist-ens plan` wires it: shapes given, no data loaded."""
  import jax
  from dist_ens.run import assemble
  mesh = config.mesh
  devices = jax.devices()[:mesh.member * mesh.data * mesh.model]
  return assemble.build_run(config, devices=devices, shapes=(INPUT_SHAPE, NUM_CLASSES))


def abstract_args(parts: Any) -> tuple[Any, ...]:
  """(state, hparams, x, y) as ShapeDtypeStructs with the step's shardings."""
  import jax
  import numpy as np
  from dist_ens.parallel import mesh as mesh_lib
  sharding = mesh_lib.batch_sharding(parts.mesh)
  x = jax.ShapeDtypeStruct((BATCH, *INPUT_SHAPE), np.float32, sharding=sharding)
  y = jax.ShapeDtypeStruct((BATCH,), np.int32, sharding=sharding)
  hparams = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                         parts.device_hparams())
  return parts.abstract_state, hparams, x, y


# ---------------------------------------------------------------------------------------------
# Memory (a fresh process with MEMORY_DEVICES fake CPU devices)


def memory_cell(name: str, hidden: int, depth: int, model: int, rules: str,
                options: dict[str, Any] | None = MEMORY_COMPILER_OPTIONS,
                one_device: bool = False) -> dict[str, Any]:
  """XLA's memory analysis of the compiled step of 4 members on member=4 x 1 x model;
  `one_device`: of 1 member on 1 device (model=1's program per device)."""
  import jax
  from dist_ens.parallel import placement
  start = time.perf_counter()
  members = 1 if one_device else MEMBERS
  run = build(vit_config(hidden, depth, hidden // 64, 4 * hidden, members, 1, model, rules,
                         members=members))
  parts = run.parts
  step = run.step()
  lowered = step.fn.lower(*abstract_args(parts))
  compiled = lowered.compile(compiler_options=options)
  stats = compiled.memory_analysis()
  state = parts.abstract_state
  params = sum(leaf.size for leaf in jax.tree.leaves(state.params)) // members
  cell = dict(size=name, hidden=hidden, depth=depth, heads=hidden // 64,
              mlp_dim=4 * hidden, params_per_member=params, model=model,
              mesh=dict(parts.mesh.shape), devices=parts.mesh.size, rules=rules,
              form=list(run.form), argument=stats.argument_size_in_bytes,
              output=stats.output_size_in_bytes, alias=stats.alias_size_in_bytes,
              temp=stats.temp_size_in_bytes,
              state=placement.state_bytes_per_device(parts.layout.state_specs(state),
                                                          state, parts.mesh.shape),
              compile_options=options or {}, seconds=time.perf_counter() - start)
  cell['peak'] = cell['argument'] + cell['output'] - cell['alias'] + cell['temp']
  if one_device:
    cell['members'] = members
    cell['_run'] = (run, step)
  return cell


def run_steps(cell: dict[str, Any], steps: int) -> None:
  """`steps` steps of the cell's step on its device, the allocator's peak read after
  (device.memory_stats()['peak_bytes_in_use']: the process's peak so far, so a cell run
  after a smaller one reads its own peak). Records 'error' (e.g. out of memory) instead."""
  import jax
  import numpy as np
  from dist_ens import data
  from dist_ens.run import initial_state
  from dist_ens.parallel import mesh as mesh_lib
  run, step = cell.pop('_run')
  parts = run.parts
  try:
    sharding = mesh_lib.batch_sharding(parts.mesh)
    x = data.to_global(np.zeros((BATCH, *INPUT_SHAPE), np.float32), sharding)
    y = data.to_global(np.zeros((BATCH,), np.int32), sharding)
    state, hparams = initial_state.init_sharded(parts), parts.device_hparams()
    for _ in range(steps):
      state, metrics = step(state, hparams, x, y)
    jax.block_until_ready(metrics.loss)
    stats = parts.mesh.devices.flat[0].memory_stats() or {}
    cell['ran_steps'] = steps
    cell['device_peak'] = stats.get('peak_bytes_in_use')
    cell['device_limit'] = stats.get('bytes_limit')
  except Exception as e:  # pylint: disable=broad-except  # An OOM is a result here.
    cell['run_error'] = f'{type(e).__name__}: {str(e)[:300]}'
  finally:
    state = x = y = None


def memory_worker(args: argparse.Namespace) -> dict[str, Any]:
  """Every model size up the ladder until a peak exceeds the largest budget."""
  limit = max(args.budgets_gb) * GB
  cells, checks = [], []
  options = None if args.device == 'gpu' else MEMORY_COMPILER_OPTIONS
  for model in args.models:
    for name, hidden, depth in args.ladder:
      cell = memory_cell(name, hidden, depth, model, args.rules, options,
                         one_device=args.device == 'gpu')
      if '_run' in cell:
        if args.run_steps:
          run_steps(cell, args.run_steps)
        cell.pop('_run', None)
      cells.append(cell)
      print(f'  model={model} {name:>4s} (hidden {hidden}, depth {depth}): peak '
            f'{cell["peak"] / GB:.3f} GB, state {cell["state"] / GB:.3f} GB, '
            f'{cell["seconds"]:.0f} s', file=sys.stderr, flush=True)
      if cell['peak'] > limit:
        break
  if args.check_opt:  # The same cell at XLA's default optimisation level.
    name, hidden, depth = args.ladder[0]
    for model in (min(args.models), max(args.models)):
      default = memory_cell(name, hidden, depth, model, args.rules, options=None)
      fast = next(c for c in cells if c['model'] == model and c['size'] == name)
      checks.append(dict(size=name, model=model, same_bytes=all(
          default[k] == fast[k] for k in ('argument', 'output', 'alias', 'temp')),
                         default_seconds=default['seconds'], fast_seconds=fast['seconds']))
  return dict(cells=cells, opt_level_checks=checks)


# ---------------------------------------------------------------------------------------------
# Speed (a fresh process with SPEED_DEVICES fake CPU devices)


def speed_worker(args: argparse.Namespace) -> dict[str, Any]:
  """Seconds per step of each SPEED_MESHES variant, timed side by side in rounds."""
  import jax
  import numpy as np
  from dist_ens import data
  from dist_ens.run import initial_state
  from dist_ens.parallel import mesh as mesh_lib
  hidden, depth, heads, mlp = args.speed_size
  rng = np.random.default_rng(0)
  x = rng.standard_normal((BATCH, *INPUT_SHAPE), np.float32)
  y = rng.integers(0, NUM_CLASSES, BATCH).astype(np.int32)
  variants = {}
  for name, member, data_axis, model in SPEED_MESHES:
    run = build(vit_config(hidden, depth, heads, mlp, member, data_axis, model, args.rules))
    parts = run.parts
    sharding = mesh_lib.batch_sharding(parts.mesh)
    batch = data.to_global(x, sharding), data.to_global(y, sharding)
    variants[name] = dict(step=run.step(), state=initial_state.init_sharded(parts),
                          hparams=parts.device_hparams(), batch=batch, form=list(run.form),
                          mesh=dict(parts.mesh.shape))

  def steps(v: dict[str, Any], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
      v['state'], metrics = v['step'](v['state'], v['hparams'], *v['batch'])
    jax.block_until_ready(metrics.loss)
    return time.perf_counter() - start

  counts = {}
  for name, v in variants.items():  # Compiles, then sizes each variant's timed run.
    compile_seconds = steps(v, 1)
    v['compile_seconds'] = compile_seconds
    once = steps(v, 1)
    counts[name] = max(1, round(args.min_time / max(once, 1e-4)))
  per_round = {name: [] for name in variants}
  for _, name in harness.rotating_rounds(variants, args.rounds):
    per_round[name].append(steps(variants[name], counts[name]) / counts[name])
  base = per_round['model=1']
  return dict(size=dict(hidden=hidden, depth=depth, heads=heads, mlp_dim=mlp),
              rounds=args.rounds, min_time=args.min_time, steps_per_round=counts,
              variants={name: dict(mesh=v['mesh'], form=v['form'],
                                   compile_seconds=v['compile_seconds'],
                                   seconds_per_step=per_round[name],
                                   median_seconds=statistics.median(per_round[name]),
                                   ratio_to_model1=statistics.median(
                                       [s / b for s, b in zip(per_round[name], base)]))
                        for name, v in variants.items()})


# ---------------------------------------------------------------------------------------------
# The parent: workers, tables, the results file


def _subprocess(flags: list[str], devices: int, timeout: int) -> dict[str, Any]:
  """This script in a fresh process with `devices` fake CPU devices (0: the machine's
  own devices, e.g. its GPU): its JSON line."""
  env = dict(os.environ)
  if devices:
    flags_env = re.sub(r'--xla_force_host_platform_device_count=\d+', '',
                       env.get('XLA_FLAGS', ''))
    env['XLA_FLAGS'] = f'{flags_env} --xla_force_host_platform_device_count={devices}'.strip()
    env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = os.pathsep.join(p for p in (str(ROOT), env.get('PYTHONPATH')) if p)
  command = ['timeout', '-k', '10', str(timeout), sys.executable, '-m', 'benchmarks.model_axis',
             *flags]
  done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False, env=env,
                        cwd=ROOT)
  lines = [l for l in done.stdout.splitlines() if l.startswith('{')]
  if done.returncode or not lines:
    raise RuntimeError(f'{" ".join(flags)}: rc {done.returncode}'
                       + (' (timed out)' if done.returncode in (124, 137) else ''))
  return json.loads(lines[-1])


def fits(cells: list[dict[str, Any]], models: tuple[int, ...], budgets: tuple[float, ...],
         ladder: tuple) -> list[dict[str, Any]]:
  """For each budget and model size, the largest ladder member whose peak fits (every
  smaller one fitting too); 'top' when the ladder's largest still fits."""
  out = []
  for gb in budgets:
    row = dict(budget_gb=gb, largest={})
    for model in models:
      mine = {c['size']: c for c in cells if c['model'] == model}
      best = None
      for name, _, _ in ladder:
        if name not in mine or mine[name]['peak'] > gb * GB:
          break
        best = mine[name]
      row['largest'][model] = None if best is None else dict(
          size=best['size'], hidden=best['hidden'], depth=best['depth'],
          params_per_member=best['params_per_member'], peak=best['peak'],
          ladder_top=best['size'] == ladder[-1][0])
    out.append(row)
  return out


def print_tables(result: dict[str, Any]) -> None:
  if 'memory' in result:
    print_memory(result)
  speed = result.get('speed')
  if speed:
    s = speed['size']
    print(f'\nstep time, ViT hidden {s["hidden"]} depth {s["depth"]} heads {s["heads"]} MLP '
          f'{s["mlp_dim"]}, M={MEMBERS}, batch {BATCH}; medians of {speed["rounds"]} rotating '
          'rounds (fake CPU devices sharing the cores)')
    print('| variant | mesh | devices | s / step | / model=1 |')
    print('|---|---|---:|---:|---:|')
    for name, v in speed['variants'].items():
      mesh = ' x '.join(str(v['mesh'].get(a, 1)) for a in ('member', 'data', 'model'))
      print(f'| {name} | {mesh} | {math.prod(v["mesh"].values())} | '
            f'{v["median_seconds"]:.4f} | {v["ratio_to_model1"]:.2f} |')


def print_memory(result: dict[str, Any]) -> None:
  models, cells = result['models'], result['memory']['cells']
  print(f'\nmemory per device, GB: peak (state), XLA:CPU memory_analysis of the compiled step; '
        f'M={MEMBERS}, batch {BATCH}, 4 x 1 x model mesh; - : not compiled (a smaller member '
        'already exceeded the largest budget)')
  print('| ViT (hidden / depth / heads) | params / member | '
        + ' | '.join(f'model={m}' for m in models) + ' |')
  print('|---|---:|' + '---:|' * len(models))
  for name, hidden, depth in result['ladder']:
    row = {c['model']: c for c in cells if c['size'] == name}
    if not row:
      continue
    params = next(iter(row.values()))['params_per_member']
    print(f'| {name} ({hidden} / {depth} / {hidden // 64}) | {params / 1e6:.1f}M | '
          + ' | '.join(f'{row[m]["peak"] / GB:.2f} ({row[m]["state"] / GB:.2f})' if m in row
                       else '-' for m in models) + ' |')
  print('\nthe largest member whose peak fits the budget (params / member)')
  print('| budget per device | ' + ' | '.join(f'model={m}' for m in models) + ' |')
  print('|---|' + '---|' * len(models))
  for row in result['fits']:
    def show(b: dict | None) -> str:
      if b is None:
        return 'none'
      top = ' (ladder top: none larger tried)' if b['ladder_top'] else ''
      return f'{b["size"]} ({b["params_per_member"] / 1e6:.0f}M){top}'
    print(f'| {row["budget_gb"]:g} GB | '
          + ' | '.join(show(row['largest'][m]) for m in models) + ' |')
  for c in cells:
    if 'ran_steps' in c or 'run_error' in c:
      peak = c.get('device_peak')
      print(f'{c["size"]}: {c.get("ran_steps", 0)} steps run, ' + (
          f'allocator peak {peak / GB:.3f} GB (XLA\'s analysis {c["peak"] / GB:.3f})'
          if peak else c.get('run_error', 'no memory_stats on this device')))
  for c in result['memory'].get('opt_level_checks', []):
    print(f'-O0 vs -O2 ({c["size"]}, model={c["model"]}): same bytes {c["same_bytes"]}, '
          f'compile {c["fast_seconds"]:.1f} s vs {c["default_seconds"]:.1f} s')


def machine_info(device: str) -> dict[str, Any]:
  """harness.run_header's date, commit, load average and machine, with jax and the devices."""
  return dict(harness.run_header(), jax=metadata.version('jax'),
              jaxlib=metadata.version('jaxlib'),
              device=f'fake CPU devices (--xla_force_host_platform_device_count): '
              f'{MEMORY_DEVICES} for memory, {SPEED_DEVICES} for speed' if device == 'cpu'
              else 'the default backend\'s first device (see jax_devices)')


NOTES = dict(
    measured='XLA:CPU buffer assignment of the compiled train step '
    '(compiled.memory_analysis()), per device; no device memory exists on a CPU, nothing is '
    'allocated or run for the memory table',
    peak='argument + output - alias + temp bytes per device (alias: the donated state)',
    state='the layout\'s train-state bytes per device '
    '(placement.state_bytes_per_device): parameters, Adam\'s moments, the step counter',
    mesh='member=4 x data=1 x model: 4 * model devices, one member per member group',
    speed='fake CPU devices share the machine\'s cores: model=2 adds no compute, so the ratio '
    'is the cost of the collectives and the partitioned program on a CPU')


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--quick', action='store_true',
                      help='3 sizes (Ti, S, B), model 1 and 8, 5 speed rounds (~2 min)')
  parser.add_argument('--models', default='', help='comma-separated model axis sizes '
                      f'(default {",".join(map(str, MODEL_SIZES))}; each <= 8)')
  parser.add_argument('--sizes', default='', help='comma-separated ladder names (default: all '
                      'of ' + ', '.join(n for n, _, _ in LADDER) + ')')
  parser.add_argument('--budgets_gb', default='2,8', help='per-device budgets, GB (1e9 bytes)')
  parser.add_argument('--rules', default='fsdp', choices=('fsdp', 'vit'),
                      help="the per-leaf rule: FSDP (default) or models.vit.VIT_RULES")
  parser.add_argument('--check_opt', action='store_true',
                      help='also compile the first size at XLA\'s default -O2 and compare bytes')
  parser.add_argument('--speed_size', default='64,4,4,256', help='hidden,depth,heads,mlp_dim '
                      'of the speed comparison\'s ViT')
  parser.add_argument('--rounds', type=int, default=0, help='speed rounds (default 11, quick 5)')
  parser.add_argument('--min_time', type=float, default=0.0,
                      help='seconds per variant per round (default 1.0, quick 0.3)')
  parser.add_argument('--device', default='cpu', choices=('cpu', 'gpu'),
                      help='cpu: fake CPU devices; gpu: the machine\'s first device, the '
                      'model=1 column only (1 member on 1 device: model=1\'s per-device '
                      'program), compiled at default options; no speed comparison')
  parser.add_argument('--run_steps', type=int, default=0, help='with --device gpu: also run '
                      'this many steps of each cell and read the allocator\'s peak')
  parser.add_argument('--no_speed', dest='speed', action='store_false')
  parser.add_argument('--no_memory', dest='memory', action='store_false')
  parser.add_argument('--timeout', type=int, default=900, help='seconds per worker process')
  parser.add_argument('--out', default='')
  parser.add_argument('--_memory', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--_speed', action='store_true', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.models = tuple(int(m) for m in args.models.split(',') if m) or (
      QUICK_MODEL_SIZES if args.quick else MODEL_SIZES)
  args.budgets_gb = tuple(float(b) for b in args.budgets_gb.split(',') if b)
  names = [n for n in args.sizes.split(',') if n]
  args.ladder = (tuple(s for s in LADDER if s[0] in names) if names
                 else QUICK_LADDER if args.quick else LADDER)
  args.speed_size = tuple(int(v) for v in args.speed_size.split(','))
  if args.device == 'gpu':
    args.models, args.speed, args.check_opt = (1,), False, False
  args.rounds = args.rounds or (5 if args.quick else 11)
  args.min_time = args.min_time or (0.3 if args.quick else 1.0)
  args.out = args.out or str(ROOT / 'benchmarks' / 'results' /
                             ('model_axis_quick.json' if args.quick else 'model_axis.json'))
  return args


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args._memory or args._speed:
    import jax
    result = memory_worker(args) if args._memory else speed_worker(args)
    print(json.dumps(dict(result, jax_devices=f'{jax.device_count()} x '
                          f'{jax.devices()[0].device_kind}')))
    return
  start = time.perf_counter()
  passed = ['--models', ','.join(map(str, args.models)),
            '--sizes', ','.join(n for n, _, _ in args.ladder),
            '--budgets_gb', ','.join(map(str, args.budgets_gb)), '--rules', args.rules,
            '--speed_size', ','.join(map(str, args.speed_size)), '--rounds', str(args.rounds),
            '--min_time', str(args.min_time), '--device', args.device,
            '--run_steps', str(args.run_steps)] + (['--check_opt'] if args.check_opt else [])
  result = dict(machine_info(args.device), notes=NOTES, members=MEMBERS, batch=BATCH,
                input_shape=INPUT_SHAPE, patch=PATCH, config=str(CONFIG.relative_to(ROOT)),
                rules=args.rules,
                models=list(args.models), budgets_gb=list(args.budgets_gb),
                ladder=[list(s) for s in args.ladder])
  if args.memory:
    print(f'memory: {len(args.ladder)} sizes x model {args.models}, compiled abstractly on '
          f'{MEMORY_DEVICES} fake CPU devices', flush=True)
    result['memory'] = _subprocess(['--_memory', *passed],
                                   MEMORY_DEVICES if args.device == 'cpu' else 0, args.timeout)
    result['fits'] = fits(result['memory']['cells'], args.models, args.budgets_gb, args.ladder)
  if args.speed:
    sys.stdout.flush()
    print(f'speed: {", ".join(n for n, *_ in SPEED_MESHES)} on {SPEED_DEVICES} fake CPU '
          f'devices, {args.rounds} rounds', flush=True)
    result['speed'] = _subprocess(['--_speed', *passed], SPEED_DEVICES, args.timeout)
  result['seconds'] = time.perf_counter() - start
  result['load_average_end'] = harness.load_average()
  print_tables(result)
  print(f'\n{result["seconds"]:.0f} s in all')
  out = harness.write_results(args.out, result)
  print(f'wrote {out}')


if __name__ == '__main__':
  main(sys.argv[1:])
