"""Step time of users' framework models through dist_ens's adapters vs the built-in MLP.

  python -m benchmarks.adapters [--members 8] [--batch 128] [--widths 256,256]
      [--steps 50] [--repeats 5] [--out PATH]

The same MLP (flatten, [dense, relu] per width, dense to 10 logits; no BatchNorm or
dropout, so every version computes the same thing) is written in Flax linen, Flax
NNX, Equinox, Haiku and plain JAX (a dist_ens.Model), named by config.model.factory
as a user would, and compared with config.model.name='mlp'. Each is built by the
chain training uses (dist_ens.run.assemble) on ONE device with M members vmapped, and
its compiled train step (Adam) is timed on MNIST-1D-shaped inputs [B, 40, 1]: after
a warm-up, `--steps` steps, then a block. Repeats rotate the order; the median step
time and its ratio to the built-in MLP's are printed and written to
benchmarks/results/adapters.json.
"""

import argparse
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from dist_ens.run import mesh_layout
from dist_ens.run import assemble, initial_state
from dist_ens.config.loading import load_config
from dist_ens.core.model import Model

ROOT = Path(__file__).resolve().parents[1]
NUM_CLASSES = 10


def make_linen_mlp(widths):
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
      h = x.reshape(x.shape[0], -1)
      for w in widths:
        h = nn.relu(nn.Dense(w)(h))
      return nn.Dense(NUM_CLASSES)(h)

  return MLP()


def make_nnx_mlp(*, rngs, widths):
  from flax import nnx  # pylint: disable=import-outside-toplevel

  class MLP(nnx.Module):
    def __init__(self, rngs):
      sizes = (40, *widths, NUM_CLASSES)
      self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])

    def __call__(self, x):
      h = x.reshape(x.shape[0], -1)
      for layer in self.layers[:-1]:
        h = nnx.relu(layer(h))
      return self.layers[-1](h)

  return MLP(rngs)


def make_equinox_mlp(*, key, widths):
  import equinox as eqx  # pylint: disable=import-outside-toplevel

  class MLP(eqx.Module):
    layers: list

    def __init__(self, key):
      sizes = (40, *widths, NUM_CLASSES)
      keys = jax.random.split(key, len(sizes) - 1)
      self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)]

    def __call__(self, x, *, key=None):
      h = x.reshape(-1)
      for layer in self.layers[:-1]:
        h = jax.nn.relu(layer(h))
      return self.layers[-1](h)

  return MLP(key)


def make_haiku_mlp(widths):
  import haiku as hk  # pylint: disable=import-outside-toplevel

  def forward(x, is_training):
    del is_training
    return hk.nets.MLP((*widths, NUM_CLASSES))(hk.Flatten()(x))

  return hk.transform(forward)


def make_plain_mlp(widths):
  def init(rng, sample_x):
    sizes = (math.prod(sample_x.shape[1:]), *widths, NUM_CLASSES)
    keys = jax.random.split(rng, len(sizes) - 1)
    return [{'w': jax.random.normal(k, (a, b)) * math.sqrt(2 / a), 'b': jnp.zeros(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])], {}

  def apply(params, state, x, *, train, rng=None):
    del train, rng
    h = x.reshape(x.shape[0], -1)
    for layer in params[:-1]:
      h = jax.nn.relu(h @ layer['w'] + layer['b'])
    return h @ params[-1]['w'] + params[-1]['b'], state

  return Model(init, apply)


# row name -> config.model.factory ('' = the built-in config.model.name='mlp')
FACTORIES = {
    'builtin mlp': '',
    'flax linen': '__main__:make_linen_mlp',
    'flax nnx': '__main__:make_nnx_mlp',
    'equinox': '__main__:make_equinox_mlp',
    'haiku': '__main__:make_haiku_mlp',
    'plain Model': '__main__:make_plain_mlp',
}


def build(factory, args):
  """(step, state, hparams, x, y) of a one-device run of `factory`'s model."""
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members = args.members
  config.data.batch_size = args.batch
  config.model.widths = args.widths
  config.model.factory = factory
  if factory:
    config.model.kwargs.widths = args.widths
  device = jax.devices()[0]
  mesh = mesh_layout.build_mesh(config, [device])
  parts = assemble.build_parts(config, mesh, (40, 1), NUM_CLASSES)
  step = assemble.build_step(parts, per_member_batches=False, form=('vmap', None))
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.normal(size=(args.batch, 40, 1)).astype(np.float32), device)
  y = jax.device_put(rng.integers(0, NUM_CLASSES, args.batch).astype(np.int32), device)
  return step, initial_state.init_sharded(parts), parts.device_hparams(), x, y


def time_steps(built, steps):
  step, state, hparams, x, y = built
  for _ in range(3):
    state, metrics = step(state, hparams, x, y)
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, hparams, x, y)
  jax.block_until_ready((state, metrics))
  return (time.perf_counter() - start) / steps, (step, state, hparams, x, y)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--members', type=int, default=8)
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--widths', default='256,256')
  parser.add_argument('--steps', type=int, default=50)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'adapters.json'))
  args = parser.parse_args()
  header = harness.run_header()
  args.widths = tuple(int(w) for w in args.widths.split(','))
  built = {name: build(factory, args) for name, factory in FACTORIES.items()}
  seconds = {name: [] for name in FACTORIES}
  for _, name in harness.rotating_rounds(FACTORIES, args.repeats):
    s, built[name] = time_steps(built[name], args.steps)
    seconds[name].append(s)
  median = {name: statistics.median(v) for name, v in seconds.items()}
  base = median['builtin mlp']
  print(f'M={args.members}, batch {args.batch}, widths {args.widths}, one {jax.devices()[0].platform}'
        f' device, median of {args.repeats} x {args.steps} steps')
  print('| model | step ms | vs built-in |\n|---|---|---|')
  for name, s in median.items():
    print(f'| {name} | {s * 1e3:.3f} | {s / base:.3f} |')
  result = {**header, 'members': args.members, 'batch': args.batch, 'widths': list(args.widths),
            'platform': jax.devices()[0].platform, 'steps': args.steps, 'repeats': args.repeats,
            'step_seconds': median, 'ratio_to_builtin': {n: s / base for n, s in median.items()},
            'all_step_seconds': seconds, 'load_average_end': harness.load_average()}
  harness.write_results(args.out, result)


if __name__ == '__main__':
  main()
