"""Start-up time of a localhost run as the process count grows: 1, 2, 4 and 8 processes
sharing 8 fake CPU devices (launch/local.sh, P processes x 8/P devices).

  python -m benchmarks.processes [--counts 1 2 4 8] [--repeats 2] [--out PATH]

One tiny run each (8 members of a (8,) MLP, batch 32, 4 steps, mesh member=8 with hosts
along 'member', no evaluation), with no persistent compilation cache: what a user waits
for at a cold start. From each process's output, the seconds since launch until it has
joined jax.distributed, built its mesh, and logged its first step (step 2); the run's
start-up is the slowest process's first step. The processes share this machine's cores,
so the figures say what start-up costs in processes and compiles, not what a pod does.
Prints a table and writes benchmarks/results/processes.json (or --out).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

ROOT = harness.ROOT
TOTAL_DEVICES = 8
FLAGS = ['--config.num_members=8', '--config.model.widths=(8,)', '--config.data.batch_size=32',
         '--config.train.steps=4', '--config.train.log_every=2', '--config.train.eval_every=0',
         '--config.eval.joint_tau=0', "--config.writers=('jsonl',)", '--config.mesh.member=8',
         '--config.mesh.data=1', '--config.mesh.hosts_along=member']
# What each process says at each stage (local.sh prefixes its lines with "[i] ").
EVENTS = {'joined': r'jax\.distributed started', 'mesh': r'mesh \{', 'first_step': r'step 2/4'}


def one_run(processes: int, workdir: str) -> dict:
  """Seconds from launch to each event of every process, and to the launcher's exit."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(('JAX_COMPILATION_CACHE', 'XLA_FLAGS'))}
  env.update(PYTHON=sys.executable, PYTHONUNBUFFERED='1')  # Lines as they are said.
  start = time.monotonic()
  proc = subprocess.Popen(
      ['bash', str(ROOT / 'launch' / 'local.sh'), '--processes', str(processes),
       '--devices-per-process', str(TOTAL_DEVICES // processes), '--timeout', '600', '--',
       f'--config={ROOT / "configs" / "default.py"}', f'--workdir={workdir}', *FLAGS],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  seen = {name: [None] * processes for name in EVENTS}
  tail = []
  for line in proc.stdout:
    tail = (tail + [line])[-40:]
    if m := re.match(r'\[(\d+)\] ', line):
      for name, pattern in EVENTS.items():
        if seen[name][int(m[1])] is None and re.search(pattern, line):
          seen[name][int(m[1])] = round(time.monotonic() - start, 2)
  if proc.wait() != 0 or None in seen['first_step']:
    raise RuntimeError(f'{processes} processes failed:\n' + ''.join(tail))
  return {**seen, 'exit': round(time.monotonic() - start, 2)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--counts', type=int, nargs='+', default=[1, 2, 4, 8])
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'processes.json'))
  args = parser.parse_args()
  if any(c < 1 or TOTAL_DEVICES % c for c in args.counts):
    parser.error(f'--counts must divide {TOTAL_DEVICES}: {args.counts}')
  header = harness.run_header()
  rows = []
  print(f'{"processes":>9s} {"devices each":>12s} {"joined s":>9s} {"mesh s":>7s} '
        f'{"first step s":>13s} {"exit s":>7s}   (slowest process, median of {args.repeats})')
  for count in args.counts:
    runs = []
    for _ in range(args.repeats):
      with tempfile.TemporaryDirectory() as tmp:
        runs.append(one_run(count, f'{tmp}/w'))
    slowest = {name: statistics.median(max(r[name]) for r in runs)
               for name in EVENTS if None not in runs[0][name]}
    exit_s = statistics.median(r['exit'] for r in runs)
    rows.append({'processes': count, 'devices_per_process': TOTAL_DEVICES // count,
                 'slowest_s': slowest, 'exit_s': exit_s, 'runs': runs})
    print(f'{count:9d} {TOTAL_DEVICES // count:12d} {slowest.get("joined", float("nan")):9.1f} '
          f'{slowest["mesh"]:7.1f} {slowest["first_step"]:13.1f} {exit_s:7.1f}')
  out = harness.write_results(args.out, {**header, 'repeats': args.repeats, 'flags': FLAGS,
                                         'rows': rows, 'load_average_end': harness.load_average()})
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
