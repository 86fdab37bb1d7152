"""config.ensemble.own: 'all' vs 'head' vs 'lora' for M=4 ViT members on one device
(issue 36): the train state's bytes, XLA's memory and FLOPs of the compiled step.

  python -m benchmarks.lora                      # ~2 min on a shared 2-core CPU
  python -m benchmarks.lora --depth 12 --out /tmp/lora.json

Each row builds the run as `dist-ens plan` does (assemble.build_run with shapes, no data)
for M=4 members of a ViT (width --hidden, --depth pre-norm blocks, heads of 64, MLP 4x,
patches of 4 on 32x32x3, 10 classes; configs/cifar10_vit_ti.py's Adam recipe), all on one
device (mesh 1 x 1: a device holds every member, so what is stored once shows), batch 64
shared by the members, lowers the step on abstract arguments and compiles it for XLA:CPU.
Per device:
  state   the layout's bytes of the train state (placement.state_bytes_per_device,
          what `dist-ens plan` reports): params, Adam's moments, counters;
  temp    compiled.memory_analysis().temp_size_in_bytes: the step's temporaries
          (activations, gradients, LoRA's formed kernels);
  flops   compiled.cost_analysis()['flops'] of one step.
Nothing is run: fake CPU devices have no device memory, and the figures are the compiled
program's. Writes benchmarks/results/lora.json with harness.run_header's fields (command,
date, commit, load averages, machine) and jax's version.
"""

import argparse
import os

from benchmarks import harness  # Imports no jax: XLA_FLAGS below is still in time.

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=1')
ROOT = harness.ROOT

MEMBERS, OWNS = 4, ('all', 'head', 'lora')
MB = 2 ** 20


def row(own: str, hidden: int, depth: int, rank: int) -> dict:
  import jax
  from dist_ens.parallel import placement
  from benchmarks.model_axis import abstract_args, build, vit_config
  config = vit_config(hidden, depth, hidden // 64, 4 * hidden, 1, 1, 1, '', members=MEMBERS)
  config.ensemble.own, config.ensemble.lora_rank = own, rank
  config.ensemble.member_parallelism = 'vmap'
  run = build(config)
  parts = run.parts
  compiled = run.step().fn.lower(*abstract_args(parts)).compile(
      compiler_options={'xla_backend_optimization_level': 0})
  state = parts.abstract_state
  stored = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state.params))
  return dict(own=own, members=MEMBERS, hidden=hidden, depth=depth,
              rank=rank if own == 'lora' else None,
              adapted=len(parts.method.lora.targets) if own == 'lora' else None,
              params_bytes=stored,
              state=placement.state_bytes_per_device(parts.layout.state_specs(state),
                                                          state, parts.mesh.shape),
              temp=compiled.memory_analysis().temp_size_in_bytes,
              flops=compiled.cost_analysis()['flops'])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--hidden', type=int, default=192)
  parser.add_argument('--depth', type=int, default=6)
  parser.add_argument('--rank', type=int, default=8)
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'lora.json'))
  args = parser.parse_args()
  header = harness.run_header()
  import jax
  rows = [row(own, args.hidden, args.depth, args.rank) for own in OWNS]
  print(f'M={MEMBERS} ViT (hidden {args.hidden}, depth {args.depth}) on one device, '
        f'batch 64; LoRA rank {args.rank}')
  print('| own | params stored, MB | state per device, MB | step temp, MB | step GFLOPs |')
  print('|---|---|---|---|---|')
  for r in rows:
    print(f"| {r['own']} | {r['params_bytes'] / MB:.1f} | {r['state'] / MB:.1f} | "
          f"{r['temp'] / MB:.1f} | {r['flops'] / 1e9:.1f} |")
  harness.write_results(args.out, dict(header, jax=jax.__version__, rows=rows,
                                       load_average_end=harness.load_average()))


if __name__ == '__main__':
  main()
