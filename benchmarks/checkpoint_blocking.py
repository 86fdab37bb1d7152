"""How long a checkpoint save blocks the training loop, for two ensemble sizes.

  python -m benchmarks.checkpoint_blocking [--repeats 5] [--out PATH]

Saves are asynchronous: the loop waits only for the device-to-host copy (the
`save` call); writing to disk overlaps with training. The state is the one training
builds (dist_ens.run.initial_state.init_sharded on the mesh of all devices) and is saved with
the meta a run saves beside it. Prints a table and writes
benchmarks/results/checkpoint_blocking.json (or --out).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax

from benchmarks import harness
from dist_ens.run import mesh_layout
from dist_ens import data
from dist_ens.run import assemble, initial_state
from dist_ens.io.checkpoint import Checkpointer
from dist_ens.config.loading import load_config

ROOT = Path(__file__).resolve().parents[1]

# (name, model overrides, input shape): the default run, and a CIFAR-10-shaped CNN
# ensemble (32x32x3 inputs, 3 conv layers 64/128/256).
CASES = [
    ('default: 8 x MLP 40-256-256-10', dict(name='mlp'), (40, 1)),
    ('CIFAR-sized: 8 x CNN 64-128-256 on 32x32x3',
     dict(name='cnn', channels=(64, 128, 256), kernel_sizes=(3, 3, 3), strides=(2, 2, 2)),
     (32, 32, 3)),
]


def measure(model_overrides, input_shape, repeats):
  config = load_config(ROOT / 'configs' / 'default.py')
  config.model.update(model_overrides)
  mesh = mesh_layout.build_mesh(config)
  parts = assemble.build_parts(config, mesh, input_shape, 10)
  state = initial_state.init_sharded(parts)
  # What a run saves beside the state (training.loop.Session.checkpoint_meta).
  meta = {'train_seconds': 0.0, 'input_shape': list(parts.input_shape),
          'num_classes': parts.num_classes}
  num_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  blocking, total = [], []
  with tempfile.TemporaryDirectory() as workdir:
    ckpt = Checkpointer(Path(workdir), every=1, keep=2)
    for step in range(1, repeats + 2):
      jax.block_until_ready(state)
      start = time.perf_counter()
      ckpt.save(step, state, data.IteratorState(0, step), meta=meta)
      call = time.perf_counter() - start
      ckpt.wait()
      if step > 1:  # The first save pays one-off setup.
        blocking.append(call)
        total.append(time.perf_counter() - start)
    ckpt.close()
  return num_bytes, statistics.median(blocking), statistics.median(total)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--out',
                      default=str(ROOT / 'benchmarks' / 'results' / 'checkpoint_blocking.json'))
  args = parser.parse_args()
  header, rows = harness.run_header(), []
  print(f'{"ensemble":45s} {"state MB":>9s} {"blocks loop ms":>15s} {"full save ms":>13s}')
  for name, overrides, shape in CASES:
    num_bytes, block, total = measure(overrides, shape, args.repeats)
    rows.append(dict(ensemble=name, state_bytes=num_bytes, blocking_s=block, total_s=total))
    print(f'{name:45s} {num_bytes / 1e6:9.1f} {block * 1e3:15.1f} {total * 1e3:13.1f}')
  out = harness.write_results(args.out, dict(
      header, devices=str(jax.devices()[0].platform), count=jax.device_count(),
      repeats=args.repeats, rows=rows, load_average_end=harness.load_average()))
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
