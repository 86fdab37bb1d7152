"""Whole dist_ens runs against the fastest Python loop of per-member steps, on one CPU device.

  python -m benchmarks.run_vs_loop                     # M=16, 6 rounds, ~17 min on 2 busy cores
  python -m benchmarks.run_vs_loop --members 16,64 --rounds 3

What the README's speed claim states. The model: configs/default.py's MLP made wide,
40-1024-1024-10 (MNIST-1D), batch 128 per member, Adam; everything on jax.devices()[:1].
Each round times every side once, in an order that rotates from round to round (so a change
in the machine's load hits every side alike):
  run     dist_ens's marginal step time: two whole `dist_ens.train` calls of --short and
          --short + --extra steps (compile, the final evaluation and checkpoint included in
          both, so they cancel), (t_long - t_short) / extra. The input pipeline, logging,
          and the loop's bookkeeping are in it, as in a user's run. The long run carries
          benchmarks.overhead.Timer, which blocks twice and records the CPU each thread
          group spent per step (main, input pipeline, XLA's pool) and the host's gaps;
          its ms/step over steps (short, short + extra] is `run_steady` (the run's steady
          state, without what the marginal method charges to the extra steps).
  donate  the anchor: a Python loop over members, each updated by a call of ONE jitted
          optax Adam step of a plain JAX MLP of the same shapes that donates its params
          and optimizer state (donate_argnums=(0, 1): XLA writes the new values into the
          old buffers, no allocation or copy a step), on batches already on the device (one
          shared batch a step, as data.member_order='shared'), --extra steps after a
          warm-up, no host sync inside the loop, blocking once at the end: the fastest way
          to train M members without dist_ens that we know.
  loop    the same loop with a step that does not donate (this benchmark's anchor before
          issue 65), kept so the change of anchor shows.
  bare    dist_ens's own compiled step (benchmarks.overhead.Bare: the step a run builds,
          donating its state) in the same bare loop on device-resident batches, --extra
          steps: run / bare is the host's share (input pipeline, bookkeeping, logging),
          bare / donate the step's own.
Ratios are speeds (> 1: the first is faster): run/donate, run/loop, run/bare,
bare/donate, loop/donate of every round, and their medians (the median of the per-round
ratios). The load average at the start and end and before each measurement, and the cores
other processes kept busy during each, go to benchmarks/results/run_vs_loop.json (--out to
change); the markdown table for BENCHMARKS.md is printed at the end (--table A.json,B.json
prints it again from results files, their rounds pooled).
"""

import argparse
import json
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
LOOP_BATCHES = 16  # distinct device-resident batches the loops cycle through
SIDES = ('short', 'long', 'donate', 'loop', 'bare')
# Speed ratios reported per round, a over b: speed_a / speed_b = (ms/step of b) / (of a),
# > 1 where a is faster.
RATIOS = (('run', 'donate'), ('run', 'loop'), ('run', 'bare'), ('bare', 'donate'),
          ('loop', 'donate'), ('run_steady', 'donate'))


def make_config(members: int, steps: int) -> Any:
  """configs/default.py with the wide MLP, M members, `steps` steps, evaluation and a
  checkpoint at the end only."""
  config = overhead.make_config(members, steps, {})
  config.model.widths = WIDTHS
  return config


def time_run(members: int, steps: int, warmup: int | None = None) -> dict[str, Any]:
  """Seconds of one whole dist_ens.train of `steps` steps (compile included); with
  `warmup`, what an overhead.Timer saw over steps (warmup, steps]."""
  config = make_config(members, steps)
  timer = overhead.Timer(warmup) if warmup is not None else None
  with tempfile.TemporaryDirectory(prefix='run_vs_loop_') as workdir:
    start = time.perf_counter()
    dist_ens.train(config, workdir, devices=jax.devices()[:1],
                   actions=[timer] if timer else ())
    seconds = time.perf_counter() - start
  out: dict[str, Any] = {'seconds': seconds}
  if timer is not None:
    gaps = np.asarray(timer.gaps)
    timed = steps - timer.first
    examples, busy = timer.pipeline
    out['timer'] = dict(
        steps=timed, ms_per_step=1e3 * (timer.end - timer.start) / timed,
        steps_per_call=timer.steps_per_call, cpu_ms_per_step=timer.cpu,
        host_gap_median_ms=1e3 * float(np.median(gaps)),
        pipeline_ms_per_step=1e3 * busy / timed)
  return out


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
  """M plain JAX members, each updated by its own call of ONE jitted Adam step (compiled
  once, reused for every member); `donate` donates params and optimizer state."""

  def __init__(self, members: int, donate: bool):
    config = make_config(members, 1)
    dataset = build_data(config).dataset
    sizes = (int(np.prod(dataset.input_shape)), *WIDTHS, dataset.num_classes)
    self.tx = tx = optax.adam(1e-3)
    device = jax.devices()[0]
    self.params = [jax.device_put(_mlp_init(jax.random.key(m), sizes), device)
                   for m in range(members)]
    self.opt = [jax.device_put(tx.init(p), device) for p in self.params]
    train = dataset.train  # a host Source, or a ResidentSource wrapping one; both read()
    rows = np.random.default_rng(0).permutation(train.num_examples)
    batch = config.data.batch_size
    self.batches = [jax.device_put(train.read(rows[i * batch:(i + 1) * batch]), device)
                    for i in range(LOOP_BATCHES)]

    def step(params, opt_state, x, y):
      grads = jax.grad(_mlp_loss)(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    self.step = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    self.time(2)  # compile and warm up

  def time(self, steps: int) -> float:
    """Seconds for `steps` steps of every member, blocking once at the end."""
    params, opt, batches, step = self.params, self.opt, self.batches, self.step
    members = range(len(params))
    jax.block_until_ready((params, opt))
    start = time.perf_counter()
    for s in range(steps):
      x, y = batches[s % LOOP_BATCHES]
      for m in members:
        params[m], opt[m] = step(params[m], opt[m], x, y)
    jax.block_until_ready((params, opt))
    return time.perf_counter() - start


def measured(fn, *args) -> dict[str, Any]:
  """fn(*args) -> seconds (or a dict with 'seconds'), with the load average before and the
  cores other processes kept busy meanwhile."""
  load, busy = harness.load_average(), overhead.machine_busy()
  result = fn(*args)
  result = result if isinstance(result, dict) else {'seconds': result}
  return {**result, 'load_average': load,
          'foreign_cores': overhead.foreign_cores(busy, overhead.machine_busy())}


def one_round(members: int, sides: dict[str, Any], args: argparse.Namespace, order: int
              ) -> dict[str, Any]:
  extra = args.extra
  parts = {'short': lambda: measured(time_run, members, args.short),
           'long': lambda: measured(time_run, members, args.short + extra, args.short),
           'donate': lambda: measured(sides['donate'].time, extra),
           'loop': lambda: measured(sides['loop'].time, extra),
           'bare': lambda: measured(lambda: sides['bare'].time(extra)['rate'])}
  names = list(SIDES[order % len(SIDES):] + SIDES[:order % len(SIDES)])  # a rotating order
  row = {name: parts[name]() for name in names}
  # Bare.time gives member-examples/s; turned into seconds for the same steps.
  row['bare']['seconds'] = sides['bare'].examples_per_step * extra / row['bare']['seconds']
  ms = {'run': 1e3 * (row['long']['seconds'] - row['short']['seconds']) / extra,
        'run_steady': row['long']['timer']['ms_per_step'],
        **{k: 1e3 * row[k]['seconds'] / extra for k in ('donate', 'loop', 'bare')}}
  speed = {f'{a}_over_{b}': ms[b] / ms[a] for a, b in RATIOS}
  row.update(order=names, ms_per_step=ms, speed=speed)
  print(f'M={members} round {order} ({", ".join(names)}): ms/step '
        + ', '.join(f'{k} {v:.1f}' for k, v in ms.items())
        + '; speed ' + ', '.join(f'{k} {v:.3f}' for k, v in speed.items())
      + f'; load {row[names[0]]["load_average"][:1]}, other processes\' cores '
      + str([row[n]['foreign_cores'] for n in names]), flush=True)
  return row


def summary(rounds: list[dict]) -> dict[str, Any]:
  """Medians and ranges over rounds of each ms/step and each per-round speed ratio."""
  out = {}
  for key in ('ms_per_step', 'speed'):
    for name in rounds[0][key]:
      values = [r[key][name] for r in rounds]
      out[f'{key}.{name}'] = {'median': statistics.median(values),
                              'range': [min(values), max(values)]}
  return out


# Which measurements each side's ms/step comes from.
PARTS = {'run': ('short', 'long'), 'run_steady': ('long',), 'donate': ('donate',),
         'loop': ('loop',), 'bare': ('bare',)}


def clean_medians(rounds: list[dict]) -> dict[str, Any]:
  """For each speed ratio a/b, the median over the rounds in which other processes kept
  fewer than overhead.CLEAN_CORES cores busy during every measurement of a and of b (the
  machine idle but for this benchmark), and how many rounds those were."""
  out = {}
  for a, b in RATIOS:
    values = [r['speed'][f'{a}_over_{b}'] for r in rounds
              if all(r[p]['foreign_cores'] < overhead.CLEAN_CORES for p in PARTS[a] + PARTS[b])]
    out[f'{a}_over_{b}'] = {'rounds': len(values),
                            'median': statistics.median(values) if values else None}
  return out


def table(files: list[dict[str, Any]]) -> str:
  """BENCHMARKS.md's table of one or more results files: one line per round (ms/step of
  each side, the speed ratios, the load), then per M the medians of the per-round figures
  over all the files' rounds, the same over the clean rounds, and the long runs' CPU per
  step of each thread group (where the run's time goes)."""
  sides = ('run', 'run_steady', 'donate', 'loop', 'bare')
  head = ('| M | file | round | order | run | run, steady | donate | loop | bare '
          '| run / donate | run / loop | run / bare | bare / donate | loop / donate '
          '| load (1 min) | others\' cores |')
  lines = [head, '|' + '---|' * 4 + '---:|' * 12]
  pooled: dict[int, list[dict]] = {}
  for f, results in enumerate(files):
    for row in results['rows']:
      pooled.setdefault(row['members'], []).extend(row['rounds'])
      for i, r in enumerate(row['rounds']):
        ms, sp = r['ms_per_step'], r['speed']
        others = [r[n]['foreign_cores'] for n in r['order']]
        lines.append(
            f'| {row["members"]} | {f} | {i} | {", ".join(r["order"])} | '
            + ' | '.join(f'{ms[k]:.1f}' for k in sides)
            + ' | ' + ' | '.join(f'{sp[f"{a}_over_{b}"]:.3f}' for a, b in RATIOS[:5])
            + f' | {r[r["order"][0]]["load_average"][0]:.2f} '
            f'| {min(others):.2f}-{max(others):.2f} |')
  for members, rounds in pooled.items():
    st = summary(rounds)
    lines.append(
        f'| {members} | all | **median** | | '
        + ' | '.join(f'**{st[f"ms_per_step.{k}"]["median"]:.1f}**' for k in sides)
        + ' | ' + ' | '.join(f'**{st[f"speed.{a}_over_{b}"]["median"]:.3f}**'
                             for a, b in RATIOS[:5]) + ' | | |')
  for members, rounds in pooled.items():
    st, clean = summary(rounds), clean_medians(rounds)
    lines.append(f'\nM={members}, {len(rounds)} rounds: medians of the per-round speed '
                 f'ratios, all rounds (range) / clean rounds (other processes < '
                 f'{overhead.CLEAN_CORES} cores during both sides):')
    for a, b in RATIOS:
      c, m = clean[f'{a}_over_{b}'], st[f'speed.{a}_over_{b}']
      lines.append(f'  {a} / {b}: {m["median"]:.3f} ({m["range"][0]:.3f}-{m["range"][1]:.3f})'
                   ' / ' + (f'{c["median"]:.3f} ({c["rounds"]} clean)' if c['rounds']
                            else 'none clean'))
    cpu: dict[str, list[float]] = {}
    for r in rounds:
      for k, v in r['long']['timer']['cpu_ms_per_step'].items():
        cpu.setdefault(k, []).append(v)
    gaps = [r['long']['timer']['host_gap_median_ms'] for r in rounds]
    lines.append('  long runs, CPU ms per step by thread group (median): '
                 + ', '.join(f'{k} {statistics.median(v):.2f}' for k, v in cpu.items())
                 + '; host gap between calls (median of medians) '
                 + f'{statistics.median(gaps):.1f} ms; steps per call '
                 + str(sorted({r['long']['timer']['steps_per_call'] for r in rounds})))
  for f, results in enumerate(files):
    lines.append(f'file {f}: {results["date"]}, commit {results["commit"][:7]}'
                 f'{" (dirty)" if results["dirty"] else ""}, load average at start '
                 f'{results["load_average_start"]}, at end {results["load_average_end"]}')
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--members', default='16', help='comma-separated M')
  parser.add_argument('--rounds', type=int, default=6)
  parser.add_argument('--short', type=int, default=50, help='steps of the shorter run')
  parser.add_argument('--extra', type=int, default=150, help='steps the longer run adds')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'run_vs_loop.json'))
  parser.add_argument('--table', metavar='JSON[,JSON...]',
                      help='print the markdown table of existing results files and exit')
  args = parser.parse_args(argv)
  if args.table:
    print(table([json.loads(Path(p).read_text()) for p in args.table.split(',')]))
    return
  header = harness.run_header(argv)
  print(f'load average at start {header["load_average_start"]} on '
        f'{header["machine"]["cores"]} cores', flush=True)
  rows = []
  for members in (int(m) for m in args.members.split(',')):
    sides = {'donate': Loop(members, donate=True), 'loop': Loop(members, donate=False),
             'bare': overhead.Bare(make_config(members, args.short + args.extra))}
    rounds = [one_round(members, sides, args, r) for r in range(args.rounds)]
    stats = summary(rounds)
    rows.append({'members': members, 'widths': WIDTHS, 'rounds': rounds, 'summary': stats})
    print(f'M={members}: medians of {args.rounds} rounds (speed ratios, per round):')
    for a, b in RATIOS:
      s = stats[f'speed.{a}_over_{b}']
      print(f'  {a} at {s["median"]:.3f}x {b}\'s speed '
            f'(rounds {s["range"][0]:.3f}-{s["range"][1]:.3f})', flush=True)
  end = harness.load_average()
  print(f'load average at end {end}', flush=True)
  results = {**header, 'short': args.short, 'extra': args.extra, 'rows': rows,
             'load_average_end': end}
  harness.write_results(args.out, results)
  print(table([results]), flush=True)


if __name__ == '__main__':
  main()
