"""Reproducible mode with members split over a 'model' axis: bit-identical across meshes
for a fixed mesh.model, not across model sizes.

  python -m benchmarks.reproducible_model_axis      # ~2 min on 8 fake CPU devices

Trains M=4 MLPs 40-64-64-10 (dropout 0.1, 'shuffled' orders, Adam, 20 steps, batch 128,
two micro-batches, leaves of 1,024+ elements split by FSDP) with config.reproducible=True
under the XLA flags the dist-ens command sets (--xla_cpu_max_isa=AVX) on several meshes,
and compares every parameter with the run of the same model size on one member group
(1 x 1 x model) and with the 1 x 1 x 1 run: bit-identical or the largest difference.
Writes benchmarks/results/reproducible_model_axis.json (with harness.run_header's fields).
"""

import os

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX'

import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import dist_ens  # noqa: E402
from benchmarks import harness  # noqa: E402

ROOT = harness.ROOT

MESHES = ((1, 1, 1), (4, 2, 1), (1, 1, 2), (4, 1, 2), (2, 2, 2), (1, 1, 4), (2, 1, 4), (1, 2, 4))


def run(member: int, data: int, model: int) -> list[np.ndarray]:
  config = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.model.widths, config.model.dropout = 4, (64, 64), 0.1
  config.reproducible, config.train.micro_batches = True, 2
  config.mesh.member, config.mesh.data, config.mesh.model = member, data, model
  config.mesh.fsdp_min_size = 1024
  config.train.steps, config.train.log_every, config.train.eval_every = 20, 10, 0
  config.checkpoint.every, config.data.member_order, config.writers = 20, 'shuffled', ('jsonl',)
  with tempfile.TemporaryDirectory() as workdir:
    dist_ens.train(config, workdir, devices=jax.devices()[:member * data * model])
    ensemble = dist_ens.Ensemble.load(workdir, devices=jax.devices()[:1])
    return [np.asarray(leaf) for i in range(4) for leaf in jax.tree.leaves(ensemble.member(i))]


def _diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def main() -> None:
  header = harness.run_header()
  runs = {shape: run(*shape) for shape in MESHES}
  rows = {}
  for (member, data, model), leaves in runs.items():
    same = _diff(runs[(1, 1, model)], leaves)
    one = _diff(runs[(1, 1, 1)], leaves)
    rows[f'{member}x{data}x{model}'] = {'vs_1x1x_model': same, 'vs_1x1x1': one}
    show = lambda d: 'identical' if d == 0 else f'max |diff| {d:.2g}'
    print(f'{member} x {data} x {model}: vs 1 x 1 x {model} {show(same)}; vs 1 x 1 x 1 {show(one)}')
  harness.write_results(ROOT / 'benchmarks' / 'results' / 'reproducible_model_axis.json',
                        {**header, 'max_abs_param_diff': rows,
                         'load_average_end': harness.load_average()})


if __name__ == '__main__':
  main()
