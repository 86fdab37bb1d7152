"""Whole dist_ens runs against a Python loop of per-member steps, on one CPU device.

  python -m benchmarks.run_vs_loop                     # M=16, 3 rounds, ~15 min on 2 cores
  python -m benchmarks.run_vs_loop --members 16,64 --rounds 3

What the README's speed limitation states. The model: configs/default.py's MLP made wide,
40-1024-1024-10 (MNIST-1D), batch 128 per member, Adam; everything on jax.devices()[:1].
Each round times, in a rotating order:
  run   dist_ens's marginal step time: two whole `dist_ens.train` calls of --short and
        --short + --extra steps (compile, the final evaluation and checkpoint included in
        both, so they cancel), (t_long - t_short) / extra. The input pipeline, logging,
        and the loop's bookkeeping are in it, as in a user's run.
  loop  a Python loop over members, each with its own jitted optax Adam update of a plain
        JAX MLP of the same shapes, on batches already on the device (one shared batch a
        step, as data.member_order='shared'), --extra steps after a warm-up, blocking once
        at the end: the fastest way to train M members without dist_ens.
The ratio loop / run (> 1: dist_ens's whole run is faster) of every round, its median, and
the load average and the cores other processes kept busy during each measurement go to
benchmarks/results/run_vs_loop.json (--out to change).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dist_ens
from benchmarks import harness, overhead
from dist_ens.run.run_data import build_data

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = (1024, 1024)
LOOP_BATCHES = 16  # distinct device-resident batches the loop cycles through


def make_config(members: int, steps: int) -> Any:
  """configs/default.py with the wide MLP, M members, `steps` steps, evaluation and a
  checkpoint at the end only."""
  config = overhead.make_config(members, steps, {})
  config.model.widths = WIDTHS
  return config


def time_run(members: int, steps: int) -> float:
  """Seconds of one whole dist_ens.train of `steps` steps (compile included)."""
  config = make_config(members, steps)
  with tempfile.TemporaryDirectory(prefix='run_vs_loop_') as workdir:
    start = time.perf_counter()
    dist_ens.train(config, workdir, devices=jax.devices()[:1])
    return time.perf_counter() - start


def _mlp_init(key: jax.Array, sizes: tuple[int, ...]) -> list[tuple[jax.Array, jax.Array]]:
  keys = jax.random.split(key, len(sizes) - 1)
  return [(jax.random.normal(k, (a, b)) * np.sqrt(2.0 / a), jnp.zeros(b))
          for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def _mlp_loss(params: list[tuple[jax.Array, jax.Array]], x: jax.Array, y: jax.Array
              ) -> jax.Array:
  h = x.reshape(x.shape[0], -1)
  for w, b in params[:-1]:
    h = jax.nn.relu(h @ w + b)
  w, b = params[-1]
  return optax.softmax_cross_entropy_with_integer_labels(h @ w + b, y).mean()


class Loop:
  """M plain JAX members, each updated by its own call of one jitted Adam step."""

  def __init__(self, members: int):
    config = make_config(members, 1)
    dataset = build_data(config).dataset
    sizes = (int(np.prod(dataset.input_shape)), *WIDTHS, dataset.num_classes)
    self.tx = optax.adam(1e-3)
    device = jax.devices()[0]
    self.params = [jax.device_put(_mlp_init(jax.random.key(m), sizes), device)
                   for m in range(members)]
    self.opt = [self.tx.init(p) for p in self.params]
    rows = np.random.default_rng(0).permutation(len(dataset.train.y))
    batch = config.data.batch_size
    self.batches = [jax.device_put((dataset.train.x[rows[i * batch:(i + 1) * batch]],
                                    dataset.train.y[rows[i * batch:(i + 1) * batch]]), device)
                    for i in range(LOOP_BATCHES)]

    @jax.jit
    def step(params, opt_state, x, y):
      grads = jax.grad(_mlp_loss)(params, x, y)
      updates, opt_state = self.tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    self.step = step
    self.time(2)  # compile and warm up

  def time(self, steps: int) -> float:
    """Seconds for `steps` steps of every member, blocking once at the end."""
    jax.block_until_ready((self.params, self.opt))
    start = time.perf_counter()
    for s in range(steps):
      x, y = self.batches[s % LOOP_BATCHES]
      for m, (params, opt) in enumerate(zip(self.params, self.opt)):
        self.params[m], self.opt[m] = self.step(params, opt, x, y)
    jax.block_until_ready((self.params, self.opt))
    return time.perf_counter() - start


def measured(fn, *args) -> dict[str, Any]:
  """fn(*args) -> seconds, with the load average before and the cores other processes
  kept busy meanwhile."""
  load, busy = harness.load_average(), overhead.machine_busy()
  seconds = fn(*args)
  return {'seconds': seconds, 'load_average': load,
          'foreign_cores': overhead.foreign_cores(busy, overhead.machine_busy())}


def one_round(members: int, loop: Loop, args: argparse.Namespace, order: int
              ) -> dict[str, Any]:
  parts = {'short': lambda: measured(time_run, members, args.short),
           'long': lambda: measured(time_run, members, args.short + args.extra),
           'loop': lambda: measured(loop.time, args.extra)}
  names = list(parts)[order % 3:] + list(parts)[:order % 3]  # a rotating order
  row = {name: parts[name]() for name in names}
  run_step = (row['long']['seconds'] - row['short']['seconds']) / args.extra
  loop_step = row['loop']['seconds'] / args.extra
  row.update(order=names, run_step_s=run_step, loop_step_s=loop_step,
             loop_over_run=loop_step / run_step)
  print(f'M={members} round {order}: run {run_step * 1e3:.1f} ms/step, loop '
        f'{loop_step * 1e3:.1f} ms/step, loop/run {loop_step / run_step:.3f}, load '
        f'{row["short"]["load_average"][:1]}', flush=True)
  return row


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--members', default='16', help='comma-separated M')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--short', type=int, default=50, help='steps of the shorter run')
  parser.add_argument('--extra', type=int, default=400, help='steps the longer run adds')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'run_vs_loop.json'))
  args = parser.parse_args(argv)
  header = harness.run_header(argv)
  rows = []
  for members in (int(m) for m in args.members.split(',')):
    loop = Loop(members)
    rounds = [one_round(members, loop, args, r) for r in range(args.rounds)]
    ratios = [r['loop_over_run'] for r in rounds]
    rows.append({'members': members, 'widths': WIDTHS, 'rounds': rounds,
                 'loop_over_run_median': statistics.median(ratios),
                 'loop_over_run_range': [min(ratios), max(ratios)]})
    print(f'M={members}: whole run at {statistics.median(ratios):.2f}x the loop\'s speed '
          f'(rounds {min(ratios):.2f}-{max(ratios):.2f})', flush=True)
  harness.write_results(args.out, {**header, 'short': args.short, 'extra': args.extra,
                                   'rows': rows, 'load_average_end': harness.load_average()})


if __name__ == '__main__':
  main()
