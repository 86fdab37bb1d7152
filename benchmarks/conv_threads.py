"""Reproducible mode and 2-D convolutions on XLA:CPU: do results depend on the devices
(and cores) a process has? (issue 39, item 15; docs/reproducibility.md)

  python -m benchmarks.conv_threads            # 3 one-step runs, ~2 min on 2 cores

Trains one step of a 2-member ResNet-8 on 8x8 digits (BatchNorm, 2 micro-batches,
config.reproducible=True with its XLA flags), always on a 1x1 mesh, each run in its own
process:
  1 device    a process with 1 CPU device;
  4 devices   a process with 4 fake CPU devices, the run on the first;
  1 core      a process with 1 device, pinned to one core (taskset).
The program is the same in all three; only the threads the runtime gives a device
differ. Prints how many parameter leaves differ from the first run, and by how much.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_TRAIN = '''
import sys
from dist_ens.parallel import xla_flags
xla_flags.set_flags()
import jax, dist_ens
c = dist_ens.load_config(sys.argv[1])
c.reproducible, c.data.name, c.model.name, c.num_members = True, 'digits', 'resnet', 2
c.mesh.member = c.mesh.data = 1
c.train.micro_batches, c.train.steps, c.train.steps_per_call = 2, 1, 1
c.train.log_every, c.train.eval_every, c.checkpoint.every = 1, 0, 1
c.writers = ('jsonl',)
dist_ens.train(c, sys.argv[2], devices=jax.devices()[:1])
'''


def _train(workdir: Path, devices: int, pin: bool) -> None:
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': str(ROOT),
         'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices}'}
  command = [sys.executable, '-c', _TRAIN, str(ROOT / 'configs' / 'default.py'), str(workdir)]
  subprocess.run((['taskset', '-c', '0'] if pin else []) + command, env=env, check=True,
                 capture_output=True, timeout=900)


def _leaves(workdir: Path):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import dist_ens  # pylint: disable=g-import-not-at-top
  params = dist_ens.Ensemble.load(workdir, devices=jax.devices()[:1]).params
  return [np.asarray(leaf) for leaf in jax.tree.leaves(params)]


def main() -> None:
  out = Path(tempfile.mkdtemp(prefix='conv_threads_'))
  runs = {'1 device': (1, False), '4 devices': (4, False)}
  if shutil.which('taskset') and len(os.sched_getaffinity(0)) > 1:
    runs['1 core'] = (1, True)
  for name, (devices, pin) in runs.items():
    _train(out / name.replace(' ', '_'), devices, pin)
  import numpy as np  # pylint: disable=g-import-not-at-top
  base = _leaves(out / '1_device')
  for name in list(runs)[1:]:
    diffs = [float(np.abs(a - b).max()) for a, b in zip(base, _leaves(out / name.replace(' ', '_')))]
    differing = [d for d in diffs if d]
    print(f'1 device vs {name}: {len(differing)} of {len(diffs)} parameter leaves differ after '
          f'one step, by up to {max(differing, default=0.0):.2g}')
  shutil.rmtree(out, ignore_errors=True)


if __name__ == '__main__':
  main()
