"""XLA:CPU's batched matmuls against the same products as single matmuls: the big MLP's
(784-512-512-10, batch 128) dots for M members, one program each, side by side.

  python -m benchmarks.batched_dots              # M=16, ~1 min on 2 cores
  python -m benchmarks.batched_dots --members 64

Each batched case is one jitted program over all M members (jax.vmap of the product, as
dist_ens's vmapped step holds it); each single case is one member's product, timed and
multiplied by M (what a Python loop over members runs). Every case is timed over --calls
calls in --rounds rotating rounds (medians). Writes benchmarks/results/batched_dots.json.
"""

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
BATCH = 128


def cases(members: int) -> dict[str, tuple]:
  """name -> (batched program and arguments, single program and arguments)."""
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (BATCH, 784))
  w1 = jax.random.normal(k[1], (members, 784, 512))
  w2 = jax.random.normal(k[2], (members, 512, 512))
  h = jax.random.normal(k[3], (members, BATCH, 512))
  xs = jnp.broadcast_to(x, (members, *x.shape)) + 0  # A copy per member.
  fwd, dw, dh = (lambda w, a: a @ w), (lambda g, a: a.T @ g), (lambda w, g: g @ w.T)
  return {
      'layer 1 forward, shared batch': ((jax.jit(jax.vmap(fwd, (0, None))), w1, x),
                                        (jax.jit(fwd), w1[0], x)),
      'layer 1 forward, batch per member': ((jax.jit(jax.vmap(fwd)), w1, xs),
                                            (jax.jit(fwd), w1[0], x)),
      'layer 1 kernel gradient, shared batch': ((jax.jit(jax.vmap(dw, (0, None))), h, x),
                                                (jax.jit(dw), h[0], x)),
      'layer 1 kernel gradient, batch per member': ((jax.jit(jax.vmap(dw)), h, xs),
                                                    (jax.jit(dw), h[0], x)),
      'layer 2 forward': ((jax.jit(jax.vmap(fwd)), w2, h), (jax.jit(fwd), w2[0], h[0])),
      'layer 2 kernel gradient': ((jax.jit(jax.vmap(dw)), h, h), (jax.jit(dw), h[0], h[0])),
      'layer 2 input gradient': ((jax.jit(jax.vmap(dh)), w2, h), (jax.jit(dh), w2[0], h[0])),
  }


def seconds(fn, args, calls: int) -> float:
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--members', type=int, default=16)
  parser.add_argument('--calls', type=int, default=10)
  parser.add_argument('--rounds', type=int, default=7)
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'batched_dots.json'))
  args = parser.parse_args()
  header = harness.run_header()
  timed = {f'{name}|{kind}': program for name, pair in cases(args.members).items()
           for kind, program in zip(('batched', 'single'), pair)}
  for fn, *fn_args in timed.values():
    jax.block_until_ready(fn(*fn_args))  # Compile outside the timing.
  times = {key: [] for key in timed}
  for _, key in harness.rotating_rounds(timed, args.rounds):
    fn, *fn_args = timed[key]
    times[key].append(seconds(fn, fn_args, args.calls))
  ms = {key: 1e3 * statistics.median(v) for key, v in times.items()}
  print(f'M={args.members}, ms per call (single: one member x M), medians of {args.rounds}')
  rows = []
  for name in cases(args.members):
    batched, single = ms[f'{name}|batched'], ms[f'{name}|single'] * args.members
    rows.append(dict(product=name, batched_ms=batched, single_times_m_ms=single,
                     batched_over_single=batched / single))
    print(f'{name:44s} {batched:8.2f} {single:8.2f}  {batched / single:5.2f}x')
  harness.write_results(args.out, dict(
      header, jax=jax.__version__, device=str(jax.devices()[0].device_kind),
      members=args.members, calls=args.calls, rounds=args.rounds, rows=rows, times=times,
      load_average_end=harness.load_average()))
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
