"""Mixed precision: the speed and accuracy effect of config.precision='bfloat16'.

  python -m benchmarks.precision            # speed + accuracy (~30 min on 2 CPU cores)
  python -m benchmarks.precision --quick    # speed only, fewer repeats (a smoke test)
  python -m benchmarks.precision --configs mnist1d_resnet --models resnet20

With precision='bfloat16' the model's forward and backward pass run in bf16 while
parameters, optimizer state, BatchNorm statistics, loss, metrics and checkpoints stay
float32 (dist_ens/core/model.py, with_precision). Measured here:

1. Speed. Member-examples/s of one training step of M members (--members, default 4),
   float32 and bfloat16 built as training builds them (assemble.build_parts,
   init_sharded, build_step with the form config.ensemble.member_parallelism='auto'
   resolves, one shared batch, Adam, on one device), timed side by side in ONE
   process with benchmarks/throughput.py's time_side_by_side: a warm-up call
   (compile, excluded and reported apart), then interleaved repeats in a rotating
   order, each over enough steps to last --min_time seconds; medians are reported,
   with bf16/f32 per model. Models: the MLP of configs/default.py (40-256-256-10),
   an MLP 784-512-512-10, the 1-D CNN of configs/mnist1d_cnn.py (batch 128 per
   member) and ResNet-20 on 32x32x3 inputs (batch 32 per member). Also a bare
   1024^3 jnp matmul in both dtypes, and how XLA compiled the bf16 one (whether
   the dot itself runs on bf16 operands or converts them to float32 first).
2. Accuracy (skipped by --quick). Each config (--configs; default mnist1d_resnet,
   default, mnist1d_cnn) is trained by dist_ens.train in both precisions, same seed, fresh
   /tmp workdirs, nothing else overridden: member-mean and ensemble test accuracy,
   NLL and ECE (as benchmarks/readme_results.py scores them), the last logged
   training loss, frozen (non-finite) members, and train_seconds (the loop's wall
   time, compile included, evaluation left out). The runs are sequential, so on a
   shared machine their times carry its load; the speed table is the fair ratio.

Prints Markdown tables and writes benchmarks/results/precision.json (harness.run_header's
date, commit, load averages and machine, jax's version, every number); --quick writes only
where --out says.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness, throughput
from benchmarks.throughput import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ('float32', 'bfloat16')
NUM_CLASSES = 10
LEARNING_RATE = 1e-3
MATMUL_N = 1024
# name -> (spec, batch per member).
SPEED_MODELS = {
    'mlp_small': (throughput.MODELS['mlp_small'], 128),
    'mlp_big': (throughput.MODELS['mlp_big'], 128),
    'cnn1d': (throughput.MODELS['cnn1d'], 128),
    'resnet20': (ModelSpec('ResNet-20 (CIFAR, 0.27M parameters) on 32x32x3',
                           dict(name='resnet', depth=20), (32, 32, 3)), 32),
}
ACCURACY_CONFIGS = ('mnist1d_resnet', 'default', 'mnist1d_cnn')


# ---------------------------------------------------------------------------------------------
# Speed


def build_step(spec: ModelSpec, members: int, batch: int, precision: str):
  """(run, form): one training step of all members in `precision`, as training builds it.

  The same setup as throughput._jax_setup (configs/default.py with the model, plain
  Adam) plus config.precision and this batch; the form is what 'auto' resolves.
  """
  import jax
  import numpy as np
  from dist_ens.run import mesh_layout
  from dist_ens.run import member_forms
  from dist_ens.run import assemble, initial_state
  from dist_ens.config.loading import load_config
  from dist_ens.parallel import mesh as mesh_lib
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members = members
  config.precision = precision
  config.data.batch_size = batch
  config.model.update(spec.model)
  config.optim.learning_rate = LEARNING_RATE
  config.optim.weight_decay = 0.0
  mesh = mesh_layout.build_mesh(config, jax.devices()[:1])
  parts = assemble.build_parts(config, mesh, spec.input_shape, NUM_CLASSES)
  form = member_forms.member_form(parts, batch)
  step = throughput.make_step(parts, form)
  state = initial_state.init_sharded(parts)
  hparams = parts.device_hparams()
  rng = np.random.default_rng(0)
  x = rng.standard_normal((batch, *spec.input_shape)).astype(np.float32)
  y = rng.integers(0, NUM_CLASSES, batch).astype(np.int32)
  x, y = (jax.device_put(a, mesh_lib.batch_sharding(mesh)) for a in (x, y))
  holder = [state, 0]

  def run():
    holder[0], metrics = step(holder[0], hparams, x, y)
    holder[1] += 1
    run.steps = holder[1]
    return metrics.loss
  return run, form


def _paired_ratios(times: dict[str, list[float]]) -> list[float]:
  """bf16/f32 speed of each repeat: f32 seconds / bf16 seconds of the same round."""
  return [f / b for f, b in zip(times['float32'], times['bfloat16'])]


def speed_cell(name: str, members: int, repeats: int, min_time: float) -> dict[str, Any]:
  """float32 and bfloat16 steps of one model, timed side by side."""
  import numpy as np
  spec, batch = SPEED_MODELS[name]
  runs, forms = {}, {}
  for precision in PRECISIONS:
    runs[precision], forms[precision] = build_step(spec, members, batch, precision)
  times, first = throughput.time_side_by_side(runs, repeats, min_time)
  med = {p: statistics.median(t) for p, t in times.items()}
  rate = {p: members * batch / t for p, t in med.items()}
  # The last loss of the same repeated batch (after a different number of steps per
  # precision, as each calibrates its own calls): finite or not.
  losses = {p: np.asarray(runs[p]()) for p in PRECISIONS}
  return dict(model=name, title=spec.title, members=members, batch_per_member=batch,
              form=list(forms['float32']), step_seconds=med, step_seconds_all=times,
              first_call_seconds=first, member_examples_per_s=rate,
              bf16_over_f32=rate['bfloat16'] / rate['float32'],
              bf16_over_f32_per_repeat=_paired_ratios(times),
              steps_run={p: runs[p].steps for p in PRECISIONS},
              loss_finite={p: bool(np.isfinite(v).all()) for p, v in losses.items()})


def matmul_cell(repeats: int, min_time: float) -> dict[str, Any]:
  """A bare MATMUL_N^3 matmul in both dtypes, and what XLA made of the bf16 one."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  host = np.random.default_rng(0).standard_normal((MATMUL_N, MATMUL_N)).astype(np.float32)
  dot = jax.jit(lambda u, v: u @ v)
  operands = {p: jnp.asarray(host, dtype=p) for p in PRECISIONS}
  runs = {p: (lambda a=a: dot(a, a)) for p, a in operands.items()}
  times, _ = throughput.time_side_by_side(runs, repeats, min_time)
  gflops = {p: 2 * MATMUL_N**3 / statistics.median(t) / 1e9 for p, t in times.items()}
  hlo = dot.lower(operands['bfloat16'], operands['bfloat16']).compile().as_text()
  lines = [line.strip() for line in hlo.splitlines()]
  dots = [line.split(' = ')[1].split('{')[0] for line in lines
          if ' dot(' in line and ' = ' in line]
  converts = sum(1 for line in lines if ' convert(' in line)
  return dict(n=MATMUL_N, gflops=gflops, bf16_over_f32=gflops['bfloat16'] / gflops['float32'],
              bf16_over_f32_per_repeat=_paired_ratios(times),
              compiled_bf16_dot_result_types=dots, compiled_bf16_converts=converts,
              bf16_dot_runs_in_f32=bool(dots) and all('bf16' not in d for d in dots))


# ---------------------------------------------------------------------------------------------
# Accuracy


def _last_train_loss(workdir: str) -> list[float] | None:
  """The members' training loss of the last 'train' event in metrics.jsonl."""
  loss = None
  with open(Path(workdir) / 'metrics.jsonl') as f:
    for line in f:
      event = json.loads(line)
      if event.get('split') == 'train' and 'loss' in event.get('members', {}):
        loss = event['members']['loss']
  return loss


def train_config(name: str, precision: str) -> dict[str, Any]:
  """Trains configs/<name>.py in `precision` into a fresh workdir; scored as
  benchmarks/readme_results.py scores its rows."""
  import math
  import dist_ens
  from benchmarks import readme_results
  config = dist_ens.load_config(readme_results.CONFIGS[name])
  config.precision = precision
  workdir = tempfile.mkdtemp(prefix=f'precision_{name}_{precision}_')
  start = time.perf_counter()
  final = dist_ens.train(config, workdir)
  wall = time.perf_counter() - start
  loss = _last_train_loss(workdir)
  row = dict(config=f'configs/{name}.py', precision=precision, workdir=workdir,
             num_members=config.num_members, model=config.model.name,
             steps=config.train.steps, train_seconds=final['train_seconds'],
             wall_seconds=wall, frozen_members=final['frozen_members'],
             last_train_loss=loss,
             all_finite=loss is not None and all(v is not None and math.isfinite(v)
                                                 for v in loss))
  for metric in readme_results.METRICS:
    member_mean = readme_results._member_mean  # pylint: disable=protected-access
    row[f'member_mean_{metric}'] = member_mean(final, metric)
    row[f'ensemble_{metric}'] = float(final['ensemble'][metric])
  print(f'{name} {precision}: ' + ', '.join(
      f'{k} {v:.4f}' for k, v in row.items() if k.startswith(('member_mean', 'ensemble')))
        + f', {row["train_seconds"]:.0f} s', flush=True)
  return row


# ---------------------------------------------------------------------------------------------
# Report


def _range(cell: dict[str, Any]) -> str:
  ratios = cell['bf16_over_f32_per_repeat']
  return f'{min(ratios):.2f}-{max(ratios):.2f}'


def speed_table(result: dict[str, Any]) -> str:
  lines = ['| model | batch / member | form | float32 | bfloat16 | bf16 / f32 (range over '
           'repeats) | compile f32 / bf16 |', '|---|---|---|---|---|---|---|']
  for c in result['speed']:
    rate, first = c['member_examples_per_s'], c['first_call_seconds']
    form = c['form'][0] + (f'/{c["form"][1]}' if c['form'][1] else '')
    lines.append(f'| {c["title"]} | {c["batch_per_member"]} | {form} | '
                 f'{rate["float32"]:,.0f} | {rate["bfloat16"]:,.0f} | '
                 f'{c["bf16_over_f32"]:.2f} ({_range(c)}) | {first["float32"]:.1f} s / '
                 f'{first["bfloat16"]:.1f} s |')
  m = result.get('matmul')
  if m:
    lines.append(f'| bare {m["n"]}^3 matmul (GFLOP/s) | - | - | {m["gflops"]["float32"]:.1f} | '
                 f'{m["gflops"]["bfloat16"]:.1f} | {m["bf16_over_f32"]:.2f} ({_range(m)}) | - |')
  return '\n'.join(lines)


def accuracy_table(rows: list[dict[str, Any]]) -> str:
  lines = ['| config | precision | accuracy: member mean / ensemble | NLL: member mean / '
           'ensemble | ECE: member mean / ensemble | last train loss (member mean) | '
           'frozen | training time |', '|---|---|---|---|---|---|---|---|']
  for r in rows:
    cells = [f'`{r["config"]}` ({r["model"]}, M={r["num_members"]}, {r["steps"]:,} steps)',
             r['precision']]
    for metric in ('accuracy', 'nll', 'ece'):
      cells.append(f'{r[f"member_mean_{metric}"]:.3f} / {r[f"ensemble_{metric}"]:.3f}')
    loss = r['last_train_loss']
    cells.append(f'{statistics.mean(loss):.4f}' if loss and r['all_finite'] else str(loss))
    cells.append(str(len(r['frozen_members'])))
    cells.append(f'{r["train_seconds"]:.0f} s')
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def machine_info() -> dict[str, Any]:
  """jax, its device and the CPU's SIMD extensions (bf16 speed depends on them), next to
  harness.run_header's date, commit, load averages and machine."""
  import jax
  flags = ''
  try:
    cpuinfo = Path('/proc/cpuinfo').read_text().splitlines()
    flags = next(l.split(':', 1)[1] for l in cpuinfo if l.startswith('flags'))
  except (OSError, StopIteration):
    pass
  device = jax.devices()[0]
  return dict(harness.run_header(), jax=jax.__version__,
              device=f'1 {device.platform} device ({device.device_kind})',
              simd=sorted({f for f in flags.split() if f.startswith(('avx', 'amx'))}),
              xla_flags=os.environ.get('XLA_FLAGS', ''))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--quick', action='store_true', help='speed only, fewer repeats')
  parser.add_argument('--members', type=int, default=4)
  parser.add_argument('--models', default=','.join(SPEED_MODELS),
                      help=f'comma-separated subset of {list(SPEED_MODELS)} ("" for none)')
  parser.add_argument('--configs', default=','.join(ACCURACY_CONFIGS),
                      help='configs/<name>.py to train in both precisions ("" for none)')
  parser.add_argument('--repeats', type=int, default=None, help='default 11, quick 3')
  parser.add_argument('--min_time', type=float, default=None,
                      help='seconds per measurement (default 0.3, quick 0.15)')
  parser.add_argument('--out', default=None,
                      help='default benchmarks/results/precision.json (--quick: no file)')
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  repeats = args.repeats or (3 if args.quick else 11)
  min_time = args.min_time or (0.15 if args.quick else 0.3)
  # Every repeat for every step, even a slow one (throughput.py skips steps over 1 s
  # after 3 rounds, which would leave bf16 and f32 with different repeat counts).
  throughput.SLOW_SECONDS = float('inf')
  result = dict(machine_info(), members=args.members, repeats=repeats, min_time=min_time,
                quick=args.quick, speed=[], accuracy=[])
  print(f'jax {result["jax"]} on {result["device"]}, {result["machine"]["cpu"]}, '
        f'{result["machine"]["cores"]} cores, '
        f'SIMD {" ".join(result["simd"])}', flush=True)
  result['matmul'] = matmul_cell(repeats, min_time)
  for name in filter(None, args.models.split(',')):
    cell = speed_cell(name, args.members, repeats, min_time)
    result['speed'].append(cell)
    print(f'{name}: f32 {cell["member_examples_per_s"]["float32"]:,.0f}, bf16 '
          f'{cell["member_examples_per_s"]["bfloat16"]:,.0f} member-examples/s '
          f'(bf16/f32 {cell["bf16_over_f32"]:.2f})', flush=True)
  if not args.quick:
    for name in filter(None, args.configs.split(',')):
      for precision in PRECISIONS:
        result['accuracy'].append(train_config(name, precision))
  result['speed_markdown'] = speed_table(result)
  result['accuracy_markdown'] = accuracy_table(result['accuracy'])
  print('\n' + result['speed_markdown'])
  m = result['matmul']
  print(f'\nbf16 matmul compiled as: dot -> {m["compiled_bf16_dot_result_types"]}, '
        f'{m["compiled_bf16_converts"]} converts (dot in f32: {m["bf16_dot_runs_in_f32"]})')
  if result['accuracy']:
    print('\n' + result['accuracy_markdown'])
  out = args.out or (None if args.quick else ROOT / 'benchmarks' / 'results' / 'precision.json')
  if out:
    harness.write_results(out, {**result, 'load_average_end': harness.load_average()})
    print(f'wrote {out}')


if __name__ == '__main__':
  main(sys.argv[1:])
