"""Bad input and unsafe resumes stop with one clear error naming the field; nothing is lost."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import jax
import numpy as np
import pytest

import runs
import support

import dist_ens
from dist_ens.errors import ConfigError, TrainingError
from dist_ens.training import trainer, workdir as workdir_lib
from dist_ens.training.workdir import WorkdirInUse, WorkdirLock

ROOT = Path(__file__).resolve().parents[1]


def _config(**overrides):
  # eval.joint_tau=0: the scheduled events only (the joint log-loss adds its own).
  return support.config({'train.steps': 8, 'train.log_every': 4, 'eval.joint_tau': 0},
                        **overrides)


# The session's shared finished run (tests/runs.py): _config() keeping both its
# checkpoints (4 and 8), and evaluated at both (a field a resume may change), the workdir
# that the tests which refuse, lock, extend or damage a finished run start from (each on
# a copy).
KEEP3 = {'checkpoint__keep': 3}
assert runs.TINY == {'train.steps': 8, 'train.log_every': 4, 'train.eval_every': 4,
                     'eval.joint_tau': 0, 'checkpoint.keep': 3}  # _config(**KEEP3)


@pytest.fixture(scope='module')
def finished(tiny_run):
  return tiny_run[0]


def _copy(finished_run, to):
  runs.copy(finished_run, to)


@pytest.mark.parametrize('overrides,message', [
    (dict(optim__learning_rate=1e-300), 'config.optim.learning_rate'),
    (dict(optim__learning_rate=[1e-3, 1e39, 1e-3, 1e-3]), 'config.optim.learning_rate'),
    (dict(data__std=(1e-300,)), 'config.data.std'),
    (dict(data__mean=(1e300,)), 'config.data.mean'),
    (dict(optim__eps=0.0), 'config.optim.eps'),
    (dict(optim__b2=1.0), 'config.optim.b2'),
    (dict(train__sync_every=64, mesh__member=4, mesh__data=2), 'config.train.sync_every=64'),
])
def test_values_that_do_not_survive_float32_or_deadlock_are_refused(tmp_path, overrides, message):
  with pytest.raises(ConfigError, match=message.replace('.', r'\.')):
    dist_ens.train(_config(**overrides), str(tmp_path / 'w'))
  assert not (tmp_path / 'w').exists()


def test_empty_workdir_is_refused(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ConfigError, match='--workdir is empty'):
    dist_ens.train(_config(), '')
  assert not list(tmp_path.iterdir())


def test_lowering_steps_below_the_checkpoint_is_refused(tmp_path, finished):
  _copy(finished, tmp_path)
  with pytest.raises(ConfigError, match='checkpoint at step 8; train.steps cannot go back'):
    dist_ens.train(_config(train__steps=4, **KEEP3), str(tmp_path))


def test_extending_a_decaying_schedule_must_be_allowed_explicitly(tmp_path, finished):
  dist_ens.train(_config(optim__schedule='cosine'), str(tmp_path))
  with pytest.raises(ConfigError, match='train.steps shapes the learning-rate schedule'):
    dist_ens.train(_config(optim__schedule='cosine', train__steps=12), str(tmp_path))
  final = dist_ens.train(_config(optim__schedule='cosine', train__steps=12,
                                 checkpoint__restore_incompatible='train.steps'), str(tmp_path))
  assert final['step'] == 12
  # A constant schedule does not depend on train.steps: extending it needs no permission.
  _copy(finished, tmp_path / 'constant')
  extended = dist_ens.train(_config(train__steps=12, **KEEP3), str(tmp_path / 'constant'))
  assert extended['step'] == 12


def test_on_nonfinite_stop_holds_on_every_rerun_and_releases_the_lock(tmp_path):
  """A stopped run raises, and releases the workdir's lock (the next run takes it with no
  takeover); each rerun stops again until on_nonfinite is switched to 'freeze'."""
  bad = _config(optim__learning_rate=[1e-3, 1e-3, 1e-3, 1e30], train__on_nonfinite='stop')
  with pytest.raises(TrainingError, match=r'members \[3\] went non-finite'):
    dist_ens.train(bad, str(tmp_path))
  assert (tmp_path / '.lock').read_text() == ''
  with WorkdirLock(tmp_path):  # Free: taking it does not raise.
    pass
  with pytest.raises(TrainingError, match=r"members \[3\] went non-finite before step"):
    dist_ens.train(bad, str(tmp_path))
  # Switching to 'freeze' (allowed) trains the others on.
  final = dist_ens.train(_config(optim__learning_rate=[1e-3, 1e-3, 1e-3, 1e30],
                                 train__on_nonfinite='freeze',
                                 checkpoint__restore_incompatible='train.on_nonfinite'),
                         str(tmp_path))
  assert final['frozen_members'] == [3] and np.isfinite(final['ensemble']['nll'])


def test_a_second_run_on_a_live_workdir_stops_naming_the_other_pid_and_writes_nothing(
    tmp_path, finished):
  workdir = tmp_path / 'w'
  _copy(finished, workdir)
  files = lambda: {p: p.read_bytes() for p in workdir.rglob('*') if p.is_file()}
  with WorkdirLock(workdir):  # Another live run: an flock on workdir/.lock.
    held, before = (workdir / '.lock').read_text(), files()
    with pytest.raises(WorkdirInUse, match=re.escape(
        f'{workdir} is in use by another run (pid {os.getpid()} on host ')):
      dist_ens.train(_config(train__steps=12, **KEEP3), str(workdir))
    assert files() == before and held
  assert (workdir / '.lock').read_text() == ''  # Released: the next run needs no takeover.


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(tmp_path):
  workdir = tmp_path / 'w'
  # A run that took the lock and was killed -9: the kernel drops its flock, the file stays.
  # The run is a fork of this process (a new interpreter would import jax for 1.5 CPU s):
  # it only takes the lock, file operations in Python, and is killed before it touches
  # anything JAX's threads hold, so the warnings about forking a threaded process (JAX's,
  # and Python's own from 3.12) do not apply.
  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', r'.*fork\(\)')
    holder = os.fork()
  if holder == 0:  # The child: however acquire ends, it dies here, by a kill -9.
    try:
      WorkdirLock(workdir).acquire()
    finally:
      os.kill(os.getpid(), signal.SIGKILL)
  _, status = os.waitpid(holder, 0)
  assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
  dead_pid = json.loads((workdir / '.lock').read_text())['pid']
  assert dead_pid == holder
  with mock.patch.object(workdir_lib.logging, 'warning') as warning:
    with WorkdirLock(workdir):
      assert json.loads((workdir / '.lock').read_text())['pid'] == os.getpid()
  (message, *args), _ = warning.call_args
  assert 'taking over the lock' in message and f'pid {dead_pid} ' in message % tuple(args)


def _events(workdir):
  lines = (workdir / 'metrics.jsonl').read_text().splitlines()
  return sorted((e['step'], e['split']) for e in map(json.loads, lines))


SCHEDULED = [(4, 'test'), (4, 'train'), (8, 'test'), (8, 'train')]


class Killed(BaseException):
  """Stands for a kill -9 (BaseException: nothing in train catches it)."""


def test_a_kill_during_an_evaluation_loses_no_event(tmp_path, monkeypatch):
  """A run started where another failed before its first checkpoint (which left
  config.json and no checkpoint: it binds nothing) dies in the evaluation of step 4 (a
  checkpoint step), then, in the rerun that resumes from it, in the evaluation of the last
  step; train's cleanup lets the checkpoint saves already started finish, as a kill lets
  orbax's. Each rerun writes what its kill lost."""
  (tmp_path / 'config.json').write_text('{"num_members": 3}')
  evaluate, kills = dist_ens.evaluators.metrics.Evaluate.run, [4, 8]

  def dies_once_at_each_kill(self, call):
    if kills and call.step == kills[0]:
      del kills[0]
      raise Killed
    evaluate(self, call)

  monkeypatch.setattr(dist_ens.evaluators.metrics.Evaluate, 'run', dies_once_at_each_kill)
  with pytest.raises(Killed):
    dist_ens.train(_config(train__eval_every=4), str(tmp_path))
  assert json.loads((tmp_path / 'config.json').read_text())['num_members'] == 4
  assert kills == [8] and _events(tmp_path) == [(4, 'train')]  # Step 4's evaluation lost.
  with pytest.raises(Killed):
    dist_ens.train(_config(train__eval_every=4), str(tmp_path))
  # The rerun wrote it; its own kill lost step 8's.
  assert not kills and _events(tmp_path) == [(4, 'test'), (4, 'train'), (8, 'train')]
  final = dist_ens.train(_config(train__eval_every=4), str(tmp_path))
  assert _events(tmp_path) == SCHEDULED
  assert final['step'] == 8 and final['num_members'] == 4


def test_a_kill_before_final_metrics_reruns_without_training(tmp_path, monkeypatch, finished):
  """Killed in the finish of a resumed run (a copy of the shared finished run without its
  final metrics: what a kill before they are written leaves; its events hold steps 4 and
  8); the rerun trains nothing and writes them."""
  runs.killed_after(finished, 8, tmp_path)
  finish = trainer._finish

  def dies_once(call, *args):
    if not (tmp_path / 'died').exists():
      (tmp_path / 'died').touch()
      raise Killed
    return finish(call, *args)

  monkeypatch.setattr(trainer, '_finish', dies_once)
  with pytest.raises(Killed):
    dist_ens.train(_config(train__eval_every=4, **KEEP3), str(tmp_path))
  assert not (tmp_path / 'final_metrics.json').exists()
  final = dist_ens.train(_config(train__eval_every=4, **KEEP3), str(tmp_path))
  assert _events(tmp_path) == SCHEDULED  # No step was run again: no second train event.
  assert json.loads((tmp_path / 'final_metrics.json').read_text())['members'] == final['members']


# The CLI with any write that would grow a file past 8 KiB failing with EFBIG, as writes
# on a full disk fail with ENOSPC: the same OSError path through every writer, orbax's
# included (the optimizer's checkpoint file is ~13 KiB). SIGXFSZ ignored: an error, not a kill.
_CLI_WITH_SMALL_FILES = (
    'import resource, runpy, signal, sys;'
    'resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY));'
    'signal.signal(signal.SIGXFSZ, signal.SIG_IGN);'
    'sys.argv[0] = "dist-ens"; runpy.run_module("dist_ens.main", run_name="__main__")')


def test_a_full_disk_stops_with_one_line_keeps_the_checkpoint_and_resumes(tmp_path, finished):
  # support.config's (16,) MLP, whose programs `finished` compiled: the step-8 checkpoint's
  # optimizer data file is ~25 KiB, 3x the 8 KiB limit, and the model's ~10 KiB (with
  # widths 8 they are 7-8.5 KiB, over it or not by chance). The run starts from what a
  # kill after `finished`'s step-4 checkpoint leaves (a copy without the step-8 checkpoint
  # and the final metrics; resuming drops the events after step 4).
  _copy(finished, tmp_path)
  shutil.rmtree(tmp_path / 'checkpoints' / '8')
  (tmp_path / 'final_metrics.json').unlink()
  assert workdir_lib.newest_meta(tmp_path / 'checkpoints')['step'] == 4
  kept = {p: p.read_bytes() for p in (tmp_path / 'checkpoints' / '4').rglob('*') if p.is_file()}
  tiny = ['--config.num_members=4', '--config.model.widths=(16,)', '--config.train.steps=8',
          '--config.train.log_every=4', '--config.train.eval_every=0',
          '--config.checkpoint.every=4', '--config.data.batch_size=32',
          '--config.eval.joint_tau=0']
  proc = subprocess.run(
      [sys.executable, '-c', _CLI_WITH_SMALL_FILES, '--config=configs/default.py',
       f'--workdir={tmp_path}', *tiny], cwd=ROOT, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONDONTWRITEBYTECODE='1',
               XLA_FLAGS=support.xla_flags(8)))
  assert proc.returncode == 1 and 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  # Said once, by dist_ens: not also by orbax's error lines before it.
  assert not [line for line in proc.stderr.splitlines() if line.startswith('error:')], (
      proc.stderr[-3000:])
  assert proc.stderr.splitlines()[-1] == (
      f'dist-ens: error: writing into {tmp_path} failed: File too large (the disk, a quota or '
      'a file-size limit is full); the checkpoint at step 4 is intact: free some space and '
      'run the same command again to resume.')
  assert kept == {p: p.read_bytes() for p in kept}
  assert dist_ens.train(_config(), str(tmp_path))['step'] == 8  # resumes
  assert _events(tmp_path) == SCHEDULED  # (4, 'test'): `finished`'s evaluation at step 4.


def test_python_stays_within_one_call_of_the_device(tmp_path):
  # A stop request is read between calls; Python left to queue calls up to the next
  # log step (the only read of a result) made Ctrl-C wait for all of them: 8.5 s from
  # step 260 to 500. The steps are made slow next to their dispatch, and each call's
  # metrics are checked for readiness when Python gets control.
  queued, unfinished = [], []

  def count_unfinished(call):
    queued.append(jax.tree.leaves(call.metrics)[0])
    unfinished.append(sum(not m.is_ready() for m in queued[-100:]))

  # 6 slow steps (the action every step makes each a call of its own), one log step at
  # the end: the loop would queue all of them unwatched, up to 6 unfinished (with the
  # loop's wait removed it saw 5, at load 12 on 2 cores: checked by hand).
  config = _config(model__widths=(512, 512), data__batch_size=256, train__steps=6,
                   train__log_every=6, checkpoint__every=6)
  dist_ens.train(config, str(tmp_path), actions=[dist_ens.every(1, count_unfinished)])
  # At most the call just queued and the one before it, which the loop waits for next.
  assert max(unfinished) <= 2, unfinished


@pytest.mark.parametrize('damage', [b'\xff\xfe{"step": 8}', b'[8]'])
def test_a_checkpoint_with_damaged_metadata_is_skipped(tmp_path, finished, damage):
  # Non-UTF-8 bytes (a torn write) crashed the rerun with a UnicodeDecodeError traceback.
  _copy(finished, tmp_path)
  (tmp_path / 'checkpoints' / '8' / 'meta' / 'metadata').write_bytes(damage)
  (tmp_path / 'final_metrics.json').unlink()
  assert workdir_lib.newest_meta(tmp_path / 'checkpoints')['step'] == 4
  assert dist_ens.train(_config(checkpoint__keep=3), str(tmp_path))['step'] == 8
