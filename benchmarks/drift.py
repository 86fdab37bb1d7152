"""How far the same members drift apart when only the mesh or M changes, over a full run.

  python -m benchmarks.drift                  # default mode: 3 full default runs (~10 min)
  python -m benchmarks.drift --reproducible   # and the same 3 with config.reproducible=True

Trains configs/default.py (2,000 steps, 8 MLP members on MNIST-1D) three times with the
dist-ens command, each in its own process:
  1x1 M=8   one device (the README's default run);
  8x1 M=8   eight fake CPU devices, one member each: only the member split changes;
  1x1 M=3   one device, three members: members 0-2 are the same members (same seed,
            same shared batch order), only M changes.
and compares members 0-2 (or all 8 where both runs have them): the largest parameter
difference, the largest difference of a member's test NLL and accuracy, and the
ensemble's test accuracy and NLL. --reproducible repeats the three runs in
reproducible mode (members one at a time, micro-batches summed in a fixed order, its
XLA flags), where every difference should be exactly 0.

Prints a table and writes benchmarks/results/drift.json.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import harness

ROOT = harness.ROOT
RUNS = {'1x1 M=8': (8, 1, 1), '8x1 M=8': (8, 8, 8), '1x1 M=3': (3, 1, 1)}
PAIRS = (('1x1 M=8', '8x1 M=8', 8), ('1x1 M=8', '1x1 M=3', 3))


def _train(workdir: Path, members: int, member_axis: int, devices: int, reproducible: bool,
           extra: list[str]) -> None:
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={devices}'
  env['JAX_PLATFORMS'] = 'cpu'
  cmd = [sys.executable, '-m', 'dist_ens.main', f'--config={ROOT / "configs" / "default.py"}',
         f'--workdir={workdir}', f'--config.num_members={members}',
         f'--config.mesh.member={member_axis}', '--config.mesh.data=1',
         f'--config.reproducible={reproducible}', *extra]
  subprocess.run(cmd, env=env, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL, timeout=3600)


def _compare(a: Path, b: Path, count: int) -> dict:
  import jax
  import numpy as np
  import dist_ens
  params = [jax.tree.leaves(dist_ens.Ensemble.load(w, devices=jax.devices()[:1]).params)
            for w in (a, b)]
  finals = [json.loads((w / 'final_metrics.json').read_text()) for w in (a, b)]
  member = lambda f, k: np.asarray(f['members'][k][:count])  # noqa: E731
  return {
      'members_compared': count,
      'max_param_diff': max(float(np.max(np.abs(np.asarray(x)[:count] - np.asarray(y)[:count])))
                            for x, y in zip(*params)),
      'max_member_nll_diff': float(np.max(np.abs(member(finals[0], 'nll') -
                                                 member(finals[1], 'nll')))),
      'max_member_accuracy_diff': float(np.max(np.abs(member(finals[0], 'accuracy') -
                                                      member(finals[1], 'accuracy')))),
      'ensemble_accuracy': [f['ensemble']['accuracy'] for f in finals],
      'ensemble_nll': [f['ensemble']['nll'] for f in finals],
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--reproducible', action='store_true', help='also reproducible mode')
  parser.add_argument('--steps', type=int, default=0, help='train.steps (default: the config)')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'drift.json'))
  args = parser.parse_args(argv)
  header = harness.run_header()
  extra = ["--config.writers=('jsonl',)"]
  if args.steps:
    extra += [f'--config.train.steps={args.steps}', f'--config.train.log_every={args.steps}',
              '--config.train.eval_every=0', f'--config.checkpoint.every={args.steps}']
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for reproducible in (False, True) if args.reproducible else (False,):
      mode = 'reproducible' if reproducible else 'default'
      for name, (members, member_axis, devices) in RUNS.items():
        print(f'training {mode} {name} ...', flush=True)
        _train(Path(tmp) / f'{mode} {name}', members, member_axis, devices, reproducible, extra)
      for a, b, count in PAIRS:
        rows.append({'mode': mode, 'a': a, 'b': b,
                     **_compare(Path(tmp) / f'{mode} {a}', Path(tmp) / f'{mode} {b}', count)})
  harness.write_results(args.out, {**header, 'config': 'configs/default.py',
                                   'steps': args.steps or 2000, 'rows': rows,
                                   'load_average_end': harness.load_average()})
  print('| mode | runs compared | members | max param diff | max member NLL diff | '
        'max member acc diff | ensemble acc | ensemble NLL |')
  print('|---|---|---:|---:|---:|---:|---|---|')
  for r in rows:
    print(f"| {r['mode']} | {r['a']} vs {r['b']} | {r['members_compared']} | "
          f"{r['max_param_diff']:.2g} | {r['max_member_nll_diff']:.2g} | "
          f"{r['max_member_accuracy_diff']:.3g} | {r['ensemble_accuracy'][0]:.4f} vs "
          f"{r['ensemble_accuracy'][1]:.4f} | {r['ensemble_nll'][0]:.4f} vs "
          f"{r['ensemble_nll'][1]:.4f} |")
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
