"""How each part of a run grows with the number of members M (issue 49): 1 to 4,096 tiny MLPs.

  python -m benchmarks.scaling            # from the repository root; ~20 min on 2 cores
  python -m benchmarks.scaling --quick    # M = 1, 8, 64, 256 (~5 min)
  python -m benchmarks.scaling [--members 64,256] [--out PATH]   # the same, as a script

For each M, one fresh process (`timeout -k`-bounded, so its peak RSS is its own) with 8
fake CPU devices trains configs/default.py's MLP narrowed to one hidden layer of 8 units
(418 parameters a member) on the embedded MNIST-1D, with a 500-example validation split,
temperature scaling and greedy selection on, through `dist_ens.train` as a user calls it;
then the report (`dist_ens.report.build.make_report`) and, in another process, `dist-ens
plan`. It measures:

  compile        trace + lower + XLA compile of the init program, the train step and the
                 evaluation step (jax.monitoring's compile events, by function name)
  step           median seconds per step over the middle of the run (a timing action waits
                 for the device every steps/20 steps), per member-example
  memory         the process's peak RSS (VmHWM) after training; the bytes of every live
                 device buffer (every device) and of the train state, at the end
  final phase    each built-in action's time after the last step (final test evaluation,
                 validation, joint predictions, selective/conformal decisions, temperature
                 scaling, greedy selection, the final checkpoint's start), by class
  evaluation     one more evaluation of the test split, compiled already
  checkpoint     save (until written) and restore of the whole state with dist_ens's
                 Checkpointer into a scratch directory, median of 3; its bytes on disk;
                 against the disk's write bandwidth, measured by dd in the same run
  PBT exploit    one exploit (pbt.make_exploit: the worst quarter copy the best quarter's
                 state), compiled already, median of 5, and a round's validation evaluation
  logging        metrics.jsonl and tensorboard/ bytes; writing the run's events again
                 through each writer
  console        the run's console output (lines, longest line); results_table's lines;
                 members.csv's bytes and the time to rank and write it
  report         make_report's time, report.md's lines, report.html's bytes and table rows
  plan           `dist-ens plan` for the same config: its wall time and output lines

Each part's growth is the slope of log(cost) against log(M) between the two largest M
(flat < 0.25, linear 0.8-1.2; fixed costs such as a compile hide growth below), beside the
least-squares slope from M=64 up. The step-time target is timed again with the steps of
M = 64, 1,024 and 4,096 side by side in rotating rounds in one process (the load of this
shared machine changes between the processes). Writes benchmarks/results/scaling.json and scaling.png and
prints the Markdown tables of BENCHMARKS.md ("Scaling to 4,096 members").
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks import harness  # python -m benchmarks.scaling, from the repository root

ROOT = harness.ROOT


class Setup(NamedTuple):
  """What one scaling sweep trains: a config file, its overrides, the M swept and the steps
  per M, the M timed side by side, and from which M the growth is fitted."""
  config: str
  overrides: dict[str, Any]
  members: tuple[int, ...]
  quick_members: tuple[int, ...]
  steps: dict[int, int]
  round_members: tuple[int, ...]
  quick_round_members: tuple[int, ...]
  fit_from: int
  label: str
  out: str


SETUPS = {
    # Steps per M: ~5 s of steps on 2 loaded cores from M=64 up (about 15M
    # member-examples), 2,000 below, where the per-call overhead rules; 20 timing
    # intervals each.
    'mlp': Setup('default.py', {'model.widths': (8,), 'data.validation_size': 500},
                 (1, 8, 64, 256, 1024, 4096), (1, 8, 64, 256),
                 {1: 2000, 8: 2000, 64: 2000, 256: 480, 1024: 120, 4096: 40},
                 (64, 1024, 4096), (8, 64, 256), 64, 'MLP 40-8-10', 'scaling.json'),
    # ResNet-20 (0.27M parameters, BatchNorm) on the 8x8 digits, 1,137 training images
    # after a 300-image validation split: 40 steps at every M (20 timing intervals).
    'resnet20': Setup('digits_resnet20.py', {'data.validation_size': 300},
                      (1, 8, 16, 32, 64), (1, 8, 16), {1: 40, 8: 40, 16: 40, 32: 40, 64: 40},
                      (16, 64), (8, 16), 8, 'ResNet-20 on digits', 'scaling_resnet20.json'),
}
SETUP = SETUPS['mlp']  # main() and the children set it from --model
DEVICES = 8  # fake CPU devices; --platform=gpu: the machine's own
PLATFORM = 'cpu'
PEAK_TFLOPS = None  # --peak_tflops: the device's peak, for the MFU row
PBT_AT = 256  # the target: a PBT exploit round costs less than a step at M=256
CHILD_TIMEOUT_S = 900
ROUNDS, ROUND_SECONDS = 7, 1.0
PLAN_TIMEOUT_S = 600


# ----------------------------------------------------------------------------------------
# The child: one M in a fresh process.


def _child_env() -> dict[str, str]:
  env = dict(os.environ)
  if PLATFORM == 'cpu':
    env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                        f' --xla_force_host_platform_device_count={DEVICES}').strip()
  # jax's 'gpu' also asks for ROCm and fails where only CUDA is installed (jax 0.11.2).
  env['JAX_PLATFORMS'] = 'cuda' if PLATFORM == 'gpu' else PLATFORM
  # Every compile is a real one: no persistent cache, no calibration cache.
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  env['DIST_ENS_CALIBRATION'] = os.path.join(tempfile.gettempdir(), 'scaling_no_calibration.json')
  env['PYTHONUNBUFFERED'] = '1'
  return env


def config_for(members: int, steps: int):
  import dist_ens
  config = dist_ens.load_config(ROOT / 'configs' / SETUP.config)
  config.num_members = members
  for dotted, value in SETUP.overrides.items():
    group, field = dotted.split('.')
    config[group][field] = value
  config.train.steps = steps
  config.train.log_every = steps // 4
  config.train.eval_every = 0  # the final evaluation only: the step intervals stay clean
  config.checkpoint.every = steps
  config.eval.temperature_scaling = True
  config.select.method = 'greedy'  # greedy_size 0: M picks
  return config


# The evaluation program's names: 'step', eval/shift.py's prediction program that the final
# evaluation, validation and the decisions share (evaluators/predictions.py); 'eval_step'
# before that sharing (the results of earlier runs).
EVALUATION = ('step', 'eval_step')


class _CompileLog:
  """trace, lower and XLA compile seconds by function name (jax.monitoring events),
  tagged with the phase they fell in."""
  EVENTS = {'/jax/core/compile/jaxpr_trace_duration': 'trace',
            '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower',
            '/jax/core/compile/backend_compile_duration': 'compile'}

  def __init__(self):
    from jax._src import monitoring  # the public jax.monitoring lacks the listener hook
    self.phase = 'run'
    self.events: list[tuple[str, str, str, float]] = []
    monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, **kwargs: Any) -> None:
    if event in self.EVENTS:
      name = re.sub(r'^jit\((.*)\)$', r'\1', str(kwargs.get('fun_name', '?')))
      self.events.append((self.phase, name, self.EVENTS[event], duration))

  def seconds(self, phase: str, names: tuple[str, ...] | None) -> dict[str, float]:
    """Seconds per kind (trace, lower, compile, total) of `names` (None: every other)."""
    known = ('init', 'traced') + EVALUATION
    out = {'trace': 0.0, 'lower': 0.0, 'compile': 0.0}
    for p, name, kind, d in self.events:
      if p == phase and ((name in names) if names else name not in known):
        out[kind] += d
    out['total'] = sum(out.values())
    return out

  def by_name(self, phase: str) -> dict[str, float]:
    """Seconds (trace + lower + compile) per function name, the largest first."""
    out: dict[str, float] = {}
    for p, name, _, d in self.events:
      if p == phase:
        out[name] = out.get(name, 0.0) + d
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _timed_actions(default_actions, seconds: dict[str, dict[str, float]]):
  """trainer.default_actions with every action timed by class (on_step and on_end), and
  the process's peak RSS after each on_end (which action raised it)."""
  from dist_ens.plan import host_memory

  class Timed:
    def __init__(self, action):
      self._action, self._name = action, type(action).__name__

    def __getattr__(self, name):
      return getattr(self._action, name)

    def _call(self, what: str, call) -> None:
      start = time.perf_counter()
      getattr(self._action, what)(call)
      entry = seconds.setdefault(self._name, {'on_step': 0.0, 'on_end': 0.0})
      entry[what] += time.perf_counter() - start
      if what == 'on_end':
        entry['rss_peak_after_end_bytes'] = host_memory.status_bytes('VmHWM')

    def on_step(self, call) -> None:
      self._call('on_step', call)

    def on_end(self, call) -> None:
      self._call('on_end', call)

    def close(self) -> None:
      self._action.close()

  def wrapped(call, checkpointer, extra=()):
    return [Timed(a) for a in default_actions(call, checkpointer, extra)]

  return wrapped


def _tree_bytes(tree) -> int:
  import jax
  return sum(leaf.nbytes for leaf in jax.tree.leaves(tree) if hasattr(leaf, 'nbytes'))


def _live_device_bytes() -> dict[str, int]:
  import jax
  per_device: dict[str, int] = {}
  for array in jax.live_arrays():
    for shard in array.addressable_shards:
      key = str(shard.device.id)
      per_device[key] = per_device.get(key, 0) + shard.data.nbytes
  return {'total': sum(per_device.values()), 'max_device': max(per_device.values(), default=0)}


def _median_seconds(fn, repeats: int) -> tuple[float, list[float]]:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), times


def _du(path: Path) -> int:
  return sum(p.stat().st_size for p in path.rglob('*') if p.is_file()) if path.exists() else 0


def _make_probe(scratch: Path, out: dict[str, Any], log: _CompileLog):
  """The timing actions: marks every `every` steps, and after the last step the
  measurements that need the live state (run before the trainer's final checkpoint)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from dist_ens.io.checkpoint import Checkpointer
  from dist_ens.plan import host_memory
  from dist_ens.evaluators import pbt
  from dist_ens.training.loop import PeriodicAction

  class Marks(PeriodicAction):
    """(step, seconds) after the device finished that step: the first call, then every
    `every` steps; never the last step (the final phase belongs to on_end)."""

    def __init__(self, every: int, start: float):
      super().__init__(every)
      self.start, self.marks = start, []

    def on_step(self, call) -> None:
      if not self.marks or self.due(call.step) and call.step != call.session.total_steps:
        jax.block_until_ready(call.metrics)
        self.marks.append((call.step, time.perf_counter() - self.start))
        self.rss_peak = host_memory.status_bytes('VmHWM')

    def on_end(self, call) -> None:
      pass

  class Probe(PeriodicAction):

    def __init__(self):
      super().__init__(0, at_end=True)

    def run(self, call) -> None:
      log.phase = 'probe'
      out['ended_at'] = time.perf_counter()
      out['steps_per_call'] = call.session.steps_per_call
      out['mesh'] = dict(call.session.parts.mesh.shape)
      out['rss_peak_final_phase_bytes'] = host_memory.status_bytes('VmHWM')
      out['live_device_bytes'] = _live_device_bytes()
      out['state_bytes'] = _tree_bytes(call.state)
      test, validation = call.session.run_data.dataset.test, call.session.run_data.validation
      warm, _ = _median_seconds(
          lambda: call.session.evaluator.evaluate(call.state, test), 3)
      out['evaluate_test_s'] = warm
      out['evaluate_validation_s'], _ = _median_seconds(
          lambda: call.session.evaluator.evaluate(call.state, validation), 3)
      self._exploit(call)
      self._checkpoint(call)
      log.phase = 'end'

    def _exploit(self, call) -> None:
      m = call.session.config.num_members
      sources = np.arange(m, dtype=np.int32)
      quarter = m // 4
      if quarter:
        sources[-quarter:] = np.arange(quarter)
      sources = jax.device_put(sources, jax.sharding.NamedSharding(
          call.session.parts.mesh, jax.sharding.PartitionSpec()))
      exploit = pbt.make_exploit(call.session.parts.state_shardings, call.session.parts.mesh)
      state = jax.tree.map(jnp.copy, call.state)  # the run's own state stays as trained
      start = time.perf_counter()
      state = jax.block_until_ready(exploit(state, sources))
      out['exploit_first_s'] = time.perf_counter() - start
      times = []
      for _ in range(5):
        start = time.perf_counter()
        state = jax.block_until_ready(exploit(state, sources))
        times.append(time.perf_counter() - start)
      out['exploit_s'], out['exploit_all_s'] = statistics.median(times), times
      del state

    def _checkpoint(self, call) -> None:
      directory = scratch / 'checkpoint_bench'
      checkpointer = Checkpointer(directory, every=1, keep=1)
      saves, restores = [], []
      try:
        for i in range(1, 4):
          start = time.perf_counter()
          checkpointer.save(i, call.state, call.session.batches.state, force=True,
                            meta=call.session.checkpoint_meta())
          checkpointer.wait()
          saves.append(time.perf_counter() - start)
          start = time.perf_counter()
          restored = checkpointer.restore(call.session.parts.abstract_state)
          jax.block_until_ready(restored.state)
          restores.append(time.perf_counter() - start)
          del restored
        out['checkpoint_disk_bytes'] = _du(directory / '3')
      finally:
        checkpointer.close()
        shutil.rmtree(directory, ignore_errors=True)
      # The first of each compiles the checksum program: the median of the three.
      out['checkpoint_save_s'], out['checkpoint_save_all_s'] = statistics.median(saves), saves
      out['checkpoint_restore_s'] = statistics.median(restores)
      out['checkpoint_restore_all_s'] = restores

  return Marks, Probe


def _replay_events(workdir: Path, scratch: Path) -> dict[str, Any]:
  """The run's events written again through each writer: seconds per event."""
  from dist_ens.io import file_sinks
  from dist_ens.report.data import read_events
  from dist_ens.io.tensorboard_writer import TensorBoardWriter
  events = read_events(workdir / 'metrics.jsonl')
  out: dict[str, Any] = {'events': len(events)}
  for name, make in (('jsonl', lambda d: file_sinks.JsonlWriter(d / 'metrics.jsonl')),
                     ('tensorboard', lambda d: TensorBoardWriter(d / 'tb'))):
    directory = scratch / f'replay_{name}'
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    writer = make(directory)
    for event in events:
      writer.write(event)
    writer.close()
    out[f'{name}_s_per_event'] = (time.perf_counter() - start) / max(len(events), 1)
    shutil.rmtree(directory, ignore_errors=True)
  return out


def _tables(workdir: Path, scratch: Path) -> dict[str, Any]:
  """The console's results table and members.csv, made again from final_metrics.json."""
  import numpy as np
  from dist_ens.io import run_files, tables
  from dist_ens.report.data import read_final_metrics
  final = read_final_metrics(workdir)
  start = time.perf_counter()
  table = tables.results_table(final)
  out = {'results_table_s': time.perf_counter() - start,
         'results_table_lines': len(table.splitlines())}
  hparams = {f: np.asarray(v, np.float32) for f, v in final.get('hyperparameters', {}).items()}
  start = time.perf_counter()
  rows = tables.member_rows(final, hparams, final.get('validation'), 'nll', False)
  run_files.write_members_csv(scratch / 'members.csv', rows)
  out['members_csv_s'] = time.perf_counter() - start
  out['members_csv_bytes'] = (workdir / 'members.csv').stat().st_size
  return out


def _report(workdir: Path) -> dict[str, Any]:
  from dist_ens.report import build as report
  start = time.perf_counter()
  out_dir = report.make_report(workdir)
  seconds = time.perf_counter() - start
  page = (out_dir / 'report.html').read_text()
  md = (out_dir / 'report.md').read_text()
  return {'report_s': seconds, 'report_md_lines': len(md.splitlines()),
          'report_md_longest_line': max(map(len, md.splitlines())),
          'report_html_bytes': len(page.encode()), 'report_html_rows': page.count('<tr'),
          'report_figure_bytes': sum(p.stat().st_size for p in out_dir.glob('*.png')),
          'report_svg_bytes': sum(p.stat().st_size for p in out_dir.glob('*.svg'))}


def _check_devices(jax) -> None:
  if PLATFORM == 'cpu':
    assert jax.device_count() == DEVICES, f'XLA_FLAGS came too late: {jax.device_count()} devices'


def _child_args() -> list[str]:
  """What a child process needs to rebuild this sweep's setup."""
  return ['--model', next(k for k, v in SETUPS.items() if v is SETUP), '--platform', PLATFORM]


def child(members: int, steps: int, scratch: Path, out_path: Path) -> None:
  """One M: trains, measures, writes out_path (JSON). Runs in its own process."""
  log = _CompileLog()
  import jax
  import dist_ens
  from dist_ens.plan import host_memory
  from dist_ens.training import trainer
  _check_devices(jax)
  out: dict[str, Any] = {'members': members, 'steps': steps}
  workdir = scratch / 'run'
  action_seconds: dict[str, dict[str, float]] = {}
  trainer.default_actions = _timed_actions(trainer.default_actions, action_seconds)
  start = time.perf_counter()
  marks_cls, probe_cls = _make_probe(scratch, out, log)
  marks = marks_cls(max(1, steps // 20), start)
  config = config_for(members, steps)
  out['batch_per_member'] = batch = config.data.batch_size
  final = dist_ens.train(config, str(workdir), actions=[marks, probe_cls()])
  out['train_wall_s'] = time.perf_counter() - start
  out['probe_to_end_s'] = start + out['train_wall_s'] - out.pop('ended_at')
  out['rss_peak_bytes'] = host_memory.status_bytes('VmHWM')
  out['rss_peak_steps_bytes'] = marks.rss_peak  # up to the last step timed
  out['marks'] = marks.marks
  out['first_step_s'] = marks.marks[0][1]
  per_step = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(marks.marks[1:], marks.marks[2:])]
  out['step_s'] = statistics.median(per_step)
  out['step_s_all'] = per_step
  # The mean over the same intervals: log steps (the writers) included.
  (s0, t0), (s1, t1) = marks.marks[1], marks.marks[-1]
  out['step_mean_s'] = (t1 - t0) / (s1 - s0)
  out['member_example_s'] = out['step_s'] / (members * batch)
  out['actions_s'] = action_seconds
  out['compile_s'] = {'init': log.seconds('run', ('init',)),
                      'train_step': log.seconds('run', ('traced',)),
                      'evaluation': log.seconds('run', EVALUATION),
                      'other': log.seconds('run', None)}
  out['compile_by_name_s'] = log.by_name('run')
  out['ensemble_nll'] = final['ensemble']['nll']
  out['greedy_picks'] = len(final['greedy']['picks'])
  out['metrics_jsonl_bytes'] = (workdir / 'metrics.jsonl').stat().st_size
  out['tensorboard_bytes'] = _du(workdir / 'tensorboard')
  out['final_metrics_bytes'] = (workdir / 'final_metrics.json').stat().st_size
  log.phase = 'after'
  out.update(_replay_events(workdir, scratch))
  out.update(_tables(workdir, scratch))
  out.update(_report(workdir))
  out['rss_peak_with_report_bytes'] = host_memory.status_bytes('VmHWM')
  harness.write_results(out_path, out)


def step_rounds(members: dict[int, int], seconds: float, rounds: int, out_path: Path) -> None:
  """The train step of each M (built as dist_ens.train builds it: assemble.build_run,
  run.step, run.batches), with the steps per call its run used ({M: K}), timed in
  rotating rounds in ONE process, so that a ratio between two M is not a change of the
  machine's load between their processes. Each round runs about `seconds` of steps per
  M, waiting for the device every 8 steps (or call) as the trainer does on a
  multi-device CPU; medians over rounds."""
  import jax
  from dist_ens import data
  from dist_ens.run import assemble, initial_state
  _check_devices(jax)
  cells = {}
  for m, k in members.items():
    config = config_for(m, 1000)
    run = assemble.build_run(config)
    step = run.step(k)
    batches = run.batches(data.IteratorState(), k, with_index=step.uses_index)
    state, hparams = initial_state.init_sharded(run.parts), run.parts.device_hparams()
    state, metrics = step(state, hparams, *next(batches))  # compiles
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(2):
      state, metrics = step(state, hparams, *next(batches))
    jax.block_until_ready(metrics)
    per_call = (time.perf_counter() - start) / 2
    cells[m] = {'step': step, 'batches': batches, 'state': state, 'hparams': hparams, 'k': k,
                'batch': config.data.batch_size,
                'sync': max(1, 8 // k), 'calls': max(4, round(seconds / per_call)),
                'times': []}
  for _, m in harness.rotating_rounds(members, rounds):
    cell = cells[m]
    state = cell['state']
    start = time.perf_counter()
    for i in range(cell['calls']):
      state, metrics = cell['step'](state, cell['hparams'], *next(cell['batches']))
      if (i + 1) % cell['sync'] == 0:
        jax.block_until_ready(metrics)
    jax.block_until_ready(metrics)
    cell['times'].append((time.perf_counter() - start) / (cell['calls'] * cell['k']))
    cell['state'] = state
  out = {}
  for m, cell in cells.items():
    cell['batches'].close()
    median = statistics.median(cell['times'])
    out[m] = {'steps_per_call': cell['k'], 'steps_per_round': cell['calls'] * cell['k'],
              'step_s_rounds': cell['times'], 'step_s': median,
              'member_example_s': median / (m * cell['batch'])}
  harness.write_results(out_path, {'rounds': rounds, 'members': out})


# ----------------------------------------------------------------------------------------
# The parent: one child per M, plan, dd, fits, table, figure.


def disk_write_bandwidth(directory: Path, megabytes: int = 256) -> dict[str, float]:
  """dd's write bandwidth into `directory`, bytes/s: to the disk (conv=fdatasync: the
  data reaches the device before dd stops the clock) and to the page cache (no sync)."""
  out = {}
  for name, flags in (('fdatasync', ['conv=fdatasync']), ('page_cache', [])):
    target = directory / 'dd.bin'
    result = subprocess.run(['dd', 'if=/dev/zero', f'of={target}', 'bs=1M',
                             f'count={megabytes}', *flags], capture_output=True, text=True,
                            check=False)
    target.unlink(missing_ok=True)
    match = re.search(r'(\d+) bytes .* copied, ([\d.]+) s', result.stderr)
    if match:
      out[name] = int(match.group(1)) / float(match.group(2))
  return out


def run_child(members: int, steps: int, scratch: Path) -> dict[str, Any]:
  out_path = scratch / f'child_{members}.json'
  load = harness.load_average()
  cmd = ['timeout', '-k', '20', str(CHILD_TIMEOUT_S), sys.executable, '-m',
         'benchmarks.scaling', '--child', str(members), '--steps', str(steps),
         '--scratch', str(scratch / f'm{members}'), '--child_out', str(out_path),
         *_child_args()]
  start = time.perf_counter()
  proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), capture_output=True, text=True,
                        check=False)
  wall = time.perf_counter() - start
  console = (proc.stdout + proc.stderr).splitlines()
  if proc.returncode or not out_path.exists():
    print('\n'.join(console[-40:]), file=sys.stderr)
    return {'members': members, 'failed': proc.returncode, 'process_wall_s': wall}
  row = json.loads(out_path.read_text())
  shown = [line for line in console if not line.startswith('step ')]  # (progress lines)
  row.update(process_wall_s=wall, load_average=load, console_lines=len(console),
             console_bytes=sum(len(line) + 1 for line in console),
             console_longest_line=max(map(len, console), default=0),
             console_lines_not_progress=len(shown))
  (scratch / f'console_{members}.txt').write_text('\n'.join(console))
  return row


def run_step_rounds(members: dict[int, int], scratch: Path) -> dict[str, Any]:
  out_path = scratch / 'step_rounds.json'
  cmd = ['timeout', '-k', '20', str(CHILD_TIMEOUT_S), sys.executable, '-m',
         'benchmarks.scaling', '--step_rounds', ','.join(f'{m}:{k}' for m, k in members.items()),
         '--child_out', str(out_path), *_child_args()]
  load = harness.load_average()
  proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), capture_output=True, text=True,
                        check=False)
  if proc.returncode or not out_path.exists():
    print((proc.stdout + proc.stderr)[-3000:], file=sys.stderr)
    return {}
  result = json.loads(out_path.read_text())
  result['load_average'] = load
  print('interleaved steps: ' + ', '.join(
      f'M={m} {r["member_example_s"] * 1e9:.0f} ns/member-example'
      for m, r in result['members'].items()), flush=True)
  return result


def run_plan(members: int) -> dict[str, Any]:
  """`dist-ens plan` for the same run: its wall time, its printed lines, and (from a
  second, --json call) the train FLOPs per member-example, XLA's cost analysis."""
  cmd = ['timeout', '-k', '20', str(PLAN_TIMEOUT_S), sys.executable, '-m', 'dist_ens.main',
         'plan', f'--config={ROOT / "configs" / SETUP.config}', f'--config.num_members={members}',
         *(f'--config.{k}={v}' for k, v in SETUP.overrides.items())]
  start = time.perf_counter()
  proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), capture_output=True, text=True,
                        check=False)
  out = {'plan_s': time.perf_counter() - start, 'plan_rc': proc.returncode,
         'plan_lines': len(proc.stdout.splitlines()),
         'plan_tail': (proc.stdout + proc.stderr)[-600:] if proc.returncode else ''}
  as_json = subprocess.run([*cmd, '--json'], cwd=ROOT, env=_child_env(), capture_output=True,
                           text=True, check=False)
  if not as_json.returncode:
    out['flops_per_example'] = json.loads(as_json.stdout).get('flops_per_example')
  return out


def _after_last_step(row) -> float:
  """Seconds from the last step's end to train() returning, less the Probe action's own
  measurements (the last step is timed as the median step after the last mark)."""
  step, seconds = row['marks'][-1]
  last = seconds + (row['steps'] - step) * row['step_s']
  return row['train_wall_s'] - last - row['actions_s']['Probe']['on_end']


# Each part's cost per M: (key, label, unit, function of a row).
def _action(row, name):
  return row['actions_s'].get(name, {}).get('on_end', 0.0)


PARTS = [
    ('compile_init', 'compile: init', 's', lambda r: r['compile_s']['init']['total']),
    ('compile_step', 'compile: train step', 's', lambda r: r['compile_s']['train_step']['total']),
    ('compile_eval', 'compile: evaluation step', 's',
     lambda r: r['compile_s']['evaluation']['total']),
    ('compile_other', 'compile: every other program', 's',
     lambda r: r['compile_s']['other']['total']),
    ('first_step', 'time to the first step', 's', lambda r: r['first_step_s']),
    ('step', 'train step (median)', 's', lambda r: r['step_s']),
    ('step_mean', 'train step (mean: log steps in)', 's', lambda r: r['step_mean_s']),
    ('member_example', 'train step per member-example', 'us',
     lambda r: 1e6 * r['member_example_s']),
    ('evaluate', 'test evaluation (compiled)', 's', lambda r: r['evaluate_test_s']),
    ('final_evaluate', 'final phase: Evaluate', 's', lambda r: _action(r, 'Evaluate')),
    ('final_validate', 'final phase: Validate', 's', lambda r: _action(r, 'Validate')),
    ('final_joint', 'final phase: joint predictions', 's',
     lambda r: sum(v['on_end'] for k, v in r['actions_s'].items() if 'Joint' in k)),
    ('final_decisions', 'final phase: decisions (selective, conformal)', 's',
     lambda r: _action(r, 'EvaluateDecisions')),
    ('temperature', 'post-hoc: temperature scaling', 's', lambda r: _action(r, 'TemperatureScale')),
    ('greedy', 'post-hoc: greedy selection (M picks)', 's', lambda r: _action(r, 'GreedySelect')),
    ('final_phase', 'after the last step, whole (the probe left out)', 's',
     lambda r: _after_last_step(r)),
    ('rss_steps', 'host peak RSS: training steps', 'MB', lambda r: r['rss_peak_steps_bytes'] / 1e6),
    ('rss_peak', 'host peak RSS: whole run', 'MB', lambda r: r['rss_peak_bytes'] / 1e6),
    ('live_bytes', 'live device buffers (every device)', 'MB',
     lambda r: r['live_device_bytes']['total'] / 1e6),
    ('state_bytes', 'train state', 'MB', lambda r: r['state_bytes'] / 1e6),
    ('checkpoint_save', 'checkpoint save', 's', lambda r: r['checkpoint_save_s']),
    ('checkpoint_restore', 'checkpoint restore', 's', lambda r: r['checkpoint_restore_s']),
    ('exploit', 'PBT exploit (compiled)', 's', lambda r: r['exploit_s']),
    ('pbt_validation', 'PBT round\'s validation evaluation', 's',
     lambda r: r['evaluate_validation_s']),
    ('metrics_jsonl', 'metrics.jsonl', 'KB', lambda r: r['metrics_jsonl_bytes'] / 1e3),
    ('tensorboard', 'tensorboard/', 'KB', lambda r: r['tensorboard_bytes'] / 1e3),
    ('jsonl_write', 'jsonl writer, per event', 'ms', lambda r: 1e3 * r['jsonl_s_per_event']),
    ('tensorboard_write', 'tensorboard writer, per event', 'ms',
     lambda r: 1e3 * r['tensorboard_s_per_event']),
    ('console_lines', 'console lines (without progress)', 'lines',
     lambda r: r['console_lines_not_progress']),
    ('console_longest', 'console: longest line', 'chars', lambda r: r['console_longest_line']),
    ('results_table', 'console results table', 'lines', lambda r: r['results_table_lines']),
    ('members_csv', 'members.csv', 'KB', lambda r: r['members_csv_bytes'] / 1e3),
    ('members_csv_s', 'members.csv: rank and write', 'ms', lambda r: 1e3 * r['members_csv_s']),
    ('report', 'report (make_report)', 's', lambda r: r['report_s']),
    ('report_html_rows', 'report.html table rows', 'rows', lambda r: r['report_html_rows']),
    ('report_html', 'report.html', 'KB', lambda r: r['report_html_bytes'] / 1e3),
    ('plan', '`dist-ens plan`', 's', lambda r: r.get('plan_s', float('nan'))),
    # Model FLOPs utilisation: XLA's train FLOPs per member-example (plan) at the measured
    # member-examples per second, over --peak_tflops (GPU sessions give it).
    ('mfu', 'MFU (train FLOPs over the peak)', '%',
     lambda r: 100 * r['flops_per_example'] / r['member_example_s'] / (PEAK_TFLOPS * 1e12)),
]


def fit_parts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Each part's values per M, its log-log slope from M=SETUP.fit_from (64 for the MLPs)
  up (least squares) and between the two largest M, which names its growth."""
  ok = [r for r in rows if 'failed' not in r]
  fits = []
  for key, label, unit, get in PARTS:
    if key == 'mfu' and not PEAK_TFLOPS:
      continue
    values = {}
    for r in ok:
      try:
        values[r['members']] = get(r)
      except (KeyError, TypeError):
        values[r['members']] = float('nan')
    big = sorted(m for m in values if m >= SETUP.fit_from)
    slope = harness.log_slope(big, [values[m] for m in big])
    # Fixed costs (a compile) hide growth at small M: the top two M tell the trend.
    top = harness.log_slope(big[-2:], [values[m] for m in big[-2:]])
    fits.append({'part': key, 'label': label, 'unit': unit, 'values': values,
                 'slope_fit': slope, 'fit_from': SETUP.fit_from, 'slope_top': top, 'top_members': big[-2:],
                 'growth': harness.growth(top)})
  return fits


def _ratio(fits, part, hi, lo):
  values = next(f for f in fits if f['part'] == part)['values']
  return values[hi] / values[lo] if hi in values and lo in values and values[lo] else None


def targets(rows: list[dict[str, Any]], fits: list[dict[str, Any]],
            disk: dict[str, float], interleaved: dict[str, Any]) -> list[dict[str, Any]]:
  """The issue's targets, each with the measured figure and whether it holds (the step
  time by the interleaved rounds where they ran, the runs' own figure beside it)."""
  ok = {r['members']: r for r in rows if 'failed' not in r}
  top = max(ok)
  out = []
  compile_of = lambda r: (r['compile_s']['init']['total'] + r['compile_s']['train_step']['total']
                          + r['compile_s']['evaluation']['total'])
  if 8 in ok:
    ratio = compile_of(ok[top]) / compile_of(ok[8])
    parts = {k: _ratio(fits, k, top, 8) for k in ('compile_init', 'compile_step', 'compile_eval')}
    out.append({'target': f'compile time (init + step + evaluation) at M={top} within 1.5x of M=8',
                'measured': ratio, 'by_part': parts, 'holds': ratio <= 1.5})
  if 64 in ok and top > 64:
    ratio = ok[top]['member_example_s'] / ok[64]['member_example_s']
    cells = interleaved.get('members', {})
    rounds = (cells[str(top)]['member_example_s'] / cells['64']['member_example_s']
              if str(top) in cells and '64' in cells else None)
    out.append({'target': f'step time per member-example at M={top} within 1.2x of M=64',
                'measured': {'interleaved_rounds': rounds, 'separate_runs': ratio},
                'holds': (rounds if rounds is not None else ratio) <= 1.2})
  big = sorted(m for m in ok if m >= SETUP.fit_from)
  if len(big) >= 2 and 'fdatasync' in disk:
    slope = harness.log_slope([ok[m]['state_bytes'] for m in big],
                              [ok[m]['checkpoint_save_s'] for m in big])
    lo, hi = ok[big[0]], ok[big[-1]]
    extra = hi['checkpoint_save_s'] - lo['checkpoint_save_s']  # (<= 0: noise over growth)
    marginal = (hi['state_bytes'] - lo['state_bytes']) / extra if extra > 0 else None
    effective = hi['state_bytes'] / hi['checkpoint_save_s']
    out.append({'target': 'checkpoint save linear in state bytes at >= 50% of the disk\'s '
                          'write bandwidth (dd, fdatasync)',
                'measured': {'slope_time_vs_bytes': slope,
                             'effective_bandwidth_at_top': effective,
                             'marginal_bandwidth': marginal,
                             'disk_bandwidth': disk['fdatasync'],
                             'effective_fraction': effective / disk['fdatasync'],
                             'marginal_fraction': marginal and marginal / disk['fdatasync']},
                'holds': bool(slope is not None and slope <= 1.2
                              and effective >= 0.5 * disk['fdatasync'])})
  if PBT_AT in ok:
    r = ok[PBT_AT]
    out.append({'target': f'a PBT exploit costs less than one training step at M={PBT_AT}',
                'measured': {'exploit_s': r['exploit_s'], 'step_s': r['step_s'],
                             'ratio': r['exploit_s'] / r['step_s'],
                             'round_with_validation_s': r['exploit_s'] + r['evaluate_validation_s'],
                             'round_ratio': (r['exploit_s'] + r['evaluate_validation_s'])
                             / r['step_s']},
                'holds': r['exploit_s'] < r['step_s']})
  r = ok[top]
  out.append({'target': f'console and report readable at M={top}',
              'measured': {'results_table_lines': r['results_table_lines'],
                           'console_lines_not_progress': r['console_lines_not_progress'],
                           'console_longest_line': r['console_longest_line'],
                           'report_html_rows': r['report_html_rows'],
                           'report_md_lines': r['report_md_lines']},
              # Readable: no printed line or report table grows with M beyond ~2 screens.
              'holds': (r['console_longest_line'] <= 1000 and r['results_table_lines'] <= 64
                        and r['report_html_rows'] <= 200)})
  return out


def _fmt(value: float, unit: str) -> str:
  if value != value:  # NaN
    return '-'
  if unit in ('lines', 'rows', 'chars'):
    return f'{value:,.0f}'
  return f'{value:.3g}' if value < 1000 else f'{value:,.0f}'


def markdown_table(fits: list[dict[str, Any]], members: list[int]) -> str:
  top = [m for m in members if m >= SETUP.fit_from][-2:]
  lines = ['| part | unit | ' + ' | '.join(f'M={m:,}' for m in members)
           + f' | slope {SETUP.fit_from}-{members[-1]:,} | slope {"-".join(f"{m:,}" for m in top)} | growth |',
           '|---|---|' + '---:|' * (len(members) + 2) + '---|']
  for f in fits:
    slopes = ['-' if v is None else f'{v:.2f}' for v in (f['slope_fit'], f['slope_top'])]
    lines.append(f'| {f["label"]} | {f["unit"]} | ' + ' | '.join(
        _fmt(f['values'].get(m, float('nan')), f['unit']) for m in members)
        + f' | {slopes[0]} | {slopes[1]} | {f["growth"]} |')
  return '\n'.join(lines)


FIGURE_PANELS = (
    ('compile (trace + lower + XLA)', 's',
     ('compile_init', 'compile_step', 'compile_eval', 'compile_other')),
    ('training', 's', ('first_step', 'step', 'evaluate', 'exploit')),
    ('after the last step', 's',
     ('final_evaluate', 'final_joint', 'final_decisions', 'temperature', 'greedy', 'report',
      'plan')),
    ('memory and files', 'MB',
     ('rss_steps', 'rss_peak', 'live_bytes', 'state_bytes', 'metrics_jsonl', 'tensorboard', 'members_csv')),
    ('checkpoint of the state', 's', ('checkpoint_save', 'checkpoint_restore')),
    ('per member-example', 'us', ('member_example',)),
)


def plot(fits: list[dict[str, Any]], path: Path, title: str) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  by_part = {f['part']: f for f in fits}
  fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), layout='constrained')
  for ax, (name, unit, parts) in zip(axes.flat, FIGURE_PANELS):
    for part in parts:
      f = by_part[part]
      members = sorted(m for m, v in f['values'].items() if v == v and v > 0)
      if not members:
        continue
      scale = 1e-3 if f['unit'] == 'KB' and unit == 'MB' else 1.0
      slope = '' if f['slope_top'] is None else f' ({f["slope_top"]:.2f})'
      ax.plot(members, [f['values'][m] * scale for m in members], marker='o',
              label=f['label'] + slope)
    ax.set(xscale='log', yscale='log', title=name, xlabel='members M', ylabel=unit)
    ax.set_xticks(sorted({m for f in fits for m in f['values']}))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.minorticks_off()
    ax.grid(True, which='major', alpha=0.3)
    ax.legend(fontsize=7, title='(log-log slope between the two largest M)',
              title_fontsize=7)
  fig.suptitle(title, fontsize=10)
  fig.savefig(path, dpi=90)
  plt.close(fig)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--model', default='mlp', choices=sorted(SETUPS),
                      help='mlp: 1 to 4,096 MLPs; resnet20: 1 to 64 ResNet-20 on digits')
  parser.add_argument('--members', default='', help='comma-separated M (default: the setup\'s)')
  parser.add_argument('--quick', action='store_true', help='the setup\'s short list of M')
  parser.add_argument('--no_plan', action='store_true', help='skip `dist-ens plan`')
  parser.add_argument('--child_timeout', type=int, default=CHILD_TIMEOUT_S,
                      help='seconds each M\'s process and its plan may take (ResNet-20 at '
                      'M=64 on 2 cores needs more than the default)')
  parser.add_argument('--platform', default='cpu', choices=('cpu', 'gpu'),
                      help=f'cpu: {DEVICES} fake CPU devices; gpu: the machine\'s GPUs')
  parser.add_argument('--peak_tflops', type=float, default=None,
                      help='the device\'s peak TFLOP/s: adds the MFU row')
  parser.add_argument('--out', default='', help='results file (default: results/<setup>.json)')
  parser.add_argument('--replot', action='store_true',
                      help='no runs: the fits, targets, table and figure again from --out')
  parser.add_argument('--child', type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument('--steps', type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument('--scratch', default='', help=argparse.SUPPRESS)
  parser.add_argument('--child_out', default='', help=argparse.SUPPRESS)
  parser.add_argument('--step_rounds', default='', help=argparse.SUPPRESS)
  return parser


def main(argv: list[str] | None = None) -> None:
  args = _parser().parse_args(argv)
  global SETUP, PLATFORM, PEAK_TFLOPS, CHILD_TIMEOUT_S, PLAN_TIMEOUT_S  # pylint: disable=global-statement  (a script's settings)
  SETUP, PLATFORM, PEAK_TFLOPS = SETUPS[args.model], args.platform, args.peak_tflops
  CHILD_TIMEOUT_S = PLAN_TIMEOUT_S = args.child_timeout
  args.out = args.out or str(ROOT / 'benchmarks' / 'results' / SETUP.out)
  if args.child:
    child(args.child, args.steps, Path(args.scratch), Path(args.child_out))
    return
  if args.step_rounds:  # M:K,M:K,...
    step_rounds({int(m): int(k) for m, k in (c.split(':') for c in args.step_rounds.split(','))},
                ROUND_SECONDS, ROUNDS, Path(args.child_out))
    return
  if args.replot:
    replot(Path(args.out))
    return
  members = ([int(m) for m in args.members.split(',')] if args.members
             else list(SETUP.quick_members if args.quick else SETUP.members))
  header = harness.run_header()
  started = time.perf_counter()
  rows = []
  with tempfile.TemporaryDirectory(prefix='scaling_') as tmp:
    scratch = Path(tmp)
    disk = disk_write_bandwidth(scratch)
    print(f'dd into {tmp}: ' + ', '.join(f'{k} {v / 1e6:.0f} MB/s' for k, v in disk.items()),
          flush=True)
    for m in members:
      steps = SETUP.steps.get(m, max(20, 20 * round(5e6 / (m * 128) / 20)))
      row = run_child(m, steps, scratch)
      if not args.no_plan and 'failed' not in row:
        row.update(run_plan(m))
      rows.append(row)
      print(f'M={m}: ' + ('FAILED' if 'failed' in row else
                          f'step {row["step_s"] * 1e3:.1f} ms, compile step '
                          f'{row["compile_s"]["train_step"]["total"]:.2f} s, report '
                          f'{row["report_s"]:.1f} s, process {row["process_wall_s"]:.0f} s, '
                          f'load {row["load_average"]}'), flush=True)
      shutil.rmtree(scratch / f'm{m}', ignore_errors=True)
    ran = {r['members']: r['steps_per_call'] for r in rows if 'failed' not in r}
    chosen = {m: ran[m] for m in (SETUP.quick_round_members if args.quick
                                  else SETUP.round_members) if m in ran}
    interleaved = run_step_rounds(chosen, scratch) if len(chosen) > 1 else {}
    console_top = (scratch / f'console_{members[-1]}.txt')
    console_tail = console_top.read_text().splitlines()[-60:] if console_top.exists() else []
  fits = fit_parts(rows)
  goals = targets(rows, fits, disk, interleaved)
  out = Path(args.out)
  import jax  # (only for its version: the parent never starts a backend)
  devices = f'{DEVICES} fake CPU devices' if PLATFORM == 'cpu' else 'the GPUs it sees'
  results = {**header, 'jax': jax.__version__, 'devices': devices, 'platform': PLATFORM,
             'model': args.model, 'peak_tflops': PEAK_TFLOPS,
             'load_average_end': harness.load_average(),
             'wall_s': time.perf_counter() - started,
             'setup': {'config': f'configs/{SETUP.config}', 'overrides': SETUP.overrides,
                       'steps': {m: SETUP.steps.get(m) for m in members},
                       'post_hoc': 'eval.temperature_scaling, select.method=greedy (M picks)'},
             'disk_write_bytes_per_s': disk, 'interleaved_steps': interleaved,
             'targets': goals, 'fits': fits, 'rows': rows,
             'console_tail_top_m': console_tail}
  harness.write_results(out, results)
  report(results, out)


def _title(results: dict[str, Any]) -> str:
  machine = results['machine']
  where = (f'{DEVICES} fake CPU devices on {machine["cores"]} cores ({machine["cpu"]})'
           if results.get('platform', 'cpu') == 'cpu' else results.get('devices', 'GPU'))
  return (f'dist_ens scaling: {where}, {SETUP.label}, {results["date"][:10]}, '
          f'{(results["commit"] or "")[:8]}; load {results["load_average_start"]} -> '
          f'{results["load_average_end"]}')


def report(results: dict[str, Any], out: Path) -> None:
  """The figure beside `out`, the table and the targets printed."""
  figure = out.with_suffix('.png')
  plot(results['fits'], figure, _title(results))
  done = [r['members'] for r in results['rows'] if 'failed' not in r]
  print(markdown_table(results['fits'], done))
  print()
  for goal in results['targets']:
    print(f'- {goal["target"]}: {"holds" if goal["holds"] else "MISSES"}; '
          f'{json.dumps(goal["measured"], default=float)}')
  print(f'wrote {out} and {figure}')


def replot(out: Path) -> None:
  """Fits, targets, table and figure again from a results file's rows (no runs)."""
  results = json.loads(out.read_text())
  interleaved = results.get('interleaved_steps') or {}
  results['fits'] = fit_parts(results['rows'])
  results['targets'] = targets(results['rows'], results['fits'],
                               results['disk_write_bytes_per_s'], interleaved)
  harness.write_results(out, results)
  for f in results['fits']:  # (JSON keys are strings)
    f['values'] = {int(m): v for m, v in f['values'].items()}
  report(results, out)


if __name__ == '__main__':
  main()
