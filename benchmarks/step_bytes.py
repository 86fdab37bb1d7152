"""Where the wide MLP's step loses to the donating loop: memory traffic, from XLA's own count.

  python -m benchmarks.step_bytes                      # M = 4 and 16, one CPU device
  python -m benchmarks.step_bytes --members 4,16,64 --out PATH
  python -m benchmarks.step_bytes --candidate PATH/TO/step.py --out PATH   # a changed copy of core/step.py

benchmarks/run_vs_loop.py times dist_ens's step ('bare') at about 0.8x a Python loop of
per-member jitted Adam steps that donate their buffers ('donate'), on the same wide MLP
(40-1024-1024-10, batch 128, one device). This script says where that goes without timing
anything, so the figures do not move with the machine's load: it compiles both programs
and reads XLA's cost analysis (`compiled.cost_analysis()`: FLOPs and bytes accessed,
counted over the optimized program; a loop's body is counted once).
  donate  one member's step of the donating loop: what a member step must read and write.
  map     dist_ens's step in the form 'auto' picks on this CPU for members this size
          ('map': a loop over the members inside the program, core/step.py
          _member_loop), built as a run builds it (benchmarks.overhead.Bare). Its body is
          one member's step, counted once, so its figures compare with donate's per member
          (the script checks that they do not grow with M).
  vmap    the same step with every member at once (ensemble.member_parallelism='vmap'), its
          figures divided by M.
--candidate counts a changed copy of dist_ens/core/step.py instead of the installed one
(benchmarks/throughput.py's load_candidate; 'map' and 'vmap' both built with it).
It also writes the bytes of one member's state that a step replaces (parameters and Adam's
two moments), the unit the difference is counted in. Writes
benchmarks/results/step_bytes.json (--out to change).
"""

import argparse
from typing import Any
from unittest import mock

import jax
import numpy as np

from benchmarks import harness, overhead, run_vs_loop, throughput
from dist_ens.run import assemble

ROOT = harness.ROOT
MB = 1e6


def _costs(compiled: Any) -> dict[str, float]:
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return {'flops': float(analysis['flops']), 'bytes': float(analysis['bytes accessed'])}


def dist_ens_step(members: int, form: str, step_module: Any = None) -> dict[str, Any]:
  """XLA's counts for dist_ens's compiled step of `members` wide MLPs in `form` (with
  `step_module`'s make_train_step: a candidate, see throughput.load_candidate)."""
  config = run_vs_loop.make_config(members, 1)
  if form != 'auto':
    config.ensemble.member_parallelism = form
  if step_module is None:
    bare = overhead.Bare(config)
  else:
    with mock.patch.object(assemble, 'make_train_step', step_module.make_train_step):
      bare = overhead.Bare(config)
  lowered = bare.step.fn.lower(bare.state, bare.hparams, *bare.batches[0])
  costs = _costs(lowered.compile())
  params = bare.state.params
  member_bytes = sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize
                     for a in jax.tree.leaves(params))
  return {'form': list(bare.form) if isinstance(bare.form, tuple) else bare.form,
          **costs, 'param_bytes_per_member': member_bytes}


def donating_step(members: int) -> dict[str, float]:
  """XLA's counts for one call of the donating loop's per-member step."""
  loop = run_vs_loop.Loop(members, donate=True)
  x, y = loop.batches[0]
  return _costs(loop.step.lower(loop.params[0], loop.opt[0], x, y).compile())


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--members', default='4,16')
  parser.add_argument('--candidate', default='', help='count a changed copy of '
                      'dist_ens/core/step.py instead (see benchmarks/throughput.py)')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'step_bytes.json'))
  args = parser.parse_args(argv)
  candidate = throughput.load_candidate(args.candidate) if args.candidate else None
  header = harness.run_header()
  rows = []
  for members in [int(m) for m in args.members.split(',')]:
    donate = donating_step(members)
    mapped = dist_ens_step(members, 'auto', candidate)
    vmapped = dist_ens_step(members, 'vmap', candidate)
    state = 3 * mapped['param_bytes_per_member']  # parameters, Adam's mu and nu
    row = {'members': members, 'widths': run_vs_loop.WIDTHS,
           'state_bytes_per_member': state,
           'donate': donate, 'map': mapped,
           'vmap_per_member': {k: vmapped[k] / members for k in ('flops', 'bytes')},
           'map_over_donate_bytes': mapped['bytes'] / donate['bytes'],
           'map_extra_bytes_in_states': (mapped['bytes'] - donate['bytes']) / state}
    rows.append(row)
    print(f"M={members:3d}  per member step: donate {donate['flops'] / 1e6:7.1f} MFLOP "
          f"{donate['bytes'] / MB:6.1f} MB | {mapped['form']} {mapped['flops'] / 1e6:7.1f} "
          f"MFLOP {mapped['bytes'] / MB:6.1f} MB ({row['map_over_donate_bytes']:.2f}x, "
          f"+{row['map_extra_bytes_in_states']:.1f} states of {state / MB:.1f} MB) | vmap "
          f"{row['vmap_per_member']['flops'] / 1e6:7.1f} MFLOP "
          f"{row['vmap_per_member']['bytes'] / MB:6.1f} MB", flush=True)
  path = harness.write_results(args.out, {**header, 'device': jax.devices()[0].platform,
                                          'jax': jax.__version__,
                                          'candidate': args.candidate or None, 'rows': rows})
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
