"""Input pipeline throughput against what the train step consumes.

  python -m benchmarks.input_pipeline [--steps 30] [--step_repeats 3] [--examples 2048]
      [--out PATH]

For the default run (MNIST-1D in memory) and CIFAR-10-shaped data (32x32x3 PNG
images in an ArrayRecord TFDS dataset written to a temp dir, read with
tfds.data_source as a real 'cifar10' would be), measures on one device:
  * pipeline: examples/s the Batches reader delivers (read + decode + preprocess +
    host-to-device), per second of its own busy time;
  * step: examples/s the train step consumes (one batch per step for 'shared',
    one per member for 'shuffled').
A ratio above 1 means the pipeline keeps up (with prefetching, the step never
waits). The step is built as training builds it (dist_ens.run.assemble, with
config.ensemble's 'auto' resolved). Prints a table and writes
benchmarks/results/input_pipeline.json (or --out).
"""

import argparse
import io
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import harness
from dist_ens.config import specs
from dist_ens.run import member_forms
from dist_ens import data
from dist_ens.run import assemble, initial_state
from dist_ens.config.loading import load_config
from dist_ens.parallel import mesh as mesh_lib

ROOT = Path(__file__).resolve().parents[1]


def write_cifar_shaped(data_dir: str, n: int) -> None:
  """A TFDS dataset of n random 32x32x3 PNG images, prepared as ArrayRecord."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top

  class CifarShaped(tfds.core.GeneratorBasedBuilder):
    # tfds 4.9.10 looks for a builder's checksums beside the package its module is in,
    # and for a module inside a package (benchmarks.*) that needs importlib_resources,
    # which nothing installs on Python >= 3.9: a module name without a package skips it.
    __module__ = 'cifar_shaped'
    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
          'image': tfds.features.Image(shape=(32, 32, 3)),
          'label': tfds.features.ClassLabel(num_classes=10)}), supervised_keys=('image', 'label'))

    def _split_generators(self, dl_manager):
      return {'train': self._generate_examples(n), 'test': self._generate_examples(256)}

    def _generate_examples(self, count):
      rng = np.random.default_rng(0)
      for i in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buffer, 'PNG')
        yield i, {'image': buffer.getvalue(), 'label': i % 10}

  CifarShaped(data_dir=data_dir, file_format='array_record').download_and_prepare()


def pipeline_rate(dataset, order_kind, batch, members, mesh, steps):
  order = data.Order(order_kind, dataset.train.num_examples, batch, 0)
  batches = data.Batches(dataset.train, order, mesh, members, prefetch=0)
  next(batches)  # Warm caches.
  start = batches.stats
  for _ in range(steps):
    jax.block_until_ready(next(batches))
  stats = batches.stats
  batches.close()
  return (stats.examples - start.examples) / (stats.busy_seconds - start.busy_seconds)


def step_rate(config, dataset, mesh, per_member, steps):
  """Examples/s the step consumes from the pipeline.

  The step is the one training builds (dist_ens.run.assemble), with config.ensemble's
  member parallelism resolved as a run resolves it, one step per call.
  """
  parts = assemble.build_parts(config, mesh, dataset.input_shape, dataset.num_classes)
  step = assemble.build_step(parts, per_member_batches=per_member,
                             form=member_forms.member_form(parts, config.data.batch_size))
  state = initial_state.init_sharded(parts)
  hparams = parts.device_hparams()
  order = data.Order('shuffled' if per_member else 'shared', dataset.train.num_examples,
                     config.data.batch_size, 0)
  batches = data.Batches(dataset.train, order, mesh, config.num_members, prefetch=0)
  x, y = next(batches)
  batches.close()
  state, m = step(state, hparams, x, y)
  jax.block_until_ready(m)
  start = time.perf_counter()
  for _ in range(steps):
    state, m = step(state, hparams, x, y)
  jax.block_until_ready(m)
  per_step = (time.perf_counter() - start) / steps
  consumed = config.data.batch_size * (config.num_members if per_member else 1)
  return consumed / per_step


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--steps', type=int, default=30, help='batches read per case')
  parser.add_argument('--step_repeats', type=int, default=3, help='train steps timed per case')
  parser.add_argument('--examples', type=int, default=2048,
                      help='CIFAR-10-shaped PNGs written for the second case')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'input_pipeline.json'))
  args = parser.parse_args()
  header = harness.run_header()
  default = load_config(ROOT / 'configs' / 'default.py')
  mesh = mesh_lib.make_mesh(specs.mesh_spec(default), jax.devices()[:1])
  rows = []
  with tempfile.TemporaryDirectory() as data_dir:
    write_cifar_shaped(data_dir, args.examples)
    cases = []
    default = load_config(ROOT / 'configs' / 'default.py')
    cases.append(('MNIST-1D, default MLP', default, data.load_dataset('mnist1d')))
    cifar = load_config(ROOT / 'configs' / 'cifar10_cnn.py')
    cifar.data.name, cifar.data.data_dir = 'cifar_shaped', data_dir
    cases.append(('CIFAR-10-shaped PNGs, cifar10_cnn', cifar,
                  data.load_dataset('cifar_shaped', specs.data_spec(cifar))))
    for name, config, dataset in cases:
      for kind in ('shared', 'shuffled'):
        per_member = kind != 'shared'
        supply = pipeline_rate(dataset, kind, config.data.batch_size, config.num_members, mesh,
                               args.steps)
        demand = step_rate(config, dataset, mesh, per_member, args.step_repeats)
        rows.append(dict(data=name, member_order=kind, members=config.num_members,
                         batch=config.data.batch_size, pipeline_examples_per_s=supply,
                         step_examples_per_s=demand, ratio=supply / demand))
        print(f'{name:38s} {kind:9s} pipeline {supply:12,.0f} ex/s   step consumes '
              f'{demand:10,.0f} ex/s   ratio {supply / demand:7.1f}', flush=True)
  out = harness.write_results(args.out, dict(header, device=jax.devices()[0].platform,
                                             rows=rows, load_average_end=harness.load_average()))
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
