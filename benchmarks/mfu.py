"""MFU of real-sized members: dist_ens whole runs against torch.func + torch.compile ensembles.

  python -m benchmarks.mfu --tiny                 # CPU smoke test: small nets, 2 members
  python -m benchmarks.mfu                        # the GPU list below, within --budget_s
  python -m benchmarks.mfu --cells jax:wrn:4,torch:wrn:4 --budget_s 300
  python -m benchmarks.mfu --cells jax:vit:4,jax:vit:4:cpuinit --init_timeout_s 60
  python -m benchmarks.mfu --cells jax:resnet18:64,jax:resnet18:64:map32

Issue 65, item 4. On CIFAR-shaped synthetic data (32x32x3 float32 images, 10 classes,
drawn once; every member its own batch of --batch examples a step, 'shuffled') in
bfloat16, each cell times one ensemble of M members of one network:
  jax     a whole dist_ens.train (config.precision='bfloat16', data.resident=True: the
          split on the device, each step's batches gathered there; SGD with Nesterov
          momentum; member_parallelism 'vmap'; writers jsonl only), timed as
          benchmarks/overhead.py times runs: from the first call at or past step --warmup
          to the last step (compile, the first steps, the final evaluation and checkpoint
          left out). The run's wall time, those included, is recorded beside it.
  torch   the same network written here in torch (no torchvision), M copies stacked by
          torch.func.stack_module_state, run by torch.func.functional_call under
          torch.func.vmap, the loss function torch.compile'd, bfloat16 autocast, BatchNorm
          without running statistics (torch.func.replace_all_batch_norm_modules_: vmap
          cannot update them in place), torch.optim.SGD (Nesterov momentum, fused where
          the device has it); the split resident on the device, each member's batch
          gathered by random indices each step. Steady state: --torch_warmup untimed steps
          (the compile), then --torch_blocks blocks of (steps - warmup) steps, each
          synchronised.
  peak    a bf16 matmul of --matmul_n^3 on random data through JAX: the chip's measured
          matrix rate, beside the datasheet peak.
Both report member-examples/s (M x batch x timed steps / seconds) and the step's time.
FLOPs: XLA's cost analysis (HloCostAnalysis) of dist_ens's one-step train program for the
same network, M and batch, as lowered (before XLA's optimisation: the FLOPs the program
asks for, rematerialisation not counted); per member-example = flops / (M x batch).
MFU = flops per step / step time / peak, peak = --peak_tflops or the device's datasheet
dense bf16 rate (H100/H200 SXM: 989 TFLOP/s); torch's MFU uses the JAX cell's FLOPs per
member-example for the same network (the same arithmetic, counted once).
Networks (dist_ens.models): wrn = WRN-28-10 ('wide_resnet', 36.5M parameters);
resnet18 = the CIFAR ResNet-18 (11.2M); vit = ViT-S's widths (384 wide, 12 blocks of 6
heads, MLP 1536, mean pooling) over 4x4 patches of the 32x32 input, 64 tokens (ViT-S/16's
16x16 patches would leave 4 tokens of a 32x32 image). --tiny: WRN-10-1, ResNet-18 on 8x8
inputs, a 2-block ViT 32 wide; 2 members, batch 8, a few steps (figures meaningless).

A JAX cell's init program (the members' initialisation) is compiled under a watch: its
compile time is recorded (init_compile_s), and with --init_timeout_s the cell ends if it
has not compiled by then. A cell named jax:NET:M:VARIANT is jax:NET:M's fallback, run only where
jax:NET:M measured nothing before it: VARIANT 'cpuinit' compiles and runs the init
program on the CPU and puts its state on the device (the timed steps are the same
program); 'mapN' runs the members as member_parallelism='map' over chunks of N vmapped
members (map_batch_size=N), for an M whose vmapped step does not fit the device.

Each cell runs in a process of its own (JAX preallocates most of the GPU; a cell that runs
out of memory or time fails alone), in the order given (the most important first), and
--out is rewritten after every cell, so a run stopped by its time limit keeps what it
measured. A cell is not started with less than --min_cell_s of --budget_s left.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]

# The most important cells first: a stage cut short by its time limit keeps these.
# torch.compile's first step (its compile) may take minutes: the JAX cell of every
# network comes before most torch cells.
DEFAULT_CELLS = ('jax:wrn:4,peak,torch:wrn:4,jax:wrn:8,jax:vit:4,jax:resnet18:8,torch:vit:4,'
                 'torch:resnet18:8,torch:wrn:8,jax:resnet18:32,torch:resnet18:32,'
                 'jax:resnet18:64,torch:resnet18:64,jax:resnet18:16,torch:resnet18:16')
TINY_CELLS = 'jax:wrn:2,torch:wrn:2,peak,jax:resnet18:2,torch:resnet18:2,jax:vit:2,torch:vit:2'
# Datasheet dense bf16 matrix rates (no sparsity), TFLOP/s, by a substring of device_kind.
DATASHEET_BF16_TFLOPS = {'H100': 989.4, 'H200': 989.4, 'A100': 312.0}
CLASSES = 10


def net_fields(net: str, tiny: bool) -> dict[str, Any]:
  """config.model fields of each network (full size, or --tiny's)."""
  if net == 'wrn':
    return {'model.name': 'wide_resnet', 'model.depth': 10 if tiny else 28,
            'model.widen_factor': 1 if tiny else 10}
  if net == 'resnet18':
    return {'model.name': 'resnet18'}
  if net == 'vit':
    size = dict(hidden=32, depth=2, heads=2, mlp_dim=64) if tiny else dict(
        hidden=384, depth=12, heads=6, mlp_dim=1536)
    return {'model.name': 'vit', 'model.patch_size': 4, 'model.pool': 'mean',
            **{f'model.{k}': v for k, v in size.items()}}
  raise SystemExit(f'unknown network {net!r}: wrn, resnet18 or vit')


def shape(args: Any) -> tuple[int, int, int]:
  """(image side, batch per member, training examples)."""
  return (8, 8, 256) if args.tiny else (32, args.batch, args.examples)


def synthetic(args: Any, seed: int = 0):
  """CIFAR-shaped float32 images in [0, 1) and labels: (x_train, y_train, x_test, y_test)."""
  import numpy as np
  side, _, n = shape(args)
  rng = np.random.default_rng(seed)
  x = rng.random((n + args.test_examples, side, side, 3), dtype=np.float32)
  y = rng.integers(0, CLASSES, n + args.test_examples).astype(np.int32)
  return x[:n], y[:n], x[n:], y[n:]


# ---------------------------------------------------------------------------------- JAX


def jax_config(net: str, members: int, args: Any, variant: str = ''):
  """The cell's config; variant 'mapN': member_parallelism 'map' over chunks of N members
  (vmapped) instead of 'vmap'."""
  from dist_ens.config.loading import load_config
  _, batch, _ = shape(args)
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members = members
  overrides = {
      'precision': 'bfloat16', 'data.resident': True, 'data.member_order': 'shuffled',
      'data.batch_size': batch, 'data.augment': 'none', 'data.prefetch': 2,
      'ensemble.member_parallelism': 'vmap', 'model.dropout': 0.0,
      'model.conv_impl': args.conv_impl,
      'optim.name': 'sgd', 'optim.momentum': 0.9, 'optim.nesterov': True,
      'optim.learning_rate': 1e-3, 'optim.weight_decay': 5e-4,
      'train.steps': args.steps, 'train.log_every': args.log_every, 'train.eval_every': 0,
      'checkpoint.every': args.steps, 'writers': ('jsonl',), 'eval.batch_size':
      args.test_examples, **net_fields(net, args.tiny)}
  if variant.startswith('map'):
    overrides.update({'ensemble.member_parallelism': 'map',
                      'ensemble.map_batch_size': int(variant[3:] or 0)})
  config.update_from_flattened_dict(overrides)
  return config


def step_flops(config: Any, dataset: Any) -> dict[str, Any]:
  """XLA's cost analysis of dist_ens's one-step train program for this config (per-member
  batches, 'vmap'), lowered for the CPU backend (XLA:GPU gives none for a lowered program,
  and its count of a compiled one leaves out most of the GEMMs it hands to cuBLAS: 1.1
  GFLOP per member-example of ResNet-18 on an H200, the forward pass's share); with
  --compiled_flops also compiled for the run's device, for that comparison."""
  import jax
  out = {'flops_lowered': _flops(_lowered_step(config, dataset, jax.devices('cpu')[:1])
                                 .cost_analysis())}
  if ARGS is not None and ARGS.compiled_flops:
    start = time.perf_counter()
    lowered = _lowered_step(config, dataset, jax.devices()[:1])
    out['flops_compiled_on_device'] = _flops(lowered.compile().cost_analysis())
    out['compile_for_flops_s'] = round(time.perf_counter() - start, 1)
  return out


def _lowered_step(config: Any, dataset: Any, devices: list) -> Any:
  from dist_ens.plan import dry_run
  from dist_ens.run import assemble, mesh_layout
  mesh = mesh_layout.build_mesh(config, devices)
  parts = assemble.build_parts(config, mesh, dataset.input_shape, dataset.num_classes)
  step = assemble.build_step(parts, per_member_batches=True, form=('vmap', None))
  args = dry_run.step_arguments(parts, dry_run.StepBatch(config.data.batch_size, True),
                                step.uses_index)
  return step.fn.lower(*args)


def _flops(cost: Any) -> float | None:
  if isinstance(cost, (list, tuple)):  # older jax: one dict per program
    cost = cost[0] if cost else None
  flops = (cost or {}).get('flops')
  return float(flops) if flops and flops > 0 else None


def _watch_init_compile(init: dict[str, Any], on_cpu: bool, limit_s: float) -> None:
  """Wraps initial_state.compile_init (the run's init program) in this process: its compile
  timed (init['compile_s'], and a line on stderr before and after, which a cell's error
  keeps), the process ended (exit 3) if it has not compiled in `limit_s` seconds (0: no
  limit), so that a fallback cell can run; with `on_cpu`, the program compiled and run
  on the CPU backend and its state put on the run's devices with the run's shardings."""
  import threading
  import jax
  from dist_ens.run import initial_state
  original = initial_state.compile_init

  def on_the_cpu(parts, *pretrained):
    cpu = jax.devices('cpu')[0]
    with jax.default_device(cpu):
      compiled = jax.jit(parts.init).lower(*pretrained).compile()

    def run(*a):
      with jax.default_device(cpu):
        state = compiled(*a)
      return jax.device_put(state, parts.state_shardings)
    return run

  def timed(parts, *pretrained):
    where = 'the CPU' if on_cpu else parts.mesh.devices.flat[0].platform
    print(f'compiling the init program for {where}', file=sys.stderr, flush=True)
    start = time.perf_counter()
    guard = None
    if limit_s:
      def give_up():
        print(f'the init program had not compiled after {limit_s:g} s: giving up',
              file=sys.stderr, flush=True)
        os._exit(3)
      guard = threading.Timer(limit_s, give_up)
      guard.daemon = True
      guard.start()
    try:
      compiled = (on_the_cpu if on_cpu else original)(parts, *pretrained)
    finally:
      if guard is not None:
        guard.cancel()
    init['compile_s'] = round(time.perf_counter() - start, 2)
    init['on'] = where
    print(f'init program compiled in {init["compile_s"]} s', file=sys.stderr, flush=True)
    return compiled

  initial_state.compile_init = timed


def jax_cell(net: str, members: int, args: Any, variant: str = '') -> dict[str, Any]:
  import shutil
  import jax
  from absl import logging
  import dist_ens
  from benchmarks import overhead
  from dist_ens import data
  logging.set_verbosity(logging.WARNING)
  config = jax_config(net, members, args, variant)
  dataset = data.from_arrays(*synthetic(args), name='cifar_shaped_synthetic',
                             num_classes=CLASSES)
  timer = overhead.Timer(args.warmup)
  init: dict[str, Any] = {}
  _watch_init_compile(init, on_cpu=variant == 'cpuinit',
                      limit_s=0 if variant == 'cpuinit' else args.init_timeout_s)
  workdir = tempfile.mkdtemp(prefix='dist_ens_mfu_')
  start = time.perf_counter()
  try:
    dist_ens.train(config, workdir, devices=jax.devices()[:1], actions=[timer],
                           dataset=dataset)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  wall = time.perf_counter() - start
  steps = config.train.steps - timer.first
  seconds = timer.end - timer.start
  batch = config.data.batch_size
  flops = step_flops(config, dataset)
  return dict(timed_steps=steps, seconds=seconds, step_s=seconds / steps,
              rate=members * batch * steps / seconds, run_wall_s=round(wall, 1),
              steps_per_call=timer.steps_per_call, init_compile_s=init.get('compile_s'),
              init_on=init.get('on'), **flops,
              flops_per_member_example=(flops['flops_lowered'] / (members * batch)
                                        if flops['flops_lowered'] else None),
              member_parallelism=config.ensemble.member_parallelism,
              map_batch_size=config.ensemble.map_batch_size, model=config.model.to_dict())


def peak_cell(args: Any) -> dict[str, Any]:
  """A bf16 matmul n x n x n on random data, JAX, 3 warm-ups then --matmul_reps timed."""
  import jax
  import jax.numpy as jnp
  n = 256 if args.tiny else args.matmul_n
  ka, kb = jax.random.split(jax.random.key(1))
  a = jax.random.normal(ka, (n, n), jnp.bfloat16)
  b = jax.random.normal(kb, (n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  for _ in range(3):
    jax.block_until_ready(f(a, b))
  times = []
  for _ in range(args.matmul_reps):
    start = time.perf_counter()
    jax.block_until_ready(f(a, b))
    times.append(time.perf_counter() - start)
  times.sort()
  median = times[len(times) // 2]
  return dict(n=n, reps=args.matmul_reps, median_s=median,
              tflops_median=2 * n**3 / median / 1e12, tflops_best=2 * n**3 / times[0] / 1e12)


# -------------------------------------------------------------------------------- torch


def torch_nets():
  """The three networks in torch, shaped as dist_ens.models builds them (NCHW inputs)."""
  import torch
  from torch import nn
  import torch.nn.functional as F

  class WideBlock(nn.Module):
    """Pre-activation: BN-ReLU-conv-BN-ReLU-conv (+ shortcut; a projection of the
    normalised input where the shape changes), as dist_ens.models.resnet."""

    def __init__(self, cin, cout, stride):
      super().__init__()
      self.bn1, self.bn2 = nn.BatchNorm2d(cin), nn.BatchNorm2d(cout)
      self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
      self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
      self.proj = (nn.Conv2d(cin, cout, 1, stride, bias=False)
                   if stride != 1 or cin != cout else None)

    def forward(self, x):
      a = F.relu(self.bn1(x))
      shortcut = self.proj(a) if self.proj is not None else x
      return self.conv2(F.relu(self.bn2(self.conv1(a)))) + shortcut

  class WRN(nn.Module):

    def __init__(self, depth, k):
      super().__init__()
      n = (depth - 4) // 6
      self.stem = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
      blocks, cin = [], 16
      for stage, width in enumerate((16 * k, 32 * k, 64 * k)):
        for i in range(n):
          blocks.append(WideBlock(cin, width, 2 if stage and not i else 1))
          cin = width
      self.blocks = nn.Sequential(*blocks)
      self.bn = nn.BatchNorm2d(cin)
      self.head = nn.Linear(cin, CLASSES)

    def forward(self, x):
      h = F.relu(self.bn(self.blocks(self.stem(x))))
      return self.head(h.mean((2, 3)))

  class BasicBlock(nn.Module):
    """Post-activation: conv-BN-ReLU-conv-BN (+ shortcut, 1x1 conv + BN where the shape
    changes), ReLU."""

    def __init__(self, cin, cout, stride):
      super().__init__()
      self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
      self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
      self.bn1, self.bn2 = nn.BatchNorm2d(cout), nn.BatchNorm2d(cout)
      self.proj = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                 nn.BatchNorm2d(cout))
                   if stride != 1 or cin != cout else None)

    def forward(self, x):
      h = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
      return F.relu(h + (self.proj(x) if self.proj is not None else x))

  class ResNet18(nn.Module):

    def __init__(self):
      super().__init__()
      self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                                nn.ReLU())
      blocks, cin = [], 64
      for stage, width in enumerate((64, 128, 256, 512)):
        for i in range(2):
          blocks.append(BasicBlock(cin, width, 2 if stage and not i else 1))
          cin = width
      self.blocks = nn.Sequential(*blocks)
      self.head = nn.Linear(512, CLASSES)

    def forward(self, x):
      return self.head(self.blocks(self.stem(x)).mean((2, 3)))

  class Block(nn.Module):
    """Pre-norm encoder block, attention written out (softmax in float32) as
    dist_ens.models.transformer, GELU (tanh) MLP."""

    def __init__(self, hidden, heads, mlp_dim):
      super().__init__()
      self.heads = heads
      self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
      self.q, self.k, self.v, self.out = (nn.Linear(hidden, hidden) for _ in range(4))
      self.fc1, self.fc2 = nn.Linear(hidden, mlp_dim), nn.Linear(mlp_dim, hidden)

    def forward(self, x):
      b, t, d = x.shape
      h = self.ln1(x)
      split = lambda lin: lin(h).reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
      q, k, v = split(self.q), split(self.k), split(self.v)
      logits = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
      weights = torch.softmax(logits.float(), -1).to(v.dtype)
      x = x + self.out((weights @ v).transpose(1, 2).reshape(b, t, d))
      return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate='tanh'))

  class ViT(nn.Module):

    def __init__(self, side, patch, hidden, depth, heads, mlp_dim):
      super().__init__()
      self.patch = patch
      tokens = (side // patch)**2
      self.embed = nn.Linear(patch * patch * 3, hidden)
      self.pos = nn.Parameter(0.02 * torch.randn(tokens, hidden))
      self.blocks = nn.Sequential(*(Block(hidden, heads, mlp_dim) for _ in range(depth)))
      self.norm = nn.LayerNorm(hidden)
      self.head = nn.Linear(hidden, CLASSES)

    def forward(self, x):  # [B, C, H, W] -> patches [B, tokens, p*p*C]
      b, c, hgt, wid = x.shape
      p = self.patch
      x = x.reshape(b, c, hgt // p, p, wid // p, p).permute(0, 2, 4, 3, 5, 1)
      h = self.embed(x.reshape(b, (hgt // p) * (wid // p), p * p * c)) + self.pos
      return self.head(self.norm(self.blocks(h)).mean(1))

  return WRN, ResNet18, ViT


def torch_model(net: str, args: Any, classes: tuple):
  WRN, ResNet18, ViT = classes
  side = shape(args)[0]
  if net == 'wrn':
    f = net_fields(net, args.tiny)
    return WRN(f['model.depth'], f['model.widen_factor'])
  if net == 'resnet18':
    return ResNet18()
  f = {k.split('.')[1]: v for k, v in net_fields(net, args.tiny).items()}
  return ViT(side, f['patch_size'], f['hidden'], f['depth'], f['heads'], f['mlp_dim'])


def torch_cell(net: str, members: int, args: Any) -> dict[str, Any]:
  try:
    import torch
  except ImportError:
    return dict(skipped='torch is not installed in this environment')
  import copy
  import torch.nn.functional as F
  from torch import func
  cuda = torch.cuda.is_available()
  device = torch.device('cuda' if cuda else 'cpu')
  torch.manual_seed(0)
  classes = torch_nets()  # once: stack_module_state wants one class for every member
  nets = [torch_model(net, args, classes) for _ in range(members)]
  for m in nets:
    func.replace_all_batch_norm_modules_(m)
  params, buffers = func.stack_module_state(nets)
  params = {k: v.detach().to(device).requires_grad_() for k, v in params.items()}
  buffers = {k: v.to(device) for k, v in buffers.items()}
  base = copy.deepcopy(nets[0]).to('meta')
  x_train, y_train, _, _ = synthetic(args)
  x_all = torch.from_numpy(x_train).permute(0, 3, 1, 2).contiguous().to(device)  # NCHW
  y_all = torch.from_numpy(y_train).long().to(device)
  _, batch, n = shape(args)

  def one(p, b, x):
    return func.functional_call(base, (p, b), (x,))

  def loss_fn(p, b, x, y):
    logits = func.vmap(one)(p, b, x)  # [M, B, classes]
    # The members' mean losses summed: each member's gradient is its own.
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction='sum') / batch

  compiled = torch.compile(loss_fn)
  fused = cuda and 'fused' in torch.optim.SGD.__init__.__code__.co_varnames
  opt = torch.optim.SGD(list(params.values()), lr=1e-3, momentum=0.9, nesterov=True,
                        weight_decay=5e-4, **({'fused': True} if fused else {'foreach': True}))
  autocast = torch.autocast(device.type, dtype=torch.bfloat16)

  def step():
    idx = torch.randint(0, n, (members, batch), device=device)  # each member its batch
    with autocast:
      loss = compiled(params, buffers, x_all[idx], y_all[idx])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

  sync = torch.cuda.synchronize if cuda else (lambda: None)
  start = time.perf_counter()
  for _ in range(args.torch_warmup):
    loss = step()
  sync()
  warm_s = time.perf_counter() - start
  steps = args.steps - args.warmup
  blocks = []
  for _ in range(args.torch_blocks):
    start = time.perf_counter()
    for _ in range(steps):
      loss = step()
    sync()
    blocks.append(time.perf_counter() - start)
  seconds = sorted(blocks)[len(blocks) // 2]
  return dict(timed_steps=steps, seconds=seconds, block_seconds=blocks,
              step_s=seconds / steps, rate=members * batch * steps / seconds,
              warmup_steps=args.torch_warmup, warmup_s=round(warm_s, 1),
              last_loss=float(loss.detach()) / members, torch=torch.__version__,
              optimizer='SGD fused' if fused else 'SGD foreach',
              parameters_per_member=sum(v[0].numel() for v in params.values()))


# ------------------------------------------------------------------------------- driver


def device_info() -> dict[str, Any]:
  import jax
  d = jax.devices()[0]
  return {'platform': d.platform, 'device_kind': d.device_kind, 'jax': jax.__version__}


def peak_tflops(args: Any, kind: str) -> float | None:
  if args.peak_tflops:
    return args.peak_tflops
  return next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in kind), None)


def child(args: Any) -> None:
  """Runs one cell (--cell) and writes its result to --result."""
  kind, *rest = args.cell.split(':')
  start = time.perf_counter()
  if kind == 'peak':
    result = peak_cell(args)
  else:
    net, members = rest[0], int(rest[1])
    if kind == 'jax':
      result = jax_cell(net, members, args, variant=rest[2] if len(rest) > 2 else '')
    else:
      result = torch_cell(net, members, args)
  result['process_s'] = round(time.perf_counter() - start, 1)
  Path(args.result).write_text(json.dumps(result))


def summarise(cells: list[dict], peak: float | None, measured: float | None) -> None:
  """MFU of every cell; torch's from the JAX cell's FLOPs per member-example."""
  per_example = {c['net']: c['flops_per_member_example'] for c in cells
                 if c.get('framework') == 'jax' and c.get('flops_per_member_example')}
  for c in cells:
    if 'rate' not in c or c['framework'] == 'peak':
      continue
    fpe = c.get('flops_per_member_example') or per_example.get(c['net'])
    c['tflops'] = fpe * c['rate'] / 1e12 if fpe else None
    c['mfu'] = c['tflops'] / peak if c['tflops'] and peak else None
    c['of_measured_matmul'] = c['tflops'] / measured if c['tflops'] and measured else None


def print_table(cells: list[dict], peak: float | None) -> None:
  print(f'\n{"cell":22s} {"member-ex/s":>12s} {"step ms":>9s} {"GFLOP/m-ex":>11s} '
        f'{"TFLOP/s":>8s} {"MFU":>6s}  note')
  for c in cells:
    name = c['cell']
    if c.get('framework') == 'peak' and 'tflops_median' in c:
      print(f'{name:22s} {"":12s} {"":9s} {"":11s} {c["tflops_median"]:8.1f} '
            f'{c["tflops_median"] / peak if peak else float("nan"):6.1%}  bf16 matmul '
            f'{c["n"]}^3')
    elif 'rate' in c:
      fpe = c.get('flops_per_member_example')
      fpe_text = f'{fpe / 1e9:11.2f}' if fpe else f'{"":11s}'
      tf = c.get('tflops')
      print(f'{name:22s} {c["rate"]:12,.0f} {1e3 * c["step_s"]:9.1f} {fpe_text} '
            f'{tf if tf else float("nan"):8.1f} '
            f'{c["mfu"] if c.get("mfu") else float("nan"):6.1%}')
    else:
      print(f'{name:22s} {"-":>12s} {"":9s} {"":11s} {"":8s} {"":6s}  '
            f'{c.get("skipped") or c.get("error", "")[-100:]}')
  print(f'(MFU against {peak} TFLOP/s, dense bf16; torch rows use the JAX cell\'s FLOPs)'
        if peak else '(no peak known for this device: --peak_tflops for MFU)')


def driver(args: Any) -> None:
  try:
    header = harness.run_header()
  except OSError as e:  # a machine without git: the copy of the tree sent there
    header = {'date': time.strftime('%Y-%m-%dT%H:%M:%S+00:00', time.gmtime()),
              'commit': None, 'header_error': str(e), 'machine': harness.machine(),
              'command': harness.command()}
  info = device_info()
  peak = peak_tflops(args, info['device_kind'])
  deadline = time.monotonic() + args.budget_s
  cells: list[dict] = []
  names = [c for c in (TINY_CELLS if args.tiny and not args.cells_given else args.cells
                       ).split(',') if c]

  def write() -> None:
    measured = next((c['tflops_median'] for c in cells if c['cell'] == 'peak'
                     and 'tflops_median' in c), None)
    summarise(cells, peak, measured)
    harness.write_results(args.out, dict(
        header, **info, peak_tflops=peak,
        peak_source='--peak_tflops' if args.peak_tflops else 'datasheet dense bf16',
        measured_matmul_tflops=measured, tiny=args.tiny, batch=shape(args)[1],
        image_side=shape(args)[0], train_examples=shape(args)[2], steps=args.steps,
        warmup=args.warmup, budget_s=args.budget_s, cells_asked=names, cells=cells,
        load_average_end=harness.load_average()))

  passthrough = [f'--{k}={v}' for k, v in vars(args).items()
                 if k in ('steps', 'warmup', 'log_every', 'batch', 'examples', 'test_examples',
                          'torch_warmup', 'torch_blocks', 'matmul_n', 'matmul_reps',
                          'conv_impl', 'init_timeout_s')]
  for name in names:
    left = deadline - time.monotonic()
    kind, *rest = name.split(':')
    cell = dict(cell=name, framework=kind,
                **({'net': rest[0], 'members': int(rest[1])} if rest else {}),
                **({'variant': rest[2]} if len(rest) > 2 else {}))
    plain = ':'.join([kind, *rest[:2]])
    if len(rest) > 2 and any(c['cell'] == plain and 'rate' in c for c in cells):
      cell['skipped'] = f'{plain} measured: this fallback was not needed'
      cells.append(cell)
      continue
    if left < args.min_cell_s:
      cell['skipped'] = f'{left:.0f} s of the budget left'
      cells.append(cell)
      continue
    with tempfile.NamedTemporaryFile(suffix='.json', delete=False) as f:
      result_path = f.name
    python = args.torch_python if kind == 'torch' and args.torch_python else sys.executable
    cmd = [python, '-m', 'benchmarks.mfu', f'--cell={name}', f'--result={result_path}',
           *passthrough, *(['--tiny'] if args.tiny else []),
           *(['--compiled_flops'] if args.compiled_flops else [])]
    timeout = min(args.cell_timeout_s, left)
    print(f'--- {name} (timeout {timeout:.0f} s)', flush=True)
    start = time.monotonic()
    try:
      proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
      if proc.returncode == 0 and os.path.getsize(result_path):
        cell.update(json.loads(Path(result_path).read_text()))
      else:
        cell['error'] = f'exit {proc.returncode}: ' + (proc.stderr or proc.stdout)[-2000:]
    except subprocess.TimeoutExpired as e:
      tail = e.stderr.decode(errors='replace') if isinstance(e.stderr, bytes) else (e.stderr or '')
      cell['error'] = f'timed out after {timeout:.0f} s: ' + tail[-1000:]
    finally:
      os.unlink(result_path)
    cell['wall_s'] = round(time.monotonic() - start, 1)
    cells.append(cell)
    write()
    brief = {k: cell[k] for k in ('rate', 'step_s', 'tflops_median', 'flops_lowered', 'skipped')
             if k in cell}
    print(f'    {cell["wall_s"]} s: {brief or cell.get("error", "")[-600:]}', flush=True)
  write()
  print_table(cells, peak)
  print(f'wrote {args.out}')


def recount(args: Any) -> None:
  """Merges the results files of --recount (device calls, or a file this command wrote
  before, with its calls) and counts each measured cell's FLOPs here, by XLA's cost
  analysis of the lowered step for the CPU backend (the count step_flops makes in a
  cell; files from before it counted there have none). A cell measured in a later file
  replaces the same cell from an earlier one; an earlier measurement it replaces is kept
  in its 'earlier' list (call, rate, step). Each cell's share of the measured matmul rate
  is against the peak cell of its own call, or of the latest call before it that ran one
  (the calls of a session run one after another on one machine)."""
  from dist_ens import data
  runs = [json.loads(Path(f).read_text()) for f in args.recount.split(',')]
  first = runs[0]
  args.tiny, args.batch = first['tiny'], first['batch']
  args.examples, args.test_examples = 64, 16  # only the input's shape matters here
  dataset = data.from_arrays(*synthetic(args), num_classes=CLASSES)
  keep = ('date', 'commit', 'dirty', 'command', 'machine', 'platform', 'device_kind', 'jax',
          'budget_s', 'cells_asked', 'measured_matmul_tflops')
  measured_in = lambda c: 'rate' in c or 'tflops_median' in c
  calls: list[dict] = []
  cells: dict[str, dict] = {}
  for run in runs:
    base = len(calls)
    merged = 'calls' in run
    calls.extend(run['calls'] if merged else [{k: run.get(k) for k in keep}])
    for c in run['cells']:
      c = dict(c, call=base + (c.get('call', 0) if merged else 0))
      old = cells.get(c['cell'])
      if old is not None and not measured_in(c):
        continue
      if old is not None and measured_in(old):
        c['earlier'] = old.get('earlier', []) + [
            {k: old[k] for k in ('call', 'rate', 'step_s', 'tflops_median') if k in old}]
      cells[c['cell']] = c
  counted: dict[tuple, float | None] = {}
  for c in cells.values():
    if 'rate' not in c or c['framework'] == 'peak':
      continue
    key = (c['net'], c['members'], (c.get('model') or {}).get('conv_impl', args.conv_impl))
    if key not in counted:
      args.conv_impl = key[2]
      flops = step_flops(jax_config(c['net'], c['members'], args), dataset)['flops_lowered']
      counted[key] = flops
      print(f'{key}: {flops / (c["members"] * args.batch) / 1e9:.3f} GFLOP per member-example')
    flops = counted[key]
    c['flops_lowered'] = flops
    c['flops_per_member_example'] = flops / (c['members'] * args.batch) if flops else None
  cells_list = list(cells.values())
  measured = next((c['tflops_median'] for c in cells_list if c['cell'] == 'peak'
                   and 'tflops_median' in c), None)
  peak = first['peak_tflops']
  summarise(cells_list, peak, measured)
  for c in cells_list:
    own = next((calls[i]['measured_matmul_tflops'] for i in range(c['call'], -1, -1)
                if calls[i].get('measured_matmul_tflops')), None)
    if c.get('tflops') and own:
      c['of_measured_matmul'] = c['tflops'] / own
  harness.write_results(args.out, dict(
      harness.run_header(), device_kind=first['device_kind'], jax=first['jax'],
      peak_tflops=peak, peak_source=first['peak_source'], measured_matmul_tflops=measured,
      flops_source='XLA cost analysis of the lowered one-step program, CPU backend, counted '
      'by this command', tiny=first['tiny'], batch=first['batch'],
      image_side=first['image_side'], train_examples=first['train_examples'],
      steps=first['steps'], warmup=first['warmup'], calls=calls, cells=cells_list))
  print_table(cells_list, peak)
  print(f'wrote {args.out}')


ARGS: Any = None


def main() -> None:
  global ARGS
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--cells', default=None,
                      help='comma-separated jax:NET:M, jax:NET:M:cpuinit, jax:NET:M:mapN, '
                      'torch:NET:M, peak '
                      f'(default: {DEFAULT_CELLS})')
  parser.add_argument('--tiny', action='store_true', help='small nets, 2 members, 8x8 inputs')
  parser.add_argument('--batch', type=int, default=128, help='examples per member a step')
  parser.add_argument('--examples', type=int, default=10_000, help='training examples')
  parser.add_argument('--test_examples', type=int, default=256)
  parser.add_argument('--steps', type=int, default=60, help='steps of each JAX run')
  parser.add_argument('--warmup', type=int, default=20, help='untimed steps of each JAX run')
  parser.add_argument('--log_every', type=int, default=20)
  parser.add_argument('--torch_warmup', type=int, default=5)
  parser.add_argument('--torch_blocks', type=int, default=2)
  parser.add_argument('--conv_impl', default='auto', help="dist_ens's config.model.conv_impl")
  parser.add_argument('--matmul_n', type=int, default=8192)
  parser.add_argument('--matmul_reps', type=int, default=10)
  parser.add_argument('--peak_tflops', type=float, default=0.0,
                      help='the peak MFU is against (0: the device\'s datasheet dense bf16)')
  parser.add_argument('--compiled_flops', action='store_true',
                      help='also compile the one-step program for its cost analysis')
  parser.add_argument('--torch_python', default='',
                      help='the Python that runs torch cells (default: this one), e.g. a '
                      'venv of its own on a machine whose main one has no torch')
  parser.add_argument('--budget_s', type=float, default=430.0)
  parser.add_argument('--cell_timeout_s', type=float, default=180.0)
  parser.add_argument('--min_cell_s', type=float, default=40.0)
  parser.add_argument('--init_timeout_s', type=float, default=0.0,
                      help="a JAX cell ends (failed) if its init program has not compiled in "
                      'this many seconds (0: no limit), so that its :cpuinit fallback runs')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'mfu.json'))
  parser.add_argument('--recount', default='',
                      help='comma-separated results files (device calls) to merge into --out, '
                      'their FLOPs counted here')
  parser.add_argument('--cell', default='', help=argparse.SUPPRESS)
  parser.add_argument('--result', default='', help=argparse.SUPPRESS)
  args = parser.parse_args()
  args.cells_given = args.cells is not None
  args.cells = args.cells or DEFAULT_CELLS
  if args.tiny:
    args.steps, args.warmup, args.log_every = 6, 2, 2
    args.torch_warmup, args.torch_blocks, args.matmul_reps = 2, 1, 3
    args.min_cell_s = min(args.min_cell_s, 5.0)
  ARGS = args
  if args.recount:
    recount(args)
  elif args.cell:
    child(args)
  else:
    driver(args)


if __name__ == '__main__':
  main()
