"""What reproducible mode (config.reproducible=True) costs in member-examples per second.

  python -m benchmarks.reproducible           # 3 models x M=8, about 5 min on 2 cores
  python -m benchmarks.reproducible --quick   # fewer repeats

For each model (benchmarks/throughput.py's MLP 40-256-256-10, MLP 784-512-512-10 and
1-D CNN), M members, batch 128 per member, Adam, one device, it times one training step
of all M members as
  default         the default mode (config.ensemble.member_parallelism='auto');
  default+flags   the same under reproducible mode's XLA flags
                  (dist_ens/parallel/xla_flags.py: on x86 CPUs, no FMA code);
  reproducible    config.reproducible=True (members one at a time, fixed shapes) under
                  those flags, with train.micro_batches=1 and =4.
XLA reads its flags once per process, so `default` runs in one child process and the
other three side by side in another (throughput.py's rotating repeats, medians);
ratios inside the second process are side by side, the flags' own cost crosses two
processes and is noisier.

Prints a table and writes benchmarks/results/reproducible.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks import harness  # Imports no jax: a child's XLA flags are still in time.

ROOT = harness.ROOT

MODELS = ('mlp_small', 'mlp_big', 'cnn1d')


def _child(model: str, members: int, variants: list[str], repeats: int) -> dict:
  """Times `variants` of one cell in this process; returns {variant: median s/step}."""
  import jax
  from benchmarks import throughput
  from dist_ens.run import mesh_layout
  from dist_ens.run import member_forms
  from dist_ens.run import assemble, initial_state
  from dist_ens.parallel import mesh as mesh_lib
  spec = throughput.MODELS[model]

  def build(reproducible: bool, micro_batches: int):
    config, _ = throughput._jax_setup(spec, members)  # pylint: disable=protected-access
    config.reproducible = reproducible
    config.train.micro_batches = micro_batches
    mesh = mesh_layout.build_mesh(config, jax.devices()[:1])
    parts = assemble.build_parts(config, mesh, spec.input_shape, throughput.NUM_CLASSES)
    step = assemble.build_step(parts, per_member_batches=False,
                               form=member_forms.member_form(parts, config.data.batch_size))
    holder, hparams = [initial_state.init_sharded(parts)], parts.device_hparams()
    x, y = (jax.device_put(a, mesh_lib.batch_sharding(mesh)) for a in throughput._batch(spec))  # pylint: disable=protected-access

    def run():
      holder[0], metrics = step(holder[0], hparams, x, y)
      return metrics.loss
    return run

  builders = {'default': lambda: build(False, 1), 'default+flags': lambda: build(False, 1),
              'reproducible': lambda: build(True, 1), 'reproducible/4': lambda: build(True, 4)}
  times, _ = throughput.time_side_by_side({v: builders[v]() for v in variants}, repeats, 0.2)
  return {v: statistics.median(t) for v, t in times.items()}


def _run_child(model: str, members: int, variants: list[str], repeats: int,
               flags: bool) -> dict:
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)
  # `python -c` puts its working directory, the repository root (cwd=ROOT), on sys.path.
  code = ('import json; from benchmarks import reproducible as r; '
          'print("RESULT", json.dumps(r._child(%r, %d, %r, %d)))'
          % (model, members, variants, repeats))
  if flags:
    code = 'from dist_ens.parallel import xla_flags; xla_flags.set_flags(); ' + code
  out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                       timeout=1800, check=True, cwd=ROOT).stdout
  return json.loads(next(l for l in out.splitlines() if l.startswith('RESULT '))[7:])


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--members', type=int, default=8)
  parser.add_argument('--models', default=','.join(MODELS))
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'reproducible.json'))
  args = parser.parse_args(argv)
  header = harness.run_header()
  from benchmarks import throughput
  from dist_ens.parallel import xla_flags
  repeats = 5 if args.quick else 9
  rows = []
  for model in args.models.split(','):
    seconds = _run_child(model, args.members, ['default'], repeats, flags=False)
    seconds |= _run_child(model, args.members, ['default+flags', 'reproducible', 'reproducible/4'],
                          repeats, flags=True)
    rate = {v: args.members * throughput.BATCH / s for v, s in seconds.items()}
    rows.append({'model': model, 'title': throughput.MODELS[model].title,
                 'members': args.members, 'seconds_per_step': seconds,
                 'member_examples_per_s': rate})
  result = {**header, 'flags': list(xla_flags.flags_for()), 'batch': throughput.BATCH,
            'repeats': repeats, 'rows': rows, 'load_average_end': harness.load_average()}
  harness.write_results(args.out, result)
  print(f'M={args.members}, batch {throughput.BATCH}/member, 1 device; member-examples/s '
        '(ratio to the variant before it in brackets)')
  print(f'| model | default | default+flags | reproducible | reproducible, 4 micro-batches |')
  print('|---|---:|---:|---:|---:|')
  for row in rows:
    r = row['member_examples_per_s']
    print(f"| {row['title']} | {r['default']:,.0f} | {r['default+flags']:,.0f} "
          f"({r['default+flags'] / r['default']:.2f}) | {r['reproducible']:,.0f} "
          f"({r['reproducible'] / r['default+flags']:.2f}) | {r['reproducible/4']:,.0f} "
          f"({r['reproducible/4'] / r['reproducible']:.2f}) |")
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
