"""Why the big MLP at M >= 16 runs slower as one program than as a Python loop on a CPU:
candidate one-program forms of a bare per-member Adam step, side by side.

  python -m benchmarks.big_mlp_forms                 # M=16, 5 rounds, ~3 min on 2 cores
  python -m benchmarks.big_mlp_forms --members 64 --rounds 3

The model is throughput.py's mlp_big (784-512-512-10, batch 128 per member, one shared
batch, Adam 1e-3), written here in plain JAX so that only the way members run differs:
  loop        a Python loop over members, each with its own jitted update (the baseline);
  vmap        jax.vmap of the update over the stacked members;
  map         lax.map over the members (a scan: member slices in, stacked results out);
  fori        lax.fori_loop over the members with the stacked state as the loop carry,
              each member read with a dynamic slice and written back with a dynamic
              update (optimization barriers around the member's update, which XLA:CPU
              drops), so that the donated state could be updated where it lies;
  in_place    dist_ens's 'map' (core.step.over_members with in_place=2): the
              same loop, each member's update inside a lax.cond that reads the
              member's slices itself, so that XLA computes the new state whole before
              writing it back (no whole-stack copies);
  cond_write  the same loop with the writes inside the cond too: its branch takes the
              whole stacked state and returns it with the member's new state written
              in (no separate write-back, if XLA updates the stack in place);
  unroll2     lax.map over pairs of members, the two written out side by side in the
              body (independent work XLA could overlap), not vmapped;
  vmap_bcast  vmap with a copy of the batch for every member (behind an optimization
              barrier, so that XLA keeps it): batched first-layer matmuls instead of
              the shared batch's wide one, and no transposed copy of the stacked kernel;
  vmap_w1t    vmap with the first layer's stacked kernel, and its Adam moments, stored
              in the [784, M, 512] layout the shared-batch matmul reads (jax Format /
              Layout on the jit's arguments and results).
Every form runs one step of all M members per call; each round times every form over
--steps calls in a rotating order; the medians are printed and written to
benchmarks/results/big_mlp_forms.json with the count of whole-stack copies in each
compiled program (copy instructions of an f32[M, 784, 512] array; one inside a loop body
runs once per iteration).
"""

import argparse
import os
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental.layout import Format, Layout
from jax.sharding import SingleDeviceSharding

from benchmarks import harness
from dist_ens.core.step import over_members

ROOT = Path(__file__).resolve().parents[1]
SIZES = (784, 512, 512, 10)
BATCH = 128
OPT = optax.adam(1e-3)


def init(key):
  params = []
  for a, b in zip(SIZES[:-1], SIZES[1:]):
    key, k = jax.random.split(key)
    params.append((jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b)))
  return params


def loss(params, x, y):
  h = x
  for i, (w, b) in enumerate(params):
    h = h @ w + b
    h = jax.nn.relu(h) if i < len(params) - 1 else h
  return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()


def update(params, opt_state, x, y):
  value, grads = jax.value_and_grad(loss)(params, x, y)
  updates, opt_state = OPT.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, value


def _fori(params, opt_state, x, y):
  members = jax.tree.leaves(params)[0].shape[0]

  def body(i, carry):
    p, o, values = carry
    take = lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
    put = lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, 0)
    mine = jax.lax.optimization_barrier((jax.tree.map(take, p), jax.tree.map(take, o)))
    new_p, new_o, value = jax.lax.optimization_barrier(update(*mine, x, y))
    return jax.tree.map(put, p, new_p), jax.tree.map(put, o, new_o), put(values, value)

  return jax.lax.fori_loop(0, members, body, (params, opt_state, jnp.zeros((members,))))


def _cond_write(params, opt_state, x, y):
  members = jax.tree.leaves(params)[0].shape[0]

  def body(i, carry):
    def write(carry):
      p, o, values = carry
      take = lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
      put = lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, 0)
      new_p, new_o, value = update(jax.tree.map(take, p), jax.tree.map(take, o), x, y)
      return jax.tree.map(put, p, new_p), jax.tree.map(put, o, new_o), put(values, value)
    return jax.lax.cond(i >= 0, write, lambda carry: carry, carry)

  return jax.lax.fori_loop(0, members, body, (params, opt_state, jnp.zeros((members,))))


def _unroll2(params, opt_state, x, y):
  members = jax.tree.leaves(params)[0].shape[0]
  pairs = lambda a: a.reshape(members // 2, 2, *a.shape[1:])

  def body(pair):
    p, o = pair
    outs = [update(jax.tree.map(lambda a: a[j], p), jax.tree.map(lambda a: a[j], o), x, y)
            for j in range(2)]
    return jax.tree.map(lambda *a: jnp.stack(a), *outs)

  out = jax.lax.map(body, (jax.tree.map(pairs, params), jax.tree.map(pairs, opt_state)))
  return jax.tree.map(lambda a: a.reshape(members, *a.shape[2:]), out)


def _vmap_bcast(params, opt_state, x, y):
  members = jax.tree.leaves(params)[0].shape[0]
  # Every member gets its own copy of the batch (the barrier keeps XLA from folding the
  # broadcast back into the shared-batch matmul): batched matmuls, no weight transposes.
  copies = jax.lax.optimization_barrier(jnp.broadcast_to(x, (members, *x.shape)))
  return jax.vmap(update, in_axes=(0, 0, 0, None))(params, opt_state, copies, y)


def programs(params, opt_state):
  """name -> (jitted step over stacked members, the formats to place the state in or None)."""
  vmapped = jax.vmap(update, in_axes=(0, 0, None, None))
  device = SingleDeviceSharding(jax.devices()[0])

  def layout(a):  # The first layer's [M, 784, 512] kernel (and moments) stored [784, M, 512].
    order = (1, 0, 2) if a.ndim == 3 and a.shape[1] == SIZES[0] else tuple(range(a.ndim))
    return Format(Layout(major_to_minor=order), device)

  formats = (jax.tree.map(layout, params), jax.tree.map(layout, opt_state))
  return {
      'vmap': (jax.jit(vmapped, donate_argnums=(0, 1)), None),
      'map': (jax.jit(lambda p, o, x, y: jax.lax.map(lambda m: update(*m, x, y), (p, o)),
                      donate_argnums=(0, 1)), None),
      'fori': (jax.jit(_fori, donate_argnums=(0, 1)), None),
      'in_place': (jax.jit(over_members(update, 'map', in_axes=(0, 0, None, None), in_place=2),
                           donate_argnums=(0, 1)), None),
      'cond_write': (jax.jit(_cond_write, donate_argnums=(0, 1)), None),
      'unroll2': (jax.jit(_unroll2, donate_argnums=(0, 1)), None),
      'vmap_bcast': (jax.jit(_vmap_bcast, donate_argnums=(0, 1)), None),
      'vmap_w1t': (jax.jit(vmapped, in_shardings=(*formats, device, device),
                           out_shardings=(*formats, device), donate_argnums=(0, 1)), formats),
  }


def whole_stack_copies(compiled, members: int) -> int:
  return len(re.findall(rf'f32\[{members},784,512\]\{{[^}}]*\}} copy\(', compiled.as_text()))


def build(members: int):
  """name -> run(steps): each form with its own copy of the same initial state."""
  params = jax.vmap(init)(jax.random.split(jax.random.key(0), members))
  opt_state = jax.vmap(OPT.init)(params)
  x = jax.random.normal(jax.random.key(1), (BATCH, SIZES[0]))
  y = jax.random.randint(jax.random.key(2), (BATCH,), 0, SIZES[-1])
  copy = lambda t: jax.tree.map(jnp.copy, t)
  runs, copies = {}, {}
  single = jax.jit(update, donate_argnums=(0, 1))
  loop_state = [[copy(jax.tree.map(lambda a: a[i], t)) for i in range(members)]
                for t in (params, opt_state)]

  def loop(steps):
    for _ in range(steps):
      out = [single(p, o, x, y) for p, o in zip(*loop_state)]
      loop_state[:] = [[r[0] for r in out], [r[1] for r in out]]
    jax.block_until_ready(loop_state)
  runs['loop'] = loop
  for name, (fn, formats) in programs(params, opt_state).items():
    state = [copy(params), copy(opt_state)]
    if formats is not None:
      state = [jax.device_put(s, f) for s, f in zip(state, formats)]
    compiled = fn.lower(*state, x, y).compile()
    copies[name] = whole_stack_copies(compiled, members)

    def run(steps, compiled=compiled, state=state):
      for _ in range(steps):
        state[0], state[1], _ = compiled(state[0], state[1], x, y)
      jax.block_until_ready(state)
    runs[name] = run
  for run in runs.values():
    run(1)  # Warm: the first call of each program.
  return runs, copies


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--members', type=int, default=16)
  parser.add_argument('--steps', type=int, default=4, help='calls per timing')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'big_mlp_forms.json'))
  args = parser.parse_args()
  header = harness.run_header()
  runs, copies = build(args.members)
  rates = {name: [] for name in runs}
  for _, name in harness.rotating_rounds(runs, args.rounds):
    start = time.perf_counter()
    runs[name](args.steps)
    rates[name].append(args.members * BATCH * args.steps / (time.perf_counter() - start))
  medians = {name: statistics.median(v) for name, v in rates.items()}
  print(f'mlp_big, M={args.members}, {args.rounds} rounds; member-examples/s, x the loop, '
        f'whole-stack copy instructions in the program')
  for name, rate in medians.items():
    print(f'{name:9s} {rate:9,.0f} {rate / medians["loop"]:6.2f}  {copies.get(name, "-")}')
  harness.write_results(args.out, dict(
      header, jax=jax.__version__, device=str(jax.devices()[0].device_kind),
      members=args.members, rounds=args.rounds, steps=args.steps,
      xla_flags=os.environ.get('XLA_FLAGS', ''), rates=rates, medians=medians,
      whole_stack_copies=copies, load_average_end=harness.load_average()))
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
