"""Fault injection: interrupt and damage small CLI runs, run them again, check what survives.

  python -m benchmarks.fault_injection [--quick] [--trials N] [--seed S] [--cases a,b]

Each case runs `dist-ens` (as `python -m dist_ens.main`) on configs/default.py made
small (200 steps of 4 tiny MLP members; a log every 20 steps, a test evaluation at
100 and at the end, a checkpoint every 50), injects one fault at a random point,
then runs the same command again and checks the workdir against an uninterrupted
reference run:

  params      the final checkpoint's parameters (`Ensemble.load(workdir).params`)
              equal the reference's bit for bit, at the final step;
  events      metrics.jsonl is strict JSON and holds every scheduled event (train
              every log_every steps, test at eval_every and at the end) exactly once;
  final json  final_metrics.json is valid strict JSON (no NaN / Infinity tokens);
  exit        the re-run exits 0; a run that fails says why in one line (the CLI's
              'dist-ens: error: ...') with no traceback on stderr; one stopped by the
              fault exits by that signal or cleanly, and never hangs (every child is
              bounded by `timeout -k 5`).

Cases: sigkill, sigterm, sigint (the signal at a random time; sigterm and sigint must
exit 143 and 130, not 0, when they stopped the run before its end), sigterm_twice and
sigint_twice (the second 0.3 s after the first: stop at once, 143 or 130), kill_mid_eval and
kill_final_eval (SIGKILL once the train event of step EVAL_EVERY, or of the last
step, is written, i.e. in that step's evaluation),
concurrent (two runs at once on one workdir: one may refuse with one line, the
workdir being locked), corrupt_checkpoint (garbage over the
newest checkpoint's largest file after a kill), non_utf8_meta (bytes that are not UTF-8
over the newest checkpoint's metadata after a kill; for both, where it was the only
checkpoint, a one-line refusal to start over also holds), corrupt_config / missing_config
(config.json damaged or deleted after a kill; a clear one-line refusal also holds),
lost_metrics (metrics.jsonl deleted or truncated after a kill: one warning naming the lost
events, the final parameters unchanged),
disk_full (the workdir on a small tmpfs, which needs root to mount: skipped, and
reported as skipped, where mounting fails; then the tmpfs is enlarged and the run
re-run).

Many cases are expected to fail while known defects are being fixed: the script
reports, it does not judge. Prints a table and writes
benchmarks/results/fault_injection.json: harness.run_header's fields (this script's command,
its checkout's commit, date, load averages, machine), the CLI command under test
(cli_command) and the commit of the checkout it ran (source_commit). Signals go to the
Python process itself, not to `timeout` (which would forward SIGTERM and then SIGKILL it
5 s later).
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = harness.ROOT
RESULTS = ROOT / 'benchmarks' / 'results' / 'fault_injection.json'

STEPS, LOG_EVERY, EVAL_EVERY, CHECKPOINT_EVERY = 200, 20, 100, 50
OVERRIDES = [f'--config.train.steps={STEPS}', f'--config.train.log_every={LOG_EVERY}',
             f'--config.train.eval_every={EVAL_EVERY}',
             f'--config.checkpoint.every={CHECKPOINT_EVERY}', '--config.num_members=4',
             '--config.model.widths=(16,)', '--config.data.batch_size=32']
# A user's second Ctrl-C comes after the first has had time to act (the run is saving).
SECOND_SIGNAL_AFTER_S = 0.3
TRACEBACK = 'Traceback (most recent call last)'
ERROR_PREFIX = 'dist-ens: error:'


@dataclass
class Outcome:
  """One CLI run: exit status (timeout's: 124 = timed out, 128+N = signal N), stderr."""
  rc: int
  stderr: str
  seconds: float
  signalled_at: float | None = None  # seconds after start; None: no signal was sent


@dataclass
class Context:
  """What every case needs: where the code is, the reference, a random source."""
  source: Path
  root: Path
  limit_s: int
  reference_seconds: float
  reference_params: list[Any]
  rng: random.Random
  details: dict[str, Any] = field(default_factory=dict)


# --- running the CLI --------------------------------------------------------------------


def command(workdir: Path, limit_s: int) -> list[str]:
  """The bounded CLI command on `workdir` (the same for a run and its re-run)."""
  return ['timeout', '-k', '5', str(limit_s), sys.executable, '-m', 'dist_ens.main',
          '--config=configs/default.py', f'--workdir={workdir}', *OVERRIDES]


def start(source: Path, workdir: Path, limit_s: int, tag: str) -> tuple[subprocess.Popen, Path]:
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(source))
  log = workdir.parent / f'{workdir.name}.{tag}.stderr'
  with open(log, 'w') as stderr:
    proc = subprocess.Popen(command(workdir, limit_s), cwd=source, env=env,
                            stdout=subprocess.DEVNULL, stderr=stderr)
  return proc, log


def python_pid(proc: subprocess.Popen) -> int | None:
  """The pid of the Python child of `timeout` (None once it has gone)."""
  deadline = time.monotonic() + 10
  while proc.poll() is None and time.monotonic() < deadline:
    try:
      children = Path(f'/proc/{proc.pid}/task/{proc.pid}/children').read_text().split()
    except OSError:
      children = []
    if children:
      return int(children[0])
    time.sleep(0.01)
  return None


def finish(proc: subprocess.Popen, log: Path, started: float,
           signalled_at: float | None = None) -> Outcome:
  rc = proc.wait()
  return Outcome(rc, log.read_text(errors='replace'), time.monotonic() - started, signalled_at)


def pending(pid: int, signum: int) -> bool:
  """Whether `signum` still waits for delivery to `pid` (Linux's masks in /proc)."""
  try:
    status = Path(f'/proc/{pid}/status').read_text().splitlines()
  except OSError:
    return False
  masks = [int(l.split()[1], 16) for l in status if l.startswith(('SigPnd:', 'ShdPnd:'))]
  return any(mask >> (signum - 1) & 1 for mask in masks)


def run_cli(ctx: Context, workdir: Path, tag: str, signum: int | None = None,
            when: Callable[[float], bool] | None = None, times: int = 1) -> Outcome:
  """Runs the CLI on `workdir`; sends `signum` to it `times` times once `when(elapsed)` is
  true, each after the one before was delivered and had SECOND_SIGNAL_AFTER_S to act (two
  still pending would merge into one)."""
  started = time.monotonic()
  proc, log = start(ctx.source, workdir, ctx.limit_s, tag)
  signalled_at = None
  if signum is not None:
    pid = python_pid(proc)
    while proc.poll() is None and not when(time.monotonic() - started):
      time.sleep(0.02)
    for i in range(times):
      while pid is not None and pending(pid, signum) and proc.poll() is None:
        time.sleep(0.001)
      if i:
        time.sleep(SECOND_SIGNAL_AFTER_S)
      if proc.poll() is None and pid is not None:
        signalled_at = signalled_at or time.monotonic() - started
        os.kill(pid, signum)
  return finish(proc, log, started, signalled_at)


def at_random_time(ctx: Context, low: float, high: float) -> Callable[[float], bool]:
  """A trigger at a uniform random fraction in [low, high] of the reference's duration."""
  at = ctx.rng.uniform(low, high) * ctx.reference_seconds
  ctx.details['signal_planned_at_s'] = round(at, 2)
  return lambda elapsed: elapsed >= at


# --- checks -----------------------------------------------------------------------------


def scheduled_events(steps: int = STEPS, log_every: int = LOG_EVERY,
                     eval_every: int = EVAL_EVERY) -> list[tuple[int, str]]:
  """(step, split) of every event a complete run writes, in order."""
  events = []
  for step in range(1, steps + 1):
    if step % log_every == 0 or step == steps:
      events.append((step, 'train'))
    if (eval_every and step % eval_every == 0) or step == steps:
      events.append((step, 'test'))
  return events


def _reject_constant(token: str) -> None:
  raise ValueError(f'non-JSON token {token}')


def strict_json(text: str) -> Any:
  """json.loads that refuses NaN / Infinity (not JSON, though Python writes them)."""
  return json.loads(text, parse_constant=_reject_constant)


def check_events(path: Path, scheduled: list[tuple[int, str]]) -> list[str]:
  """Problems with metrics.jsonl: bad lines, and events missing, repeated or unexpected."""
  if not path.exists():
    return ['metrics.jsonl missing']
  problems, seen = [], Counter()
  for number, line in enumerate(path.read_text(errors='replace').splitlines(), 1):
    try:
      event = strict_json(line)
      seen[(int(event['step']), str(event['split']))] += 1
    except (ValueError, KeyError, TypeError) as e:
      problems.append(f'metrics.jsonl line {number} invalid ({type(e).__name__})')
  missing = [e for e in scheduled if seen[e] == 0]
  repeated = sorted(e for e, n in seen.items() if n > 1)
  unexpected = sorted(e for e in seen if e not in set(scheduled))
  for label, events in (('missing', missing), ('repeated', repeated),
                        ('unexpected', unexpected)):
    if events:
      problems.append(f'events {label}: ' + ' '.join(f'{s}/{split}' for s, split in events))
  return problems


def check_final_json(path: Path) -> list[str]:
  if not path.exists():
    return ['final_metrics.json missing']
  try:
    strict_json(path.read_text(errors='replace'))
  except ValueError as e:
    return [f'final_metrics.json not strict JSON ({str(e).splitlines()[0][:60]})']
  return []


def check_exit(outcome: Outcome, what: str, signum: int | None = None) -> list[str]:
  """A run ended well: 0, or the signal sent (with no traceback), or one clear error line."""
  if outcome.rc in (124, 137):
    return [f'{what} hung (killed by timeout after {outcome.seconds:.0f}s)']
  problems = [f'{what}: traceback on stderr'] if TRACEBACK in outcome.stderr else []
  by_signal = signum is not None and outcome.rc in (128 + signum, -signum)
  if outcome.rc != 0 and not by_signal:
    lines = [l for l in outcome.stderr.splitlines() if l.strip()]
    if not lines or not lines[-1].startswith(ERROR_PREFIX):
      problems.append(f'{what}: exit {outcome.rc} without a one-line error')
  return problems


def check_stopped_status(outcome: Outcome, workdir: Path) -> list[str]:
  """A run a signal stopped before the end must not exit 0 (`dist-ens && next` would go on)."""
  if outcome.rc == 0 and not (workdir / 'final_metrics.json').exists():
    return ['faulted run exited 0 though it stopped before the end']
  return []


def load_params(workdir: Path) -> tuple[int, list[Any]]:
  """The newest checkpoint's step and parameter leaves (numpy), via the public API."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from dist_ens import Ensemble  # pylint: disable=import-outside-toplevel
  ensemble = Ensemble.load(workdir)
  return ensemble.step, [np.asarray(leaf) for leaf in jax.tree.leaves(ensemble.params)]


def check_params(ctx: Context, workdir: Path) -> list[str]:
  try:
    step, leaves = load_params(workdir)
  except Exception as e:  # pylint: disable=broad-except
    return [f'Ensemble.load failed ({type(e).__name__})']
  if step != STEPS:
    return [f'newest checkpoint at step {step}, not {STEPS}']
  same = len(leaves) == len(ctx.reference_params) and all(
      a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
      for a, b in zip(leaves, ctx.reference_params))
  return [] if same else ['params differ from the reference']


def check_survivors(ctx: Context, workdir: Path, rerun: Outcome) -> list[str]:
  """Everything a finished re-run must leave behind."""
  problems = check_exit(rerun, 're-run')
  if rerun.rc != 0:  # What it left is not a finished run's; listing it all adds noise.
    return problems + [f're-run exit {rerun.rc}, so no finished run to check']
  problems += check_params(ctx, workdir)
  problems += check_events(workdir / 'metrics.jsonl', scheduled_events())
  problems += check_final_json(workdir / 'final_metrics.json')
  return problems


def refused_clearly(rerun: Outcome, mentions: str) -> bool:
  """The re-run stopped with one clear line that names `mentions`, no traceback."""
  lines = [l for l in rerun.stderr.splitlines() if l.strip()]
  return (rerun.rc not in (0, 124, 137) and TRACEBACK not in rerun.stderr and bool(lines)
          and lines[-1].startswith(ERROR_PREFIX) and mentions in lines[-1])


# --- cases: each returns its problems ([] = held) -----------------------------------------


def case_signal(ctx: Context, workdir: Path, signum: int, times: int = 1) -> list[str]:
  """`signum` (`times` times) at a random time of the run, then the same command again."""
  fault = run_cli(ctx, workdir, 'fault', signum, at_random_time(ctx, 0.2, 1.0), times)
  ctx.details.update(fault_rc=fault.rc, signalled_at_s=fault.signalled_at)
  # A SIGKILLed process says nothing; a SIGTERMed or SIGINTed one must end cleanly.
  problems = []
  if signum != signal.SIGKILL:
    problems = check_exit(fault, 'faulted run', signum) + check_stopped_status(fault, workdir)
  rerun = run_cli(ctx, workdir, 'rerun')
  ctx.details['rerun_rc'] = rerun.rc
  return problems + check_survivors(ctx, workdir, rerun)


def case_kill_in_eval(ctx: Context, workdir: Path, step: int) -> list[str]:
  """SIGKILL as soon as step `step`'s train event is in metrics.jsonl: in its evaluation
  (a checkpoint step too: the final one, or EVAL_EVERY)."""
  train_event = f'"step": {step}, "split": "train"'
  metrics = workdir / 'metrics.jsonl'

  def in_eval(_: float) -> bool:
    return metrics.exists() and train_event in metrics.read_text(errors='replace')

  fault = run_cli(ctx, workdir, 'fault', signal.SIGKILL, in_eval)
  test_event = f'"step": {step}, "split": "test"'
  landed = fault.signalled_at is not None and test_event not in metrics.read_text(
      errors='replace')
  ctx.details.update(fault_rc=fault.rc, signalled_at_s=fault.signalled_at,
                     killed_before_its_test_event=landed)
  rerun = run_cli(ctx, workdir, 'rerun')
  ctx.details['rerun_rc'] = rerun.rc
  return check_survivors(ctx, workdir, rerun)


def case_concurrent(ctx: Context, workdir: Path) -> list[str]:
  """Two runs at once on one workdir; then the command once more."""
  started = time.monotonic()
  runs = [start(ctx.source, workdir, ctx.limit_s, f'concurrent{i}') for i in (0, 1)]
  outcomes = [finish(proc, log, started) for proc, log in runs]
  ctx.details['concurrent_rcs'] = [o.rc for o in outcomes]
  problems = []
  for i, outcome in enumerate(outcomes):
    problems += check_exit(outcome, f'concurrent run {i}')
  if all(o.rc == 0 for o in outcomes):
    ctx.details['note'] = 'both concurrent runs exited 0 (no lock)'
  elif any(refused_clearly(o, 'is in use by another run') for o in outcomes):
    ctx.details['note'] = 'one run refused: the workdir is in use by the other'
  problems += check_params(ctx, workdir) + check_events(workdir / 'metrics.jsonl',
                                                        scheduled_events())
  rerun = run_cli(ctx, workdir, 'rerun')
  ctx.details['rerun_rc'] = rerun.rc
  return problems + [f'after re-run: {p}' for p in check_survivors(ctx, workdir, rerun)]


def _newest_checkpoint(workdir: Path) -> Path | None:
  steps = [p for p in (workdir / 'checkpoints').glob('*') if p.name.isdigit()]
  return max(steps, key=lambda p: int(p.name), default=None)


def kill_after_a_checkpoint(ctx: Context, workdir: Path) -> Outcome:
  """A run SIGKILLed a random time after its first checkpoint appeared."""
  delay = ctx.rng.uniform(0.0, 0.6) * ctx.reference_seconds
  first_seen = []

  def after_a_checkpoint(elapsed: float) -> bool:
    if not first_seen and _newest_checkpoint(workdir) is not None:
      first_seen.append(elapsed)
    return bool(first_seen) and elapsed >= first_seen[0] + delay

  return run_cli(ctx, workdir, 'fault', signal.SIGKILL, after_a_checkpoint)


def case_corrupt_checkpoint(ctx: Context, workdir: Path) -> list[str]:
  """SIGKILL some time after the first checkpoint, garbage over the newest one, re-run."""
  fault = kill_after_a_checkpoint(ctx, workdir)
  newest = _newest_checkpoint(workdir)
  if newest is None:
    return ['no checkpoint was written to corrupt']
  files = sorted((p for p in newest.rglob('*') if p.is_file()), key=lambda p: p.stat().st_size)
  target = files[-1]
  data = bytearray(target.read_bytes())
  middle = len(data) // 2
  data[middle:middle + 64] = ctx.rng.randbytes(min(64, len(data) - middle))
  target.write_bytes(bytes(data))
  ctx.details.update(fault_rc=fault.rc, signalled_at_s=fault.signalled_at,
                     corrupted=str(target.relative_to(workdir)))
  rerun = run_cli(ctx, workdir, 'rerun')
  ctx.details['rerun_rc'] = rerun.rc
  refused = _only_refused(ctx, workdir, newest, rerun)
  return check_survivors(ctx, workdir, rerun) if refused is None else refused


def _only_refused(ctx: Context, workdir: Path, newest: Path, rerun: Outcome) -> list[str] | None:
  """[] where the damaged checkpoint was the only one and the re-run refused with one clear
  line (nothing older to fall back on; starting over silently could lose a run), else None."""
  only = [p for p in (workdir / 'checkpoints').glob('*') if p.name.isdigit()] == [newest]
  if only and refused_clearly(rerun, 'can be restored'):
    ctx.details['note'] = 'the only checkpoint was damaged: re-run refused with one clear line'
    return []
  return None


def case_non_utf8_meta(ctx: Context, workdir: Path) -> list[str]:
  """SIGKILL after a checkpoint, then bytes that are not UTF-8 over the newest checkpoint's
  metadata (a torn write), then the same command again."""
  fault = kill_after_a_checkpoint(ctx, workdir)
  newest = _newest_checkpoint(workdir)
  if newest is None or not (newest / 'meta' / 'metadata').exists():
    return ['no checkpoint metadata was written to damage']
  (newest / 'meta' / 'metadata').write_bytes(b'\xff\xfe' + ctx.rng.randbytes(30))
  ctx.details.update(fault_rc=fault.rc, signalled_at_s=fault.signalled_at,
                     damaged=str(newest.relative_to(workdir)))
  rerun = run_cli(ctx, workdir, 'rerun')
  ctx.details['rerun_rc'] = rerun.rc
  refused = _only_refused(ctx, workdir, newest, rerun)
  return check_survivors(ctx, workdir, rerun) if refused is None else refused


def case_config(ctx: Context, workdir: Path, damage: str) -> list[str]:
  """SIGKILL mid-run, then config.json truncated ('corrupt') or deleted ('missing')."""
  fault = run_cli(ctx, workdir, 'fault', signal.SIGKILL, at_random_time(ctx, 0.4, 0.9))
  config = workdir / 'config.json'
  if damage == 'missing':
    config.unlink(missing_ok=True)
  elif config.exists():
    text = config.read_text()
    config.write_text(text[:ctx.rng.randrange(1, max(2, len(text) // 2))])
  ctx.details.update(fault_rc=fault.rc, signalled_at_s=fault.signalled_at)
  rerun = run_cli(ctx, workdir, 'rerun')
  ctx.details['rerun_rc'] = rerun.rc
  if refused_clearly(rerun, 'config.json'):
    ctx.details['note'] = 're-run refused with one clear line naming config.json'
    return []
  return check_survivors(ctx, workdir, rerun)


def case_lost_metrics(ctx: Context, workdir: Path) -> list[str]:
  """SIGKILL after a checkpoint, then metrics.jsonl deleted or cut to its first line: the
  re-run ends where the reference does and says once which events are lost."""
  fault = kill_after_a_checkpoint(ctx, workdir)
  path, damage = workdir / 'metrics.jsonl', ctx.rng.choice(['deleted', 'truncated'])
  if damage == 'deleted':
    path.unlink(missing_ok=True)
  elif path.exists():
    path.write_text(''.join(path.read_text().splitlines(keepends=True)[:1]))
  ctx.details.update(fault_rc=fault.rc, signalled_at_s=fault.signalled_at, damage=damage)
  rerun = run_cli(ctx, workdir, 'rerun')
  ctx.details['rerun_rc'] = rerun.rc
  said = [l for l in rerun.stderr.splitlines() if 'metrics.jsonl' in l and ' lost' in l]
  problems = check_exit(rerun, 're-run') + check_params(ctx, workdir)
  return problems + ([] if len(said) == 1 else [f'{len(said)} lines about lost events, not 1'])


def case_disk_full(ctx: Context, workdir: Path) -> list[str] | None:
  """The workdir on a tmpfs too small for the run; then enlarged and re-run. None: skipped."""
  workdir.mkdir()
  size_kb = ctx.rng.randrange(48, 200, 4)
  mount = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size_kb}k', 'tmpfs',
                          str(workdir)], capture_output=True, text=True)
  if mount.returncode:
    ctx.details['skipped'] = f'cannot mount a tmpfs: {mount.stderr.strip()[:100]}'
    return None
  try:
    ctx.details['tmpfs_kb'] = size_kb
    fault = run_cli(ctx, workdir, 'fault')
    ctx.details['fault_rc'] = fault.rc
    problems = check_exit(fault, 'run on a full disk')
    if fault.rc == 0:
      problems.append(f'run on a {size_kb} KiB disk exited 0')
    subprocess.run(['mount', '-o', 'remount,size=64m', str(workdir)], check=True)
    rerun = run_cli(ctx, workdir, 'rerun')
    ctx.details['rerun_rc'] = rerun.rc
    return problems + check_survivors(ctx, workdir, rerun)
  finally:
    subprocess.run(['umount', str(workdir)], check=False)


CASES: dict[str, Callable[[Context, Path], list[str] | None]] = {
    'sigkill': lambda ctx, w: case_signal(ctx, w, signal.SIGKILL),
    'sigterm': lambda ctx, w: case_signal(ctx, w, signal.SIGTERM),
    'sigint': lambda ctx, w: case_signal(ctx, w, signal.SIGINT),
    'sigterm_twice': lambda ctx, w: case_signal(ctx, w, signal.SIGTERM, times=2),
    'sigint_twice': lambda ctx, w: case_signal(ctx, w, signal.SIGINT, times=2),
    'kill_mid_eval': lambda ctx, w: case_kill_in_eval(ctx, w, EVAL_EVERY),
    'kill_final_eval': lambda ctx, w: case_kill_in_eval(ctx, w, STEPS),
    'concurrent': case_concurrent,
    'corrupt_checkpoint': case_corrupt_checkpoint,
    'non_utf8_meta': case_non_utf8_meta,
    'corrupt_config': lambda ctx, w: case_config(ctx, w, 'corrupt'),
    'missing_config': lambda ctx, w: case_config(ctx, w, 'missing'),
    'disk_full': case_disk_full,
    'lost_metrics': case_lost_metrics,
}


# --- driver -----------------------------------------------------------------------------


def reference(source: Path, root: Path, limit_s: int) -> tuple[float, list[Any]]:
  """Runs the uninterrupted reference; returns its duration and final parameters."""
  workdir = root / 'reference'
  ctx = Context(source, root, limit_s, 0.0, [], random.Random(0))
  outcome = run_cli(ctx, workdir, 'run')
  if outcome.rc != 0:
    tail = '\n'.join(outcome.stderr.splitlines()[-5:])
    sys.exit(f'fault_injection: the reference run failed (exit {outcome.rc}):\n{tail}')
  problems = (check_events(workdir / 'metrics.jsonl', scheduled_events())
              + check_final_json(workdir / 'final_metrics.json'))
  if problems:
    print(f'note: the reference run itself has problems: {problems}')
  step, params = load_params(workdir)
  assert step == STEPS, step
  return outcome.seconds, params


def run_case(ctx: Context, name: str, trial: int) -> dict[str, Any]:
  ctx.details = {'trial': trial}
  workdir = ctx.root / f'{name}_{trial}'
  started = time.monotonic()
  try:
    problems = CASES[name](ctx, workdir)
  except Exception as e:  # pylint: disable=broad-except
    problems = [f'fault_injection itself failed: {type(e).__name__}: {e}']
  result = dict(ctx.details, seconds=round(time.monotonic() - started, 1))
  if problems is None:
    result['status'] = 'skipped'
  else:
    result.update(status='held' if not problems else 'failed', problems=problems)
  return result


def summarize(name: str, trials: list[dict[str, Any]]) -> dict[str, Any]:
  reasons = Counter(p for t in trials for p in t.get('problems', []))
  return {'trials': len(trials),
          'held': sum(t['status'] == 'held' for t in trials),
          'failed': sum(t['status'] == 'failed' for t in trials),
          'skipped': sum(t['status'] == 'skipped' for t in trials),
          'what_failed': dict(reasons.most_common()), 'runs': trials}


def print_table(summary: dict[str, dict[str, Any]]) -> None:
  print(f'\n| case | trials | held | failed | what failed |\n|---|---|---|---|---|')
  for name, s in summary.items():
    what = '; '.join(f'{p} (x{n})' if n > 1 else p for p, n in s['what_failed'].items())
    if s['skipped']:
      skipped = {t.get('skipped', '') for t in s['runs'] if t['status'] == 'skipped'}
      what = (what + '; ' if what else '') + f'skipped {s["skipped"]}: ' + ', '.join(skipped)
    print(f"| {name} | {s['trials']} | {s['held']} | {s['failed']} | {what or '-'} |")


def _commit(source: Path) -> str:
  """The checkout's HEAD commit (with '+changes' where its tree differs), '' if not git."""
  try:
    head = subprocess.run(['git', '-C', str(source), 'rev-parse', '--short', 'HEAD'],
                          capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(['git', '-C', str(source), 'status', '--porcelain', '--untracked-files=no'],
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return ''
  return head + ('+changes' if dirty else '')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--cases', default=','.join(CASES), help='comma-separated; default: all')
  parser.add_argument('--trials', type=int, default=3, help='trials per case')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--quick', action='store_true', help='one trial per case')
  parser.add_argument('--source', type=Path, default=ROOT,
                      help='the dist_ens checkout to run (default: this one)')
  parser.add_argument('--keep', action='store_true', help='keep the workdirs (path printed)')
  parser.add_argument('--out', type=Path, default=RESULTS)
  args = parser.parse_args()
  names = [n.strip() for n in args.cases.split(',') if n.strip()]
  unknown = [n for n in names if n not in CASES]
  if unknown:
    sys.exit(f'fault_injection: unknown case(s) {unknown}; valid: {", ".join(CASES)}')
  trials = 1 if args.quick else args.trials
  header, source = harness.run_header(), args.source.resolve()
  # Deliberate: --source picks which checkout's dist_ens is under test; the CLI children
  # get it by cwd and PYTHONPATH, and this process's Ensemble.load (load_params, imported
  # lazily) must read their checkpoints with that same checkout's code, not this one's.
  sys.path.insert(0, str(source))
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  root = Path(tempfile.mkdtemp(prefix='fault_injection_'))
  started = time.monotonic()
  try:
    limit_s = 300
    ref_seconds, ref_params = reference(source, root, limit_s)
    limit_s = int(3 * ref_seconds + 60)
    print(f'reference run: {ref_seconds:.1f}s; each child bounded by timeout -k 5 {limit_s}')
    ctx = Context(source, root, limit_s, ref_seconds, ref_params, random.Random(args.seed))
    summary = {}
    for name in names:
      runs = []
      for trial in range(trials):
        runs.append(run_case(ctx, name, trial))
        print(f'{name} trial {trial}: {runs[-1]["status"]} {runs[-1].get("problems", "")}',
              flush=True)
      summary[name] = summarize(name, runs)
  finally:
    if args.keep:
      print(f'workdirs kept in {root}')
    else:
      shutil.rmtree(root, ignore_errors=True)
  print_table(summary)
  harness.write_results(args.out, {
      **header,
      'cli_command': ' '.join(['dist-ens --config=configs/default.py --workdir=W', *OVERRIDES]),
      'source': str(source), 'source_commit': _commit(source), 'seed': args.seed,
      'trials_per_case': trials, 'reference_seconds': round(ref_seconds, 1),
      'child_limit_s': limit_s, 'total_seconds': round(time.monotonic() - started, 1),
      'cases': summary, 'load_average_end': harness.load_average()})
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
