"""ResNet-20 ensembles on this CPU: vmap, lax.map, a Python loop and PyTorch, by conv path.

  python -m benchmarks.resnet20            # M = 1, 4, 8 (45 min on a shared 2-core CPU)
  python -m benchmarks.resnet20 --quick    # M = 1, 4, 3 repeats, no plan cross-check
                                           # (still ~20 min: every variant compiles a ResNet)

The model is dist_ens's built-in CIFAR ResNet-20 (config.model.name='resnet',
depth=20: 272,474 parameters, BatchNorm with running statistics as model state) on
random 32x32x3 inputs with 10 classes, float32. All M members see ONE shared batch
of --batch examples (default 32 per member, so that M=8 stays tractable on 2
cores), and every member has its own Adam (lr 1e-3, no weight decay, as
benchmarks/throughput.py). One training step of all M members is timed as
  vmap xla       dist_ens's step (assemble.build_step), members vmapped, convolutions
                 lax.conv (config.model.conv_impl='xla'). vmap turns every member
                 convolution into ONE grouped convolution (feature_group_count=M) per
                 layer: this variant IS the hand-fused grouped convolution the issue
                 asks about (the script prints the evidence from the lowered and the
                 compiled program; see conv_lowering), so no separate one is built;
  vmap patches   the same with conv_impl='patches' (= 'auto'): im2col by strided
                 slices + one matmul per layer, which vmap makes a batched matmul;
  map xla        dist_ens's step with member_parallelism='map' (lax.map: members one
                 after another inside the compiled step; plain, ungrouped convolutions);
  map patches    the same with patches;
  loop xla       a Python loop over M separate states, each stepped by its own call of
                 one jitted per-member update (model.apply + optax; the usual baseline);
  loop patches   the same with patches;
  torch loop     PyTorch (CPU build, torch.set_num_threads(os.cpu_count())): M
                 separate nn.Module ResNet-20s of the same architecture (3x3 convs
                 without bias, BatchNorm, 1x1 conv + BatchNorm shortcuts where the
                 shape changes), each with its own torch.optim.Adam (foreach), one
                 after another on the same batch (NCHW, the layout torch's CPU convs
                 are built for);
  torch vmap     torch.func ensembling of the same modules: stack_module_state +
                 functional_call + torch.func.vmap (BatchNorm buffers stacked too, so
                 each member updates its own running statistics), one Adam over the
                 stacked parameters (exactly per-member Adam: Adam is elementwise);
  torch .../1t   the torch variants with 1 thread: on this shared 2-core machine 2
                 OpenMP threads ran a ResNet-20 step 3-10x slower than 1 (their
                 barriers spin while another job holds a core), so, as in
                 throughput.py, the peer also gets its better setting.
Every JAX variant runs on one device (jax.devices()[:1]).

Timing is throughput.time_side_by_side: a warm-up call (compile excluded), then
--repeats rotating rounds timing every variant once over at least --min_time
seconds; medians are reported. A variant whose step takes over --slow_seconds is
timed in the first 2 rounds only, and one whose step at the previous M, scaled by
the ratio of the M, would take over --max_step_seconds is not timed at this M (nor
its memory measured): lax.map of lax.conv took 11-30 s a step at M=1 and runs
the members one after another, so M=8 can cost minutes a step. The
matmul peak (2048^3 f32 in jnp.dot and in torch) is timed after each M the same
way, and its median over the run is the denominator of "% of peak".

FLOPs per member-example are counted analytically from the layer shapes as in
throughput.py (3x the forward FLOPs of the convolutions and the dense head;
'executed' drops the stem's input gradient) and cross-checked against
dist_ens.plan (XLA's cost analysis of the compiled step, M=1, per conv_impl).

Memory: every (variant, M) runs again in a fresh subprocess of this script
(--_memory_worker, bounded by --memory_timeout seconds), which records its RSS
after imports and data setup, builds the variant, runs --memory_steps steps, and
reports (peak RSS - that RSS) / M and (RSS after the steps - that RSS) / M. Both
hold a fixed part (runtime, loaded programs, allocator slack) that M divides, so
the tables also give the marginal bytes: the slope of the peak between the
smallest and largest M, what one more member adds. The workers take their
compiled programs from a persistent compilation cache that the timing run filled
(a temporary folder, removed at the end), so the peak is what training holds, not
what XLA's compiler took (hits and misses are counted in the JSON; a miss would
add a compile to the peak). The peak is /proc/self/status's VmHWM, reset to the
present RSS after the setup (writing 5 to /proc/self/clear_refs), not getrusage's
ru_maxrss: Linux carries ru_maxrss across fork and exec, so a worker started by a
1.6 GB parent reported 1.6 GB whatever it did (ru_maxrss is kept in the JSON).
The torch rows are measured with 1 thread (the thread count changes the speed,
not what is allocated). For JAX variants it also reports XLA's memory_analysis()
of the compiled step (argument + output + temp bytes, and the aliased (donated)
part): for vmap/map that is the whole step over M; for a loop it is one member's
update, per member already.

Prints the tables and writes benchmarks/results/resnet20.json (--quick:
resnet20_quick.json).
"""

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks import harness
from benchmarks import throughput as tp  # Timing, setup, peaks.

ROOT = Path(__file__).resolve().parents[1]
BATCH = 32
STEM, WIDTHS, BLOCKS = 16, (16, 32, 64), 3  # ResNet-20: depth 6 * 3 + 2.
SPEC = tp.ModelSpec('ResNet-20 (CIFAR, 32x32x3, 10 classes)', dict(name='resnet', depth=20),
                    (32, 32, 3))
JAX_VARIANTS = ('vmap xla', 'vmap patches', 'map xla', 'map patches', 'loop xla',
                'loop patches')
TORCH_VARIANTS = ('torch loop', 'torch loop/1t', 'torch vmap', 'torch vmap/1t')
MB = 2**20


def spec_for(conv_impl: str) -> tp.ModelSpec:
  return dataclasses.replace(SPEC, model={**SPEC.model, 'conv_impl': conv_impl})


# ---------------------------------------------------------------------------------------------
# FLOPs


def layer_flops() -> list[int]:
  """Forward FLOPs per example of every conv of ResNet-20 and its dense head."""
  flops, size, in_ch = [2 * 32 * 32 * 9 * 3 * STEM], 32, STEM
  for stage, width in enumerate(WIDTHS):
    for i in range(BLOCKS):
      stride = 2 if stage > 0 and i == 0 else 1
      size //= stride
      flops.append(2 * size * size * 9 * in_ch * width)  # conv1
      flops.append(2 * size * size * 9 * width * width)  # conv2
      if stride != 1 or in_ch != width:
        flops.append(2 * size * size * in_ch * width)  # 1x1 projection
      in_ch = width
  return flops + [2 * in_ch * tp.NUM_CLASSES]


def train_flops() -> tuple[int, int]:
  """(3x-forward convention, executed) training FLOPs per example."""
  per_layer = layer_flops()
  return 3 * sum(per_layer), 3 * sum(per_layer) - per_layer[0]


def plan_flops(conv_impl: str) -> float | None:
  """dist_ens.plan's flops_per_example (XLA cost analysis of the step) at M=1."""
  import jax
  from dist_ens import plan
  from dist_ens.config.loading import load_config
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members = 1
  config.data.name, config.data.batch_size = 'cifar10', tp.BATCH
  config.model.update(spec_for(conv_impl).model)
  config.optim.learning_rate, config.optim.weight_decay = tp.LEARNING_RATE, 0.0
  config.ensemble.member_parallelism = 'vmap'
  return plan.make_plan(config, jax.devices()[:1]).flops_per_example


# ---------------------------------------------------------------------------------------------
# JAX variants: each builder returns a Built (run one step of all members; lower the
# compiled program for XLA's memory analysis).


class Built(NamedTuple):
  run: Callable[[], Any]
  lower: Callable[[], Any] | None = None


def build_dist_ens(members: int, parallelism: str, conv_impl: str) -> Built:
  """dist_ens's step as training builds it, on a 1-device mesh (throughput.build_dist_ens)."""
  import jax
  from dist_ens.run import initial_state
  from dist_ens.parallel import mesh as mesh_lib
  spec = spec_for(conv_impl)
  _, parts = tp._jax_setup(spec, members)
  step = tp.make_step(parts, (parallelism, None))
  hparams = parts.device_hparams()
  x, y = (jax.device_put(a, mesh_lib.batch_sharding(parts.mesh)) for a in tp._batch(spec))
  holder = [initial_state.init_sharded(parts)]

  def run():
    holder[0], metrics = step(holder[0], hparams, x, y)
    return metrics.loss
  return Built(run, lambda: step.fn.lower(holder[0], hparams, x, y))


def build_loop(members: int, conv_impl: str) -> Built:
  """M separate states, each stepped by one jitted optax update (throughput.build_loop)."""
  run = tp.build_loop(spec_for(conv_impl), members)
  return Built(run, run.lower)


def conv_lowering(members: int, parallelism: str = 'vmap') -> dict[str, Any]:
  """What dist_ens's step with conv_impl='xla' turns the convolutions into.

  Counts the convolutions of the lowered StableHLO and of the compiled (optimised)
  HLO by (feature_group_count, batch_group_count), and lists those that touch the
  shared input batch (the stem's forward and kernel gradient) with their shapes.
  """
  import re
  lowered = build_dist_ens(members, parallelism, 'xla').lower()
  groups, shared_input = Counter(), []
  for line in lowered.as_text().splitlines():
    if 'stablehlo.convolution' not in line:
      continue
    fg = re.search(r'feature_group_count = (\d+)', line).group(1)
    bg = re.search(r'batch_group_count = (\d+)', line).group(1)
    groups[f'feature_group_count={fg}, batch_group_count={bg}'] += 1
    types = '(' + line.rsplit(': (', 1)[-1].strip()
    if f'tensor<{tp.BATCH}x32x32x3xf32>' in types.split('->')[0]:
      shared_input.append(f'{types} (feature_group_count={fg})')
  compiled = Counter()
  for line in lowered.compile().as_text().splitlines():
    if ' convolution(' in line:
      fg = re.search(r'feature_group_count=(\d+)', line)
      bg = re.search(r'batch_group_count=(\d+)', line)
      compiled[f'feature_group_count={fg.group(1) if fg else 1}, '
               f'batch_group_count={bg.group(1) if bg else 1}'] += 1
  return dict(members=members, parallelism=parallelism, lowered=dict(groups),
              compiled=dict(compiled), shared_input=shared_input)


# ---------------------------------------------------------------------------------------------
# PyTorch twins


def torch_resnet20() -> Any:
  """The same ResNet-20 as dist_ens's make_resnet, as an nn.Module (NCHW)."""
  from torch import nn

  class Block(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int):
      super().__init__()
      self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
      self.bn1 = nn.BatchNorm2d(out_ch)
      self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
      self.bn2 = nn.BatchNorm2d(out_ch)
      self.proj = nn.Identity()
      if stride != 1 or in_ch != out_ch:
        self.proj = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False),
                                  nn.BatchNorm2d(out_ch))

    def forward(self, x):
      h = self.bn2(self.conv2(nn.functional.relu(self.bn1(self.conv1(x)))))
      return nn.functional.relu(h + self.proj(x))

  layers: list[nn.Module] = [nn.Conv2d(3, STEM, 3, 1, 1, bias=False), nn.BatchNorm2d(STEM),
                             nn.ReLU()]
  in_ch = STEM
  for stage, width in enumerate(WIDTHS):
    for i in range(BLOCKS):
      layers.append(Block(in_ch, width, 2 if stage > 0 and i == 0 else 1))
      in_ch = width
  layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, tp.NUM_CLASSES)]
  return nn.Sequential(*layers)


def _torch_batch():
  import torch
  x, y = tp._batch(SPEC)
  return torch.from_numpy(x.transpose(0, 3, 1, 2).copy()), torch.from_numpy(y).long()


def build_torch_loop(members: int, threads: int) -> Built:
  """M nn.Modules, each with its own Adam, stepped one after another."""
  import torch
  torch.manual_seed(0)
  nets = [torch_resnet20().train() for _ in range(members)]
  opts = [torch.optim.Adam(net.parameters(), lr=tp.LEARNING_RATE, foreach=True) for net in nets]
  x, y = _torch_batch()

  def run():
    torch.set_num_threads(threads)
    loss = None
    for net, opt in zip(nets, opts):
      opt.zero_grad(set_to_none=True)
      loss = torch.nn.functional.cross_entropy(net(x), y)
      loss.backward()
      opt.step()
    return loss
  return Built(run)


def build_torch_vmap(members: int, threads: int) -> Built:
  """torch.func ensembling: stacked parameters and BatchNorm buffers, one Adam."""
  import copy
  import torch
  from torch.func import functional_call, stack_module_state
  torch.manual_seed(0)
  nets = [torch_resnet20().train() for _ in range(members)]
  params, buffers = stack_module_state(nets)
  base = copy.deepcopy(nets[0]).to('meta')
  forward = torch.func.vmap(lambda p, b, x: functional_call(base, (p, b), (x,)),
                            in_dims=(0, 0, None))
  opt = torch.optim.Adam(list(params.values()), lr=tp.LEARNING_RATE, foreach=True)
  x, y = _torch_batch()
  y_all = y.repeat(members)

  def run():
    torch.set_num_threads(threads)
    opt.zero_grad(set_to_none=True)
    logits = forward(params, buffers, x)  # [M, B, C]
    # Sum over members of each member's mean loss: member m's gradient is its own.
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, tp.NUM_CLASSES), y_all,
                                             reduction='sum') / tp.BATCH
    loss.backward()
    opt.step()
    return loss
  return Built(run)


def builders(members: int, with_torch: bool, threads: int) -> dict[str, Callable[[], Built]]:
  out: dict[str, Callable[[], Built]] = {}
  for name in JAX_VARIANTS:
    form, conv = name.split()
    if form == 'loop':
      out[name] = lambda conv=conv: build_loop(members, conv)
    else:
      out[name] = lambda form=form, conv=conv: build_dist_ens(members, form, conv)
  if with_torch:
    out['torch loop'] = lambda: build_torch_loop(members, threads)
    out['torch loop/1t'] = lambda: build_torch_loop(members, 1)
    out['torch vmap'] = lambda: build_torch_vmap(members, threads)
    out['torch vmap/1t'] = lambda: build_torch_vmap(members, 1)
  return out


# ---------------------------------------------------------------------------------------------
# Memory, in a fresh process per (variant, M)


def _status_bytes(field: str) -> int:
  """VmRSS (resident now) or VmHWM (peak resident) of this process, from /proc."""
  from dist_ens.plan import host_memory  # Imports jax: only once the flags are set.
  value = host_memory.status_bytes(field)
  if value is None:
    raise OSError('/proc/self/status is not there: memory is measured on Linux only')
  return value


def _reset_peak() -> bool:
  """Resets VmHWM to the present RSS (Linux >= 4.0); False where that is refused."""
  from dist_ens.plan import host_memory
  return host_memory.reset_peak()


def enable_cache(path: str) -> dict[str, int]:
  """JAX's persistent compilation cache in `path`, for every program; returns a live
  count of its hits and misses (empty where jax's monitoring hook is not there)."""
  import jax
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)
  counts: dict[str, int] = {}
  try:
    from jax._src import monitoring

    def listen(event: str, **_):
      if event.endswith(('cache_hits', 'cache_misses')):
        counts[event.rsplit('/', 1)[-1]] = counts.get(event.rsplit('/', 1)[-1], 0) + 1
    monitoring.register_event_listener(listen)
  except (ImportError, AttributeError):
    pass
  return counts


def memory_worker(name: str, members: int, steps: int, threads: int,
                  cache_dir: str) -> dict[str, Any]:
  """Runs in its own process: RSS growth of building and stepping one variant."""
  cache: dict[str, int] = {}
  if name.startswith('torch'):
    import torch
    torch.set_num_threads(threads)
  else:
    import jax
    import dist_ens.run.assemble  # noqa: F401  (imports before the baseline)
    if cache_dir:
      cache = enable_cache(cache_dir)
    jax.devices()
  tp._batch(SPEC)
  base = _status_bytes('VmRSS')
  reset = _reset_peak()
  built = builders(members, name.startswith('torch'), threads)[name]()
  for _ in range(steps):
    tp._block(built.run())
  peak, end = _status_bytes('VmHWM'), _status_bytes('VmRSS')
  out = dict(variant=name, members=members, steps=steps, base_rss=base, peak_rss=peak,
             end_rss=end, peak_reset=reset, peak_per_member=(peak - base) / members,
             end_per_member=(end - base) / members,
             ru_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
             compilation_cache=dict(cache))
  if built.lower is not None:  # After the RSS readings: compiling again costs memory.
    stats = built.lower().compile().memory_analysis()
    if stats is not None:
      out['xla'] = dict(argument=stats.argument_size_in_bytes,
                        output=stats.output_size_in_bytes, alias=stats.alias_size_in_bytes,
                        temp=stats.temp_size_in_bytes)
      out['xla']['total'] = sum(out['xla'][k] for k in ('argument', 'output', 'temp'))
      scope = 1 if name.startswith('loop') else members
      out['xla_per_member'] = out['xla']['total'] / scope
  return out


def measure_memory(name: str, members: int, args: argparse.Namespace) -> dict[str, Any]:
  """memory_worker in a subprocess, bounded by --memory_timeout. The child runs as
  `-m benchmarks.resnet20` from the repository root (cwd): that puts the root on its
  sys.path for `from benchmarks import ...`."""
  command = [sys.executable, '-m', 'benchmarks.resnet20', '--_memory_worker', name,
             '--members', str(members),
             '--batch', str(tp.BATCH), '--threads', str(args.threads),
             '--memory_steps', str(args.memory_steps), '--_cache_dir', args._cache_dir]
  start = time.perf_counter()
  try:
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                          timeout=args.memory_timeout, check=False)
  except subprocess.TimeoutExpired:
    return dict(variant=name, members=members, error=f'timed out ({args.memory_timeout} s)')
  lines = [l for l in done.stdout.splitlines() if l.startswith('{')]
  if done.returncode or not lines:
    return dict(variant=name, members=members, error=f'rc {done.returncode}: '
                + done.stderr.strip()[-500:])
  result = json.loads(lines[-1])
  result['seconds'] = time.perf_counter() - start
  return result


# ---------------------------------------------------------------------------------------------
# The run


def predicted_skips(members: int, previous: dict[str, Any] | None,
                    max_seconds: float) -> dict[str, float]:
  """Variants whose step at the previous M, scaled to this M, would exceed max_seconds."""
  if not previous:
    return {}
  scale = members / previous['members']
  predicted = {k: t * scale for k, t in previous['step_seconds'].items()}
  predicted.update({k: t * scale for k, t in previous.get('skipped', {}).items()})
  return {k: t for k, t in predicted.items() if t > max_seconds}


def time_members(members: int, args: argparse.Namespace, with_torch: bool,
                 peaks: dict[str, Callable[[], Any]], peak_times: dict[str, list[float]],
                 previous: dict[str, Any] | None = None) -> dict[str, Any]:
  """One M: every variant side by side (but predicted_skips), then the matmul peaks."""
  skipped = predicted_skips(members, previous, args.max_step_seconds)
  runs = {name: build().run for name, build in builders(members, with_torch,
                                                         args.threads).items()
          if name not in skipped}
  start = time.perf_counter()
  times, first = tp.time_side_by_side(runs, args.repeats, args.min_time)
  for name, t in tp.time_side_by_side(peaks, 3, 0.2)[0].items():
    peak_times[name] += t
  med = {name: statistics.median(t) for name, t in times.items()}
  cell = dict(members=members, step_seconds=med, step_seconds_all=times,
              first_call_seconds=first, skipped=skipped,
              member_examples_per_s={k: members * tp.BATCH / t for k, t in med.items()},
              seconds=time.perf_counter() - start)
  print(f'M={members}: ' + ', '.join(f'{k} {v:,.0f}' for k, v in
                                     cell['member_examples_per_s'].items())
        + ''.join(f', {k} skipped (~{t:.0f} s a step predicted)' for k, t in skipped.items())
        + f'  ({cell["seconds"]:.0f} s)', flush=True)
  return cell


def fastest(cell: dict[str, Any]) -> dict[str, Any]:
  """The fastest variant, conv path per JAX strategy, and strategy with its best conv."""
  rate = cell['member_examples_per_s']
  out: dict[str, Any] = dict(overall=max(rate, key=rate.get))
  conv = {}
  for form in ('vmap', 'map', 'loop'):
    if f'{form} xla' not in rate or f'{form} patches' not in rate:
      continue
    xla, patches = rate[f'{form} xla'], rate[f'{form} patches']
    conv[form] = dict(best='patches' if patches > xla else 'xla', patches_over_xla=patches / xla)
  out['conv'] = conv
  jax_rates = {k: v for k, v in rate.items() if not k.startswith('torch')}
  out['jax'] = max(jax_rates, key=jax_rates.get)
  torches = {k: v for k, v in rate.items() if k.startswith('torch')}
  if torches:
    out['torch'] = max(torches, key=torches.get)
    out['best_jax_over_best_torch'] = jax_rates[out['jax']] / torches[out['torch']]
  return out


def machine_info(args: argparse.Namespace, torch_version: str | None) -> dict[str, Any]:
  """jax, torch, the device and which dist_ens ran (run_and_write adds harness.run_header's
  date, commit, load averages and machine)."""
  import jax
  device = jax.devices()[0]
  return dict(jax=jax.__version__,
              torch=torch_version, torch_threads=args.threads if torch_version else None,
              device=f'1 {device.platform} device ({device.device_kind})',
              xla_flags=os.environ.get('XLA_FLAGS', ''),
              dist_ens_path=str(Path(sys.modules['dist_ens'].__file__).parent)
              if 'dist_ens' in sys.modules else None)


def add_rates(result: dict[str, Any]) -> None:
  """GFLOP/s and fraction of the matmul peak (torch against torch's own) of every cell."""
  flops = result['train_flops_per_example']
  peak = result['peak_flops']
  for cell in result['cells']:
    rate = cell['member_examples_per_s']
    cell['gflops'] = {k: v * flops / 1e9 for k, v in rate.items()}
    cell['fraction_of_peak'] = {
        k: v * flops / peak['torch' if k.startswith('torch') else 'jax'] for k, v in rate.items()}
    cell['fastest'] = fastest(cell)


def print_tables(result: dict[str, Any]) -> None:
  peak, cells = result['peak_flops'], result['cells']
  ms = [c['members'] for c in cells]
  print(f'\nmatmul peak ({result["peak_matmul_size"]}^3 f32, median): jax '
        f'{peak["jax"] / 1e9:.0f} GFLOP/s' + (f', torch {peak["torch"] / 1e9:.0f} GFLOP/s'
                                              if 'torch' in peak else ''))
  plan = ', '.join(f'conv {k} {v / 1e6:.1f} M' for k, v in
                   result['plan_flops_per_example'].items() if v) or 'not run'
  print(f'train FLOPs per member-example: {result["train_flops_per_example"] / 1e6:.1f} M '
        f'(3x forward; dist_ens.plan\'s XLA cost analysis at M=1: {plan})')
  print(f'\nmember-examples/s (% of matmul peak), batch {result["batch_per_member"]} per member, '
        'Adam, float32')
  print('| variant | ' + ' | '.join(f'M={m}' for m in ms) + ' | '
        + ' | '.join(f'peak RSS/member M={m}' for m in ms) + ' |')
  print('|---|' + '---:|' * (2 * len(ms)))
  for name in cells[0]['member_examples_per_s']:
    rates = [f'{c["member_examples_per_s"][name]:,.0f} ({100 * c["fraction_of_peak"][name]:.1f}%)'
             if name in c['member_examples_per_s'] else
             f'not timed (~{c["skipped"].get(name, math.nan):.0f} s/step)' for c in cells]
    mem = []
    for c in cells:
      m = result['memory'].get(f'{name.replace("/1t", "")}/1t@{c["members"]}'
                               if name.startswith('torch') else f'{name}@{c["members"]}', {})
      mem.append(f'{m["peak_per_member"] / MB:,.0f} MB' if 'peak_per_member' in m else '-')
    print(f'| {name} | ' + ' | '.join(rates) + ' | ' + ' | '.join(mem) + ' |')
  print_memory(result, ms)
  for c in cells:
    f = c['fastest']
    conv = ', '.join(f'{form}: {v["best"]} ({v["patches_over_xla"]:.2f}x patches/xla)'
                     for form, v in f['conv'].items())
    print(f'M={c["members"]}: fastest {f["overall"]}; best JAX {f["jax"]}; conv by strategy: '
          f'{conv}' + (f'; best torch {f["torch"]} (best JAX / best torch '
                        f'{f["best_jax_over_best_torch"]:.2f}x)' if 'torch' in f else ''))


def marginal_memory(memory: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
  """Bytes one more member adds, per variant: the slope of the peak (and end) RSS growth
  between the smallest and the largest M measured (the fixed part, the same at any M,
  drops out; cf. dist_ens.plan's bytes_per_member)."""
  by_name: dict[str, dict[int, dict[str, Any]]] = {}
  for r in memory.values():
    if 'error' not in r:
      by_name.setdefault(r['variant'], {})[r['members']] = r
  out = {}
  for name, rows in by_name.items():
    if len(rows) < 2:
      continue
    lo, hi = rows[min(rows)], rows[max(rows)]
    span = hi['members'] - lo['members']
    out[name] = dict(
        members=(lo['members'], hi['members']),
        peak=(hi['peak_rss'] - hi['base_rss'] - lo['peak_rss'] + lo['base_rss']) / span,
        end=(hi['end_rss'] - hi['base_rss'] - lo['end_rss'] + lo['base_rss']) / span)
  return out


def print_memory(result: dict[str, Any], ms: list[int]) -> None:
  print('\nmemory per member, MB: peak RSS growth / M | RSS growth after the steps / M | '
        'XLA arg+out+temp / M (loop: one member\'s update); last column: what one more '
        'member adds to the peak RSS (slope between the smallest and largest M)')
  print('| variant | ' + ' | '.join(f'M={m}' for m in ms) + ' | marginal |')
  print('|---|' + '---:|' * (len(ms) + 1))
  names = dict.fromkeys(k.split('@')[0] for k in result['memory'])
  marginal = result.get('memory_marginal_per_member', {})
  for name in names:
    row = []
    for m in ms:
      r = result['memory'].get(f'{name}@{m}', {})
      if 'error' in r or not r:
        row.append(r.get('error', '-')[:40])
        continue
      xla = f'{r["xla_per_member"] / MB:,.1f}' if 'xla_per_member' in r else '-'
      row.append(f'{r["peak_per_member"] / MB:,.0f} / {r["end_per_member"] / MB:,.0f} / {xla}')
    slope = marginal.get(name)
    row.append(f'{slope["peak"] / MB:,.0f} (M={slope["members"][0]}->{slope["members"][1]})'
               if slope else '-')
    print(f'| {name} | ' + ' | '.join(row) + ' |')
  print()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--quick', action='store_true', help='M = 1, 4; 3 repeats (smoke test)')
  parser.add_argument('--members', default='', help='comma-separated M (default 1,4,8)')
  parser.add_argument('--batch', type=int, default=BATCH, help='examples per member per step')
  parser.add_argument('--repeats', type=int, default=None, help='default 7, quick 3')
  parser.add_argument('--min_time', type=float, default=None,
                      help='seconds per measurement (default 0.5, quick 0.3)')
  parser.add_argument('--threads', type=int, default=os.cpu_count(),
                      help='torch intra-op threads (default: all cores, as XLA uses)')
  parser.add_argument('--no_torch', action='store_true')
  parser.add_argument('--no_memory', action='store_true', help='skip the memory subprocesses')
  parser.add_argument('--memory_steps', type=int, default=2)
  parser.add_argument('--slow_seconds', type=float, default=20.0,
                      help='a step slower than this is timed in the first 2 rounds only')
  parser.add_argument('--max_step_seconds', type=float, default=90.0,
                      help='skip a variant at M when its step, scaled from the previous M, '
                      'would take longer')
  parser.add_argument('--note', default='', help='free text stored in the JSON (e.g. the '
                      'dist_ens commit when run from an exported copy)')
  parser.add_argument('--memory_timeout', type=float, default=900.0)
  parser.add_argument('--out', default=None, help='default benchmarks/results/resnet20.json '
                      '(resnet20_quick.json with --quick)')
  parser.add_argument('--_memory_worker', default='', help=argparse.SUPPRESS)
  parser.add_argument('--_cache_dir', default='', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.members = tuple(int(m) for m in args.members.split(',') if m) or (
      (1, 4) if args.quick else (1, 4, 8))
  args.repeats = args.repeats or (3 if args.quick else 7)
  args.min_time = args.min_time or (0.3 if args.quick else 0.5)
  return args


def run_all(args: argparse.Namespace, torch_version: str | None) -> dict[str, Any]:
  """Lowering evidence, FLOPs, timing of every M, then memory of every (variant, M)."""
  lowering = conv_lowering(max(args.members))
  print(f'vmap of lax.conv at M={lowering["members"]}: lowered {lowering["lowered"]}; '
        f'compiled {lowering["compiled"]}; convolutions of the shared input: '
        + '; '.join(lowering['shared_input']), flush=True)
  lowering_map = conv_lowering(max(args.members), 'map')
  print(f'lax.map at M={lowering_map["members"]}: lowered {lowering_map["lowered"]}; '
        f'compiled {lowering_map["compiled"]}', flush=True)
  # --quick skips the cross-check: it compiles 4 ResNet steps (about 2 min on 2 cores).
  plan = {conv: None if args.quick else plan_flops(conv) for conv in ('xla', 'patches')}
  peaks = tp.build_peaks(bool(torch_version))
  peak_times: dict[str, list[float]] = {name: [] for name in peaks}
  cells: list[dict[str, Any]] = []
  for m in args.members:
    cells.append(time_members(m, args, bool(torch_version), peaks, peak_times,
                              cells[-1] if cells else None))
  n = tp.peak_size()
  result = dict(machine_info(args, torch_version), model=SPEC.title, batch_per_member=tp.BATCH,
                optimizer=f'Adam lr {tp.LEARNING_RATE}, no weight decay', dtype='float32',
                members=list(args.members), repeats=args.repeats, min_time=args.min_time,
                quick=args.quick, note=args.note, slow_seconds=args.slow_seconds,
                max_step_seconds=args.max_step_seconds, memory_steps=args.memory_steps,
                train_flops_per_example=train_flops()[0],
                executed_flops_per_example=train_flops()[1], plan_flops_per_example=plan,
                peak_matmul_size=n,
                peak_flops={k: 2 * n**3 / statistics.median(t) for k, t in peak_times.items()},
                peak_flops_all={k: [2 * n**3 / x for x in t] for k, t in peak_times.items()},
                conv_lowering=dict(vmap=lowering, map=lowering_map), cells=cells, memory={})
  add_rates(result)
  if not args.no_memory:
    for cell in cells:
      m = cell['members']
      for name in cell['member_examples_per_s']:
        if name in ('torch loop', 'torch vmap'):
          continue  # Measured with 1 thread (/1t): the same allocations.
        r = measure_memory(name, m, args)
        result['memory'][f'{name}@{m}'] = r
        print(f'memory {name} M={m}: ' + (r['error'] if 'error' in r else
              f'peak {r["peak_per_member"] / MB:,.0f} MB/member'), flush=True)
  result['memory_marginal_per_member'] = marginal_memory(result['memory'])
  return result


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  tp.BATCH = args.batch
  tp.SLOW_SECONDS, tp.SLOW_REPEATS = args.slow_seconds, 2  # (see the docstring)
  if args._memory_worker:
    print(json.dumps(memory_worker(args._memory_worker, args.members[0], args.memory_steps,
                                   args.threads, args._cache_dir)))
    return
  args._cache_dir = tempfile.mkdtemp(prefix='resnet20_xla_cache_')
  try:
    run_and_write(args)
  finally:
    shutil.rmtree(args._cache_dir, ignore_errors=True)


def run_and_write(args: argparse.Namespace) -> None:
  header = harness.run_header()
  enable_cache(args._cache_dir)
  torch_version = None if args.no_torch else tp.torch_available()
  if torch_version:
    import torch
    torch.set_num_threads(args.threads)
  import jax
  print(f'jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cores), torch '
        f'{torch_version or "not installed (torch rows skipped)"}'
        + (f' with {args.threads} threads' if torch_version else '')
        + f'; batch {args.batch} per member; M = {args.members}', flush=True)
  result = {**header, **run_all(args, torch_version), 'load_average_end': harness.load_average()}
  print_tables(result)
  out = harness.write_results(args.out or ROOT / 'benchmarks' / 'results' /
                              ('resnet20_quick.json' if args.quick else 'resnet20.json'), result)
  print(f'wrote {out}')


if __name__ == '__main__':
  main(sys.argv[1:])
