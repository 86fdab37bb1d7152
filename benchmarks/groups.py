"""Member groups (config.ensemble.groups) against separate runs: 4 MLP widths x 8 seeds on
8 fake CPU devices as one run, and as four runs of one width each.

  python -m benchmarks.groups [--steps 300] [--rounds 5] [--calls 20] [--out PATH]

Two figures, measured side by side on the current code:
  step: the median time of one call of the joined step (every group updated in turn in one
    jitted program) against the sum of the four same-shape steps' medians, the steps built
    as training builds them (dist_ens.run.assemble), alternated round by round;
  end to end: `dist-ens` as one grouped run against four runs one after another, each its
    own process (Python start, import, data, compile, train --steps, evaluation and
    checkpoint included), as a user would run them.
Writes benchmarks/results/groups.json (or --out).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEVICES = 8
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                           + f' --xla_force_host_platform_device_count={DEVICES}').strip()

import jax  # noqa: E402  (after XLA_FLAGS)

from benchmarks import harness  # noqa: E402
from dist_ens.run import mesh_layout
from dist_ens.run import member_forms
from dist_ens import data  # noqa: E402
from dist_ens.run import assemble, initial_state
from dist_ens.config.loading import load_config  # noqa: E402
from dist_ens.parallel import mesh as mesh_lib  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = ((32, 32), (64, 64), (128, 128), (256, 256))
SEEDS = 8  # members per width


def _config(widths=None):
  """One width's 8 members, or (widths=None) all four widths as groups."""
  config = load_config(ROOT / 'configs' / 'default.py')
  if widths is not None:
    config.num_members, config.model.widths = SEEDS, widths
  else:
    config.num_members = SEEDS * len(WIDTHS)
    config.ensemble.groups = tuple({'count': SEEDS, 'model': {'widths': w}} for w in WIDTHS)
  return config


def _built(config, dataset):
  """(step, state, hparams, batch sharding), as training builds them."""
  mesh = mesh_layout.build_mesh(config, num_members=assemble.fitted_members(config))
  parts = assemble.build_parts(config, mesh, dataset.input_shape, dataset.num_classes)
  step = assemble.build_step(parts, per_member_batches=False,
                             form=member_forms.member_form(
                                 parts.stacks[0],
                                 config.data.batch_size))
  return step, initial_state.init_sharded(parts), parts.device_hparams(), mesh_lib.batch_sharding(mesh)


def step_times(rounds: int, calls: int) -> dict:
  """Median seconds per call: the joined step, each width's own step, alternated."""
  dataset = data.load_dataset('mnist1d')
  runs = {'groups': _built(_config(), dataset)}
  runs.update({f'width {w[0]}': _built(_config(w), dataset) for w in WIDTHS})
  batches = data.BatchIterator(dataset.train, 128, 0)
  times = {name: [] for name in runs}
  states = {name: run[1] for name, run in runs.items()}
  for round_ in range(rounds + 1):
    for name, (step, _, hparams, sharding) in runs.items():
      x, y = next(batches)
      x, y = data.to_global(x, sharding), data.to_global(y, sharding)
      states[name], m = step(states[name], hparams, x, y)  # compiled on round 0
      jax.block_until_ready(m)
      start = time.perf_counter()
      for _ in range(calls):
        states[name], m = step(states[name], hparams, x, y)
      jax.block_until_ready((states[name], m))
      if round_:
        times[name].append((time.perf_counter() - start) / calls)
  medians = {name: statistics.median(t) for name, t in times.items()}
  separate = sum(v for k, v in medians.items() if k != 'groups')
  return {'median_seconds_per_step': medians, 'separate_sum': separate,
          'groups_over_separate': medians['groups'] / separate, 'rounds': rounds,
          'calls_per_round': calls}


def _cli(workdir: Path, steps: int, overrides: list[str]) -> float:
  """Seconds of one `dist-ens` run in its own process, start to exit."""
  flags = [f'--config={ROOT / "configs" / "default.py"}', f'--workdir={workdir}',
           f'--config.train.steps={steps}', '--config.train.eval_every=0',
           f'--config.train.log_every={steps}', f'--config.checkpoint.every={steps}',
           *overrides]
  env = dict(os.environ, XLA_FLAGS=f'--xla_force_host_platform_device_count={DEVICES}')
  start = time.perf_counter()
  subprocess.run([sys.executable, '-m', 'dist_ens.main', *flags], check=True, env=env,
                 cwd=ROOT, capture_output=True)
  return time.perf_counter() - start


def end_to_end(steps: int) -> dict:
  groups = repr(tuple({'count': SEEDS, 'model': {'widths': w}} for w in WIDTHS))
  with tempfile.TemporaryDirectory() as tmp:
    grouped = _cli(Path(tmp) / 'groups', steps, [
        f'--config.num_members={SEEDS * len(WIDTHS)}', f'--config.ensemble.groups={groups}'])
    separate = {f'width {w[0]}': _cli(Path(tmp) / f'w{w[0]}', steps, [
        f'--config.num_members={SEEDS}', f'--config.model.widths={w}']) for w in WIDTHS}
  total = sum(separate.values())
  return {'steps': steps, 'groups_seconds': grouped, 'separate_seconds': separate,
          'separate_total': total, 'groups_over_separate': grouped / total}


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--steps', type=int, default=300)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--calls', type=int, default=20)
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'groups.json'))
  args = parser.parse_args()
  header = harness.run_header()
  steps = step_times(args.rounds, args.calls)
  print('step (median s/call):', steps['median_seconds_per_step'],
        f"groups / sum of separate = {steps['groups_over_separate']:.3f}")
  e2e = end_to_end(args.steps)
  print(f"end to end ({args.steps} steps): groups {e2e['groups_seconds']:.1f} s, separate "
        f"{e2e['separate_total']:.1f} s, ratio {e2e['groups_over_separate']:.3f}")
  harness.write_results(args.out, {**header, 'devices': DEVICES, 'widths': WIDTHS,
                                   'members_per_width': SEEDS, 'step': steps,
                                   'end_to_end': e2e,
                                   'load_average_end': harness.load_average()})


if __name__ == '__main__':
  main()
