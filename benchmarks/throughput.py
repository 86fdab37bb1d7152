"""Member-examples per second of every way to train M models, against the matmul peak.

  python -m benchmarks.throughput            # the full grid (about 20 min on 2 cores)
  python -m benchmarks.throughput --quick    # 5 cells, under 5 min
  python -m benchmarks.throughput --candidate p=PATH   # also an A/B of a dist_ens change

For each model and member count M (batch 128 per member, Adam, one shared batch),
it times one training step of all M members done as
  loop      a Python loop over members, each with its own jitted optax update
            (the usual baseline: a list of models);
  loop+guard  the loop, each update also skipping a step whose loss or gradient is
            not finite, as dist_ens's step does (prices that guard apart from the form);
  vmap      dist_ens's step, members vmapped on the device;
  map       dist_ens's step, members one after another with lax.map;
  map/K     the same with map_batch_size=K: lax.map over chunks of K vmapped members;
  auto      dist_ens's step as config.ensemble.member_parallelism='auto' resolves it;
  bare      jax.vmap of a bare per-member Adam step: no shard_map, no freezing of
            non-finite members, no metrics (what dist_ens's vmap costs without them);
  wide1     (MLPs) bare, but the first layer hand-built as ONE [B, in] @ [in, M*h]
            matmul over the members' concatenated weights (every member sees the
            same batch), to see whether that pays over vmap's own lowering;
  torch     torch.func ensembling: stack_module_state + functional_call + vmap, with
            torch.optim.Adam (foreach) on the stacked parameters, which is exactly
            per-member Adam since Adam is elementwise (needs torch; skipped without),
            with --threads intra-op threads (default: all cores, as XLA uses them);
  torch/1t  the same with 1 thread: 2 OpenMP threads lose badly on tiny kernels and
            on a loaded machine, and the peer gets its better setting;
  torch/compile  torch with the loss (forward and backward) and Adam's step compiled
            by torch.compile (inductor; CUDA graphs on a GPU), --threads threads;
  torch/amp torch/compile with the forward in bfloat16 under torch.autocast (AMP;
            parameters and Adam in float32) and a 2-D CNN's input channels_last;
  auto/bf16 (with torch) 'auto' with config.precision='bfloat16', torch/amp's peer;
  FORM@NAME a form of a candidate change of dist_ens given by --candidate NAME=PATH
            (a changed copy of dist_ens/core/step.py, or a folder holding one; see
            load_candidate).
Every dist_ens variant is built as training builds it: dist_ens.run.assemble.build_parts,
init_sharded and build_step, called as step(state, parts.device_hparams(), x, y).
Everything runs on ONE device (jax.devices()[:1]): on a CPU, fake devices split the
same cores, so they add overhead, not compute.

Variants are timed side by side: after a warm-up (compile excluded), each repeat
times every variant once, in a rotating order, over enough steps to last
--min_time seconds; the medians over repeats are reported. The matmul peak (a
2048^3 jnp.dot, and torch's own) is measured after every cell, interleaved the
same way, and its median over the run is the denominator.

FLOPs are counted analytically from the layer shapes: a dense layer costs
2*in*out per example forward, a convolution 2*out_positions*k^rank*in_ch*out_ch;
a training step is counted as 3x the forward FLOPs (forward, plus gradients with
respect to weights and to activations). That convention over-counts the first
layer's input gradient, which nobody computes; `executed` FLOPs subtract it and
are reported too. Adam's elementwise work (~10 FLOPs/parameter) is left out.

Prints a table and writes benchmarks/results/throughput.json (--quick:
throughput_quick.json, so a quick run never overwrites the full grid's figures).
"""

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
BATCH = 128
NUM_CLASSES = 10
LEARNING_RATE = 1e-3
# Matmul size for the peak: big enough to saturate, small enough to repeat (a GPU
# needs a bigger one; see peak_size).
PEAK_N = 2048
PEAK_N_ACCELERATOR = 8192
# A variant whose single step takes longer than this (lax.map of CNNs) is timed in
# the first SLOW_REPEATS rounds only: it is far off the best either way.
SLOW_SECONDS, SLOW_REPEATS = 1.0, 3
# --conv_impl: config.model.conv_impl for every JAX variant ('' keeps the config's 'auto').
CONV_IMPL = ''


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """One model of the grid: config.model fields and the input shape (no batch axis)."""
  title: str
  model: dict[str, Any]
  input_shape: tuple[int, ...]


MODELS = {
    'mlp_small': ModelSpec('MLP 40-256-256-10 (MNIST-1D)', dict(name='mlp', widths=(256, 256)),
                           (40, 1)),
    'mlp_big': ModelSpec('MLP 784-512-512-10 (MNIST)', dict(name='mlp', widths=(512, 512)),
                         (28, 28, 1)),
    'cnn1d': ModelSpec('CNN 1-D 25-25-25, k 5/3/3, s 2 (MNIST-1D; configs/mnist1d_cnn.py)',
                       dict(name='cnn', channels=(25, 25, 25), kernel_sizes=(5, 3, 3),
                            strides=(2, 2, 2)), (40, 1)),
    'cnn2d': ModelSpec('CNN 2-D 16-32-64, k 3, s 2 (28x28x1)',
                       dict(name='cnn', channels=(16, 32, 64), kernel_sizes=(3, 3, 3),
                            strides=(2, 2, 2)), (28, 28, 1)),
}
FULL_GRID = {name: (1, 4, 16, 64) for name in MODELS}
QUICK_GRID = {'mlp_small': (16, 64), 'mlp_big': (16,), 'cnn1d': (16,), 'cnn2d': (4,)}


# ---------------------------------------------------------------------------------------------
# FLOPs


def layer_flops(spec: ModelSpec) -> list[int]:
  """Forward FLOPs per example of each matmul/conv layer (a multiply-add is 2 FLOPs)."""
  m = spec.model
  if m['name'] == 'mlp':
    sizes = (math.prod(spec.input_shape),) + tuple(m['widths']) + (NUM_CLASSES,)
    return [2 * a * b for a, b in zip(sizes[:-1], sizes[1:])]
  spatial, in_ch = list(spec.input_shape[:-1]), spec.input_shape[-1]
  flops = []
  for out_ch, k, s in zip(m['channels'], m['kernel_sizes'], m['strides']):
    spatial = [-(-n // s) for n in spatial]  # 'SAME' padding: ceil(n / stride).
    flops.append(2 * math.prod(spatial) * k**len(spatial) * in_ch * out_ch)
    in_ch = out_ch
  flops.append(2 * math.prod(spatial) * in_ch * NUM_CLASSES)
  return flops


def train_flops(spec: ModelSpec) -> tuple[int, int]:
  """(3x-forward convention, executed) training FLOPs per example."""
  per_layer = layer_flops(spec)
  return 3 * sum(per_layer), 3 * sum(per_layer) - per_layer[0]


# ---------------------------------------------------------------------------------------------
# JAX variants. Each builder returns a function that runs ONE training step of all
# M members and returns something to block on.


def _jax_setup(spec: ModelSpec, members: int = 1, precision: str = 'float32'):
  """(config, parts) of this cell, built as training builds them (dist_ens.run.assemble)."""
  import jax
  from dist_ens.run import assemble, mesh_layout
  from dist_ens.config.loading import load_config
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members = members
  config.precision = precision
  config.data.batch_size = BATCH
  config.model.update(spec.model)
  if CONV_IMPL:
    config.model.conv_impl = CONV_IMPL
  config.optim.learning_rate = LEARNING_RATE
  config.optim.weight_decay = 0.0  # Plain Adam, as torch.optim.Adam.
  mesh = mesh_layout.build_mesh(config, jax.devices()[:1])
  return config, assemble.build_parts(config, mesh, spec.input_shape, NUM_CLASSES)


def _batch(spec: ModelSpec, seed: int = 0):
  import numpy as np
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((BATCH, *spec.input_shape)).astype(np.float32)
  y = rng.integers(0, NUM_CLASSES, BATCH).astype(np.int32)
  return x, y


def make_step(parts: Any, form: tuple[str, int | None], step_module: Any = None) -> Any:
  """assemble.build_step for a shared batch, with `step_module`'s make_train_step if given.

  `step_module`: a candidate copy of dist_ens/core/step.py (see --candidate); its
  make_train_step stands in for the installed one while assemble wires the step, so a
  candidate is built exactly as training builds the installed step.
  """
  from unittest import mock
  from dist_ens.run import assemble
  if step_module is None:
    return assemble.build_step(parts, per_member_batches=False, form=form)
  with mock.patch.object(assemble, 'make_train_step', step_module.make_train_step):
    return assemble.build_step(parts, per_member_batches=False, form=form)


def build_dist_ens(spec: ModelSpec, members: int, parallelism: str,
                   map_batch_size: int | None, step_module: Any = None,
                   precision: str = 'float32') -> Callable[[], Any]:
  """dist_ens's own step (assemble.build_step) on a 1-device mesh.

  `step_module`: a module with the same make_train_step (a candidate change of
  dist_ens/core/step.py, see --candidate); default the installed dist_ens.core.step.
  `precision`: config.precision.
  """
  import jax
  from dist_ens.run import initial_state
  from dist_ens.parallel import mesh as mesh_lib
  _, parts = _jax_setup(spec, members, precision)
  step = make_step(parts, (parallelism, map_batch_size), step_module)
  state = initial_state.init_sharded(parts)
  hparams = parts.device_hparams()
  x, y = (jax.device_put(a, mesh_lib.batch_sharding(parts.mesh)) for a in _batch(spec))
  holder = [state]

  def run():
    holder[0], metrics = step(holder[0], hparams, x, y)
    return metrics.loss
  return run


def build_auto(spec: ModelSpec, members: int, precision: str = 'float32') -> Callable[[], Any]:
  """The step that config.ensemble.member_parallelism='auto' gives this cell."""
  from dist_ens.run import member_forms
  config, parts = _jax_setup(spec, members, precision)
  form, chunk = member_forms.member_form(parts, config.data.batch_size)
  return build_dist_ens(spec, members, form, chunk, precision=precision)


def _plain_state(spec: ModelSpec, members: int):
  """(model, one member's optax transformation, the stacked initial state, unsharded)."""
  import jax
  _, parts = _jax_setup(spec, members)
  # Every member has the config's scalars (no sweep): optimizer(None) reads them.
  return parts.model, parts.optimizer(None), jax.jit(parts.init)()


def build_loop(spec: ModelSpec, members: int, guard: bool = False) -> Callable[[], Any]:
  """M separate states, each stepped by a jitted optax update: a Python loop over models.

  `guard`: each update applies its gradients with dist_ens's own member_apply_fn, which
  skips a step whose loss or gradient is not finite, to price that guard apart from how
  the members run.
  """
  import jax
  import jax.numpy as jnp
  import optax
  from dist_ens.ensembles.stacking import unstack
  from dist_ens.tasks.classification import cross_entropy
  from dist_ens.core.step import BatchResult, Member, member_apply_fn
  model, tx, stacked = _plain_state(spec, members)
  guarded = member_apply_fn(lambda hp: tx)

  def per_member(tree):  # unstack(), or M copies of a leafless tree (a model without state).
    return unstack(tree) if jax.tree.leaves(tree) else [tree] * members
  states = [jax.device_put(s) for s in zip(per_member(stacked.params),
                                           per_member(stacked.model_state),
                                           per_member(stacked.opt_state))]

  def update(params, model_state, opt_state, x, y):
    def loss_fn(p):
      logits, new_state = model.apply(p, model_state, x, train=True)
      return cross_entropy(logits, y), new_state
    (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    if guard:
      new, _ = guarded(Member(params, model_state, opt_state, jnp.bool_(False)), None,
                       BatchResult(loss, {}, grads, new_state))
      return new.params, new.model_state, new.opt_state, loss
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_state, opt_state, loss
  update = jax.jit(update, donate_argnums=(0, 1, 2))
  x, y = (jax.device_put(a, jax.devices()[0]) for a in _batch(spec))

  def run():
    loss = None
    for i, member_state in enumerate(states):
      *member_state, loss = update(*member_state, x, y)
      states[i] = tuple(member_state)
    return loss
  run.lower = lambda: update.lower(*states[0], x, y)  # one member's update, for its memory
  return run


def build_bare_vmap(spec: ModelSpec, members: int) -> Callable[[], Any]:
  """jax.vmap of a bare per-member Adam step: dist_ens's vmap without its extras.

  No shard_map (so no gradient all-reduce), no freezing of non-finite members, no
  accuracy: the floor of what a vmapped step costs, to price those features.
  """
  import jax
  import optax
  from dist_ens.tasks.classification import cross_entropy
  model, tx, state = _plain_state(spec, members)

  def member_update(params, model_state, opt_state, x, y):
    def loss_fn(p):
      logits, new_state = model.apply(p, model_state, x, train=True)
      return cross_entropy(logits, y), new_state
    (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), model_state, opt_state, loss
  update = jax.jit(jax.vmap(member_update, in_axes=(0, 0, 0, None, None)),
                   donate_argnums=(0, 1, 2))
  x, y = (jax.device_put(a, jax.devices()[0]) for a in _batch(spec))
  holder = [(state.params, state.model_state, state.opt_state)]

  def run():
    *member_state, loss = update(*holder[0], x, y)
    holder[0] = tuple(member_state)
    return loss
  return run


def build_wide_first_layer(spec: ModelSpec, members: int) -> Callable[[], Any]:
  """Bare vmap, but the MLP's first layer is one [B, in] @ [in, M*h] matmul, by hand.

  With a batch shared by all members, the members' first layers are one wide
  matmul over their concatenated weights; the rest of the network is vmapped.
  """
  import jax
  import jax.numpy as jnp
  import optax
  from dist_ens.tasks.classification import cross_entropy
  _, tx, state = _plain_state(spec, members)

  def logits_all(params, x):
    w1, b1 = params[0]['w'], params[0]['b']  # [M, in, h], [M, h]
    h = x.reshape(x.shape[0], -1) @ jnp.moveaxis(w1, 0, 1).reshape(w1.shape[1], -1)
    h = jax.nn.relu(h.reshape(x.shape[0], members, -1) + b1)  # [B, M, h]
    h = jnp.moveaxis(h, 1, 0)  # [M, B, h]

    def rest(layers, h):
      for layer in layers[:-1]:
        h = jax.nn.relu(h @ layer['w'] + layer['b'])
      return h @ layers[-1]['w'] + layers[-1]['b']
    return jax.vmap(rest)(params[1:], h)

  def update(params, opt_state, x, y):
    def loss_fn(p):
      logits = logits_all(p, x)
      return jax.vmap(lambda l: cross_entropy(l, y))(logits).sum()
    grads = jax.grad(loss_fn)(params)
    updates, opt_state = jax.vmap(tx.update)(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  update = jax.jit(update, donate_argnums=(0, 1))
  x, y = (jax.device_put(a, jax.devices()[0]) for a in _batch(spec))
  holder = [(state.params, state.opt_state)]

  def run():
    holder[0] = update(*holder[0], x, y)
    return holder[0][0][-1]['b']
  return run


# ---------------------------------------------------------------------------------------------
# torch.func


def _torch_module(spec: ModelSpec):
  """The torch twin of the model: same layers, shapes and output sizes (NCHW)."""
  from torch import nn
  m = spec.model
  if m['name'] == 'mlp':
    sizes = (math.prod(spec.input_shape),) + tuple(m['widths']) + (NUM_CLASSES,)
    layers: list[nn.Module] = [nn.Flatten()]
    for a, b in zip(sizes[:-1], sizes[1:]):
      layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])
  rank = len(spec.input_shape) - 1
  conv = {1: nn.Conv1d, 2: nn.Conv2d}[rank]
  layers, in_ch = [], spec.input_shape[-1]
  spatial = list(spec.input_shape[:-1])
  for out_ch, k, s in zip(m['channels'], m['kernel_sizes'], m['strides']):
    # Padding k // 2 gives 'SAME''s output size ceil(n / s) for these odd kernels.
    layers += [conv(in_ch, out_ch, k, stride=s, padding=k // 2), nn.ReLU()]
    spatial = [-(-n // s) for n in spatial]
    in_ch = out_ch
  layers += [nn.Flatten(), nn.Linear(in_ch * math.prod(spatial), NUM_CLASSES)]
  return nn.Sequential(*layers)


def build_torch(spec: ModelSpec, members: int, threads: int,
                device: str = 'cpu', compiled: bool = False,
                amp: bool = False) -> Callable[[], Any]:
  """torch.func ensembling with Adam on the stacked parameters (per-member Adam).

  `threads` is set before every step, so variants with different thread counts
  can alternate in one process. `device` is 'cpu' or 'cuda'. `compiled`: the forward
  and loss (with its backward, by AOTAutograd) and Adam's step each go through
  torch.compile (inductor; on 'cuda' mode='reduce-overhead', i.e. CUDA graphs).
  `amp`: the forward runs under torch.autocast in bfloat16 (parameters, gradients
  and Adam stay float32), and a 2-D CNN's input is channels_last, the layout its
  convolutions prefer on GPUs.
  """
  import copy
  import torch
  from torch.func import functional_call, stack_module_state
  torch.manual_seed(0)
  nets = [_torch_module(spec).to(device) for _ in range(members)]
  params, buffers = stack_module_state(nets)
  base = copy.deepcopy(nets[0]).to('meta')

  def one(p, b, x):
    return functional_call(base, (p, b), (x,))
  forward = torch.func.vmap(one, in_dims=(0, 0, None))
  opt = torch.optim.Adam(list(params.values()), lr=LEARNING_RATE, foreach=True)
  x, y = _batch(spec)
  # torch convolutions take channels first.
  x = torch.from_numpy(x if spec.model['name'] == 'mlp' else x.transpose(0, x.ndim - 1,
                                                                          *range(1, x.ndim - 1)))
  x = x.contiguous().to(device)
  if amp and x.ndim == 4:
    x = x.to(memory_format=torch.channels_last)
  y_all = torch.from_numpy(y).long().repeat(members).to(device)

  def loss_of(params):
    with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
      logits = forward(params, buffers, x).float()  # [M, B, C]
    # Sum over members of each member's mean loss: member m's gradient is its own.
    return torch.nn.functional.cross_entropy(logits.reshape(-1, NUM_CLASSES), y_all,
                                             reduction='sum') / BATCH

  update = opt.step
  if compiled:
    mode = 'reduce-overhead' if device == 'cuda' else 'default'
    loss_of = torch.compile(loss_of, mode=mode)
    update = torch.compile(opt.step, mode=mode)

  def run():
    torch.set_num_threads(threads)
    opt.zero_grad(set_to_none=True)
    loss = loss_of(params)
    loss.backward()
    update()
    return loss
  return run


# ---------------------------------------------------------------------------------------------
# Timing


def _block(value):
  import jax
  if hasattr(value, 'detach'):  # torch: eager on a CPU; a GPU's queue needs a sync.
    if value.is_cuda:
      import torch
      torch.cuda.synchronize()
    return value
  return jax.block_until_ready(value)


def peak_size() -> int:
  import jax
  return PEAK_N if jax.devices()[0].platform == 'cpu' else PEAK_N_ACCELERATOR


def build_peaks(with_torch: bool, torch_device: str = 'cpu') -> dict[str, Callable[[], Any]]:
  """A large float32 matmul in each framework, at its default precision."""
  import jax
  import numpy as np
  n = peak_size()
  # Random operands: zeros or ones can run faster than real data on some hardware.
  host = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
  a = jax.device_put(host, jax.devices()[0])
  dot = jax.jit(lambda u, v: u @ v)
  peaks = {'jax': lambda: dot(a, a)}
  if with_torch:
    import torch
    t = torch.from_numpy(host).to(torch_device)
    peaks['torch'] = lambda: t @ t
  return peaks


def time_side_by_side(runs: dict[str, Callable[[], Any]], repeats: int,
                      min_time: float) -> tuple[dict[str, list[float]], dict[str, float]]:
  """Seconds per call of each run: warm-up first, then `repeats` rotating rounds.

  Returns (per-call times of every repeat, first-call seconds incl. compile).
  """
  first, calls, slow = {}, {}, {}
  for name, run in runs.items():
    start = time.perf_counter()
    _block(run())
    first[name] = time.perf_counter() - start
    # Calibrate: enough calls per measurement to last min_time.
    start = time.perf_counter()
    _block(run())
    once = max(time.perf_counter() - start, 1e-6)
    calls[name] = max(1, min(1000, round(min_time / once)))
    slow[name] = once > SLOW_SECONDS
  times = {name: [] for name in runs}
  for r, name in harness.rotating_rounds(runs, repeats):
    run, n = runs[name], calls[name]
    if r >= SLOW_REPEATS and slow[name]:
      continue
    start = time.perf_counter()
    for _ in range(n):
      out = run()
    _block(out)
    times[name].append((time.perf_counter() - start) / n)
  return times, first


# Where a candidate folder may hold its step.py (over_members and its forms are in it).
CANDIDATE_FILES = ('core/step.py', 'step.py')


def load_candidate(path: str) -> Any:
  """A candidate change of dist_ens, for an A/B run against the installed one.

  `path` is a changed copy of dist_ens/core/step.py, or a folder holding one (as step.py,
  or under core/ as in the package). Everything else is the installed package, and the
  installed modules stay in place for the other variants.
  Returns the candidate step module; its `candidate_forms` are the member
  parallelisms of its over_members (MEMBER_PARALLELISM).
  """
  import importlib.util
  # The real package first: a candidate imports only its leaves.
  import dist_ens.core.step as installed_step
  root = Path(path)
  if root.is_dir():
    found = [root / c for c in CANDIDATE_FILES if (root / c).exists()]
    if not found:
      raise ValueError(f'--candidate {path}: no step.py there (copy dist_ens/core/step.py).')
    root = found[0]
  elif not root.exists():
    raise ValueError(f'--candidate {path}: no such file or folder.')
  name = installed_step.__name__
  spec = importlib.util.spec_from_file_location(name, root)
  step = importlib.util.module_from_spec(spec)
  try:
    sys.modules[name] = step
    spec.loader.exec_module(step)
  finally:
    sys.modules[name] = installed_step
  step.candidate_forms = tuple(step.MEMBER_PARALLELISM)
  return step


def variants_for(spec: ModelSpec, members: int, chunks: tuple[int, ...],
                 with_torch: bool, with_wide: bool,
                 candidates: dict[str, Any],
                 torch_threads: int,
                 max_unroll: int = 16,
                 torch_device: str = 'cpu') -> dict[str, Callable[[], Callable[[], Any]]]:
  builders = {
      'loop': lambda: build_loop(spec, members),
      'loop+guard': lambda: build_loop(spec, members, guard=True),
      'vmap': lambda: build_dist_ens(spec, members, 'vmap', None),
      'map': lambda: build_dist_ens(spec, members, 'map', None),
  }
  for k in chunks:
    if 1 < k < members and members % k == 0:
      builders[f'map/{k}'] = lambda k=k: build_dist_ens(spec, members, 'map', k)
  builders['auto'] = lambda: build_auto(spec, members)
  for name, module in candidates.items():
    # The candidate's vmap and any form it adds ('map' forms with --variants).
    for form in module.candidate_forms:
      if form == 'unroll' and members > max_unroll:
        continue  # Its program grows with M; compiling 64 copies is slow and off-design.
      builders[f'{form}@{name}'] = lambda m=module, f=form: build_dist_ens(
          spec, members, f, None, m)
    for k in chunks:
      if 1 < k < members and members % k == 0:
        builders[f'map/{k}@{name}'] = lambda k=k, m=module: build_dist_ens(
            spec, members, 'map', k, m)
  builders['bare'] = lambda: build_bare_vmap(spec, members)
  if with_wide and spec.model['name'] == 'mlp':
    builders['wide1'] = lambda: build_wide_first_layer(spec, members)
  if with_torch:
    builders['torch'] = lambda: build_torch(spec, members, torch_threads, torch_device)
    if torch_device == 'cpu':  # Threads only matter for CPU kernels.
      builders['torch/1t'] = lambda: build_torch(spec, members, 1)
    builders['torch/compile'] = lambda: build_torch(spec, members, torch_threads, torch_device,
                                                    compiled=True)
    builders['torch/amp'] = lambda: build_torch(spec, members, torch_threads, torch_device,
                                                compiled=True, amp=True)
    # dist_ens in bfloat16 too, so that torch/amp has a peer in its own precision.
    builders['auto/bf16'] = lambda: build_auto(spec, members, 'bfloat16')
  return builders


def torch_available() -> str | None:
  try:
    import torch
  except ImportError:
    return None
  return torch.__version__


def _parse(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--quick', action='store_true', help='fewer cells and repeats (< 5 min)')
  parser.add_argument('--models', default='', help=f'comma-separated subset of {list(MODELS)}')
  parser.add_argument('--members', default='', help='comma-separated M values (default: grid)')
  parser.add_argument('--repeats', type=int, default=None, help='default 11, quick 5')
  parser.add_argument('--min_time', type=float, default=None,
                      help='seconds per measurement (default 0.2, quick 0.15)')
  parser.add_argument('--chunks', default='4,16', help='map_batch_size values to try')
  parser.add_argument('--variants', default='',
                      help='only these variants (e.g. vmap,loop); default: all')
  parser.add_argument('--no_torch', action='store_true')
  parser.add_argument('--candidate', action='append', default=[],
                      help='NAME=PATH: also time a candidate change of dist_ens (a copy of '
                      'dist_ens/core/step.py, or a folder holding one as step.py or '
                      'core/step.py) as vmap@NAME, map@NAME, map/K@NAME and any other form '
                      'it adds to MEMBER_PARALLELISM (A/B of a patch)')
  parser.add_argument('--threads', type=int, default=os.cpu_count(),
                      help='torch intra-op threads (default: all cores, as XLA uses)')
  parser.add_argument('--batch', type=int, default=BATCH, help='examples per member per step')
  parser.add_argument('--conv_impl', default='', help="config.model.conv_impl for the CNNs "
                      "('xla', 'patches'; default: the config's 'auto')")
  parser.add_argument('--out', default=None, help='default benchmarks/results/throughput.json '
                      '(throughput_quick.json with --quick)')
  return parser.parse_args(argv)


def _grid(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
  """Model name -> the member counts to time, from --quick, --models and --members."""
  grid = dict(QUICK_GRID if args.quick else FULL_GRID)
  if args.models:
    grid = {m: grid.get(m, FULL_GRID[m]) for m in args.models.split(',')}
  if args.members:
    grid = {m: tuple(int(v) for v in args.members.split(',')) for m in grid}
  return grid


def _torch_setup(torch_version: str | None, threads: int) -> str:
  """Sets torch's threads and returns where torch runs: on the GPU when JAX has one (and
  torch sees it), else the CPU."""
  import jax
  if not torch_version:
    return 'cpu'
  import torch
  torch.set_num_threads(threads)
  if jax.devices()[0].platform != 'gpu':
    return 'cpu'
  if not torch.cuda.is_available():
    raise SystemExit('JAX runs on a GPU but torch sees none: pass --no_torch.')
  return 'cuda'


def _time_cell(model_name: str, members: int, builders, repeats: int, min_time: float,
               peaks, peak_times) -> dict[str, Any]:
  """One (model, M) cell: every variant timed side by side, the matmul peaks after it."""
  runs = {name: build() for name, build in builders.items()}
  start = time.perf_counter()
  times, first = time_side_by_side(runs, repeats, min_time)
  ptimes, _ = time_side_by_side(peaks, 3, 0.2)
  for name, t in ptimes.items():
    peak_times[name] += t
  med = {name: statistics.median(t) for name, t in times.items()}
  cell = dict(model=model_name, members=members, step_seconds=med,
              step_seconds_all=times, first_call_seconds=first,
              member_examples_per_s={k: members * BATCH / t for k, t in med.items()},
              seconds=time.perf_counter() - start)
  best = max(cell['member_examples_per_s'].items(), key=lambda kv: kv[1])
  print(f'{model_name} M={members}: ' + ', '.join(
      f'{k} {v:,.0f}' for k, v in cell['member_examples_per_s'].items())
        + f'  (best {best[0]}; {cell["seconds"]:.0f} s)', flush=True)
  return cell


def _add_fractions(cells, peak) -> None:
  """Each cell's fraction of the matmul peak (torch's own for torch), and of JAX's."""
  for cell in cells:
    conv_flops, _ = train_flops(MODELS[cell['model']])
    cell['fraction_of_peak'] = {
        k: v * conv_flops / peak['torch' if k.startswith('torch') else 'jax']
        for k, v in cell['member_examples_per_s'].items()}
    cell['fraction_of_jax_peak'] = {
        k: v * conv_flops / peak['jax'] for k, v in cell['member_examples_per_s'].items()}
    summarize(cell)


def main(argv: list[str] | None = None) -> None:
  global BATCH, CONV_IMPL
  args = _parse(argv)
  BATCH, CONV_IMPL = args.batch, args.conv_impl
  grid = _grid(args)
  # Many short measurements rather than a few long ones: on a shared machine the
  # medians then sample more moments, and interference hits every variant alike.
  repeats = args.repeats or (5 if args.quick else 11)
  min_time = args.min_time or (0.15 if args.quick else 0.2)
  chunks = tuple(int(c) for c in args.chunks.split(',') if c)
  only = set(filter(None, args.variants.split(',')))
  candidates = {c.split('=', 1)[0]: load_candidate(c.split('=', 1)[1]) for c in args.candidate}
  torch_version = None if args.no_torch else torch_available()
  torch_device = _torch_setup(torch_version, args.threads)

  import jax
  device = jax.devices()[0]
  print(f'jax {jax.__version__} on 1 {device.platform} device ({device.device_kind}, '
        f'{os.cpu_count()} cores), torch {torch_version or "not installed (column skipped)"}'
        + (f' on {torch_device}' + (f' with {args.threads} threads' if torch_device == 'cpu'
                                    else '') if torch_version else ''), flush=True)
  header = harness.run_header()  # With the load average at the start: how busy the machine was
  peaks = build_peaks(bool(torch_version), torch_device)
  peak_times = {name: [] for name in peaks}
  cells = []
  for model_name, member_counts in grid.items():
    for members in member_counts:
      builders = variants_for(MODELS[model_name], members, chunks, bool(torch_version),
                              with_wide=True, candidates=candidates,
                              torch_threads=args.threads, torch_device=torch_device)
      if only:
        builders = {k: v for k, v in builders.items() if k in only}
      else:  # A candidate's lax.map forms only when asked for by name.
        builders = {k: v for k, v in builders.items() if not (k.startswith('map') and '@' in k)}
      cells.append(_time_cell(model_name, members, builders, repeats, min_time, peaks,
                              peak_times))

  n = peak_size()
  peak = {name: 2 * n**3 / statistics.median(t) for name, t in peak_times.items()}
  _add_fractions(cells, peak)
  result = dict(
      header, jax=jax.__version__, torch=torch_version, torch_threads=args.threads if torch_version
      else None, torch_device=torch_device if torch_version else None,
      device=f'1 {device.platform} device ({device.device_kind})',
      xla_flags=os.environ.get('XLA_FLAGS', ''), load_average_end=harness.load_average(),
      candidates=dict(c.split('=', 1) for c in args.candidate),
      batch_per_member=BATCH, conv_impl=CONV_IMPL or 'auto', repeats=repeats,
      min_time=min_time, quick=args.quick, peak_matmul_size=n, peak_flops=peak,
      peak_flops_all={k: [2 * n**3 / t for t in v] for k, v in peak_times.items()},
      models={name: dict(title=MODELS[name].title, train_flops_per_example=train_flops(
          MODELS[name])[0], executed_flops_per_example=train_flops(MODELS[name])[1])
              for name in grid},
      cells=cells)
  print_table(result)
  out = Path(args.out or ROOT / 'benchmarks' / 'results' /
             ('throughput_quick.json' if args.quick else 'throughput.json'))
  harness.write_results(out, result)
  print(f'wrote {out}')


def summarize(cell: dict[str, Any]) -> None:
  """Adds the cell's goal figures: auto against the best baseline form and torch."""
  rate = cell['member_examples_per_s']
  baselines = {k: v for k, v in rate.items() if k == 'loop' or (k.split('/')[0] in ('vmap', 'map')
                                                                and '@' not in k)}
  if baselines:
    best = max(baselines, key=baselines.get)
    cell['best_baseline'] = best
    if 'auto' in rate:
      cell['auto_over_best'] = rate['auto'] / rate[best]
  torches = {k: v for k, v in rate.items() if k.startswith('torch')}
  if torches:
    cell['best_torch'] = max(torches, key=torches.get)
    best_dist_ens = max(v for k, v in rate.items() if k.split('/')[0] in ('vmap', 'map', 'auto')
                        and '@' not in k)
    cell['dist_ens_over_torch'] = best_dist_ens / torches[cell['best_torch']]
    if 'auto' in rate:
      cell['auto_over_torch'] = rate['auto'] / torches[cell['best_torch']]
      same_precision = [v for k, v in torches.items() if k != 'torch/amp']
      if same_precision:  # float32 against float32
        cell['auto_over_torch_f32'] = rate['auto'] / max(same_precision)
    if 'auto/bf16' in rate and 'torch/amp' in rate:  # bfloat16 against bfloat16
      cell['bf16_over_amp'] = rate['auto/bf16'] / rate['torch/amp']


def print_table(result: dict[str, Any]) -> None:
  peak = result['peak_flops']
  n = result['peak_matmul_size']
  print(f'\nmatmul peak ({n}^3 f32, median): jax {peak["jax"] / 1e9:.0f} GFLOP/s'
        + (f', torch {peak["torch"] / 1e9:.0f} GFLOP/s' if 'torch' in peak else ''))
  print('member-examples/s (% of matmul peak; torch against its own peak)')
  names = []
  for cell in result['cells']:
    names += [n for n in cell['member_examples_per_s'] if n not in names]
  print(f'{"model":10s} {"M":>3s} ' + ' '.join(f'{n:>15s}' for n in names))
  for cell in result['cells']:
    row = []
    for n in names:
      if n in cell['member_examples_per_s']:
        row.append(f'{cell["member_examples_per_s"][n]:9,.0f} ({100 * cell["fraction_of_peak"][n]:2.0f}%)')
      else:
        row.append(f'{"-":>15s}')
    print(f'{cell["model"]:10s} {cell["members"]:3d} ' + ' '.join(f'{r:>15s}' for r in row))
  print('\nauto against the best of loop / vmap / map(/K), and against torch.func (its best '
        'variant; f32: its best float32 one; bf16: auto/bf16 against torch/amp)')
  print(f'{"model":10s} {"M":>3s} {"best":>8s} {"auto/best":>10s} {"auto/torch":>11s} '
        f'{"f32":>6s} {"bf16":>6s}')
  nan = float('nan')
  for cell in result['cells']:
    print(f'{cell["model"]:10s} {cell["members"]:3d} {cell.get("best_baseline", "-"):>8s} '
          f'{cell.get("auto_over_best", nan):10.2f} {cell.get("auto_over_torch", nan):11.2f} '
          f'{cell.get("auto_over_torch_f32", nan):6.2f} {cell.get("bf16_over_amp", nan):6.2f}')


if __name__ == '__main__':
  main(sys.argv[1:])
