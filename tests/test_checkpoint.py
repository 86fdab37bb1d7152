"""Checkpoints: exact resume after kill -9 and SIGTERM, corrupt checkpoints, config changes."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import support

from dist_ens.run import mesh_layout
from dist_ens.io import checkpoint
import dist_ens
from dist_ens.config.loading import load_config
from dist_ens.errors import ConfigError, TrainingError

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40


def _config(**overrides):
  """support.config's tiny run (4 members of a (16,) MLP, batch 32), saved every 5 of 40
  steps and logged every step, so the kill and SIGTERM tests can stop it between saves;
  on a 4 x 2 mesh so resume is checked with each member's batch split over 'data'. No
  joint evaluation: a program no test here reads."""
  return support.config({'train.steps': STEPS, 'train.log_every': 1, 'checkpoint.every': 5,
                         'mesh.member': 4, 'mesh.data': 2, 'eval.joint_tau': 0}, **overrides)


def _leaves(tree, prefix=''):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _leaves(value, f'{prefix}{key}.')
    else:
      yield prefix + key, value


def _flags(config):
  """`config` as the command line's overrides of configs/default.py: the fields it sets."""
  default = dict(_leaves(load_config(ROOT / 'configs' / 'default.py').to_dict()))
  return [f'--config.{k}={v if isinstance(v, str) else repr(v)}'
          for k, v in _leaves(config.to_dict()) if default[k] != v]


def _final_state(workdir, step=None):
  """(step, the model's and optimizer's arrays) of the workdir's checkpoint at `step`
  (default: its latest)."""
  step_dir = (Path(workdir) / 'checkpoints' / str(step) if step is not None else
              max((Path(workdir) / 'checkpoints').iterdir(), key=lambda p: int(p.name)))
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    state = {item: ocp.PyTreeCheckpointer().restore(str(step_dir / item))
             for item in ('model', 'optimizer') if (step_dir / item).exists()}
    return int(step_dir.name), jax.tree.map(np.asarray, {**state.pop('model'), **state})


def _assert_same_state(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  """All 40 steps without a stop: what the kill -9 test (the slow tier) resumes to."""
  workdir = tmp_path_factory.mktemp('uninterrupted')
  final = dist_ens.train(_config(), str(workdir))
  return final, _final_state(workdir)[1]


# The first 20 steps, keeping 3 checkpoints (10, 15, 20): the finished run that the tests
# which resume, refuse, corrupt or restore a workdir start from (each on its own copy), and
# the uninterrupted run the fast tier's resumes end where (a resume may lower train.steps:
# the constant schedule and the data order do not depend on it), instead of a 40-step run
# of its own (~2x this one's time, built only for them).
TWENTY = {'train__steps': 20, 'checkpoint__keep': 3}


@pytest.fixture(scope='module')
def twenty(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('twenty')
  return workdir, dist_ens.train(_config(**TWENTY), str(workdir))


def _copy(run, to):
  """`to` holding a copy of the fixture `run`'s workdir; returns that run's final dict."""
  shutil.copytree(run[0], to, dirs_exist_ok=True)
  return run[1]


def _killed_after_15(run, to):
  """`to` holding what a kill right after `twenty`'s step-15 checkpoint leaves: its copy
  without checkpoint 20 and the final metrics (tests/runs.py killed_after's cut); a
  resume from it trains steps 16-20 again. Returns the final dict of `run`."""
  final = _copy(run, to)
  shutil.rmtree(Path(to) / 'checkpoints' / '20')
  (Path(to) / 'final_metrics.json').unlink()
  return final


def _start(workdir):
  env = dict(os.environ, XLA_FLAGS=support.xla_flags(8),
             JAX_PLATFORMS='cpu')
  return subprocess.Popen(
      [sys.executable, '-m', 'dist_ens.main', '--config=configs/default.py',
       f'--workdir={workdir}', *_flags(_config())], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)


def _wait_for_step(workdir, step, proc, timeout=120):
  """Waits until metrics.jsonl reports `step`; returns False if the run ended first."""
  deadline = time.monotonic() + timeout
  path = Path(workdir) / 'metrics.jsonl'
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      return False
    if path.exists():
      lines = [l for l in path.read_text().splitlines() if l.strip()]
      if lines and json.loads(lines[-1])['step'] >= step:
        return True
    time.sleep(0.05)
  proc.kill()
  raise TimeoutError(f'run did not reach step {step} in {timeout}s')


def _finish(workdir):
  proc = _start(workdir)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  return out


def test_kill9_at_random_steps_then_resume_is_bit_exact(tmp_path, uninterrupted):
  final, state = uninterrupted
  rng = np.random.default_rng(int(time.time()))
  kill_steps = sorted(rng.choice(np.arange(3, STEPS - 3), size=2, replace=False).tolist())
  for kill_step in kill_steps:
    proc = _start(tmp_path)
    reached = _wait_for_step(tmp_path, kill_step, proc)
    proc.kill()  # SIGKILL: no chance to save anything.
    proc.communicate(timeout=60)
    assert reached, f'the run ended before step {kill_step}'
  _finish(tmp_path)
  resumed = json.loads((tmp_path / 'final_metrics.json').read_text())
  for key in ('members', 'ensemble'):
    assert resumed[key] == final[key], f'killed at {kill_steps}'
  _assert_same_state(_final_state(tmp_path)[1], state)
  events = [json.loads(l) for l in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  train_steps = [e['step'] for e in events if e['split'] == 'train']
  assert train_steps == list(range(1, STEPS + 1))  # No duplicated or torn lines.


def test_sigterm_saves_at_next_step_and_exits_143(tmp_path, twenty, caplog):
  caplog.set_level(logging.INFO, logger='absl')
  # The child runs the 40-step config and is stopped after step 8 (past the checkpoint at
  # 5, 12 steps before 20: a signal handled late still saves below 20); its programs are
  # in the compilation cache `twenty` filled.
  proc = _start(tmp_path)
  assert _wait_for_step(tmp_path, 8, proc)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 143, out[-3000:]  # 128 + SIGTERM: a stopped run is not a success
  assert 'preempted (SIGTERM): saved the checkpoint at step' in out
  saved_step = _final_state(tmp_path)[0]
  assert 8 <= saved_step < 20
  assert not (tmp_path / 'final_metrics.json').exists()
  # The rerun in this process, one process start and jax import fewer (the command line
  # resumes in test_reliability's full-disk test and the kill -9 test), to step 20: it
  # ends where the uninterrupted 20-step run `twenty` ended, bit for bit.
  final = dist_ens.train(_config(**TWENTY), str(tmp_path))
  assert f'resuming from the checkpoint at step {saved_step}' in caplog.text
  assert final['step'] == 20 and final['members'] == twenty[1]['members']
  _assert_same_state(_final_state(tmp_path)[1], _final_state(twenty[0])[1])


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path, twenty, caplog):
  caplog.set_level(logging.INFO, logger='absl')
  _copy(twenty, tmp_path)
  clean = _final_state(tmp_path)
  clean_data = _restore(tmp_path, 4, 2).data_state  # Where the clean run's data stopped.
  latest = tmp_path / 'checkpoints' / '20' / 'model'
  for f in latest.rglob('*'):
    if f.is_file() and f.stat().st_size > 0:
      f.write_bytes(b'\0' * 7)  # Garbage of the wrong size.
  # The same finished run again: it falls back to 15, redoes 16-20 and replaces 20.
  dist_ens.train(_config(**TWENTY), str(tmp_path))
  assert 'checkpoint at step 20 cannot be restored' in caplog.text
  assert 'resuming from the checkpoint at step 15' in caplog.text
  assert _final_state(tmp_path)[0] == 20
  _assert_same_state(_final_state(tmp_path)[1], clean[1])
  # The rewritten checkpoint 20 is the clean one: arrays (above) and the data position, so
  # a run trained on from it is the uninterrupted run; the redone run's results are the
  # clean run's.
  assert _restore(tmp_path, 4, 2).data_state == clean_data
  final = json.loads((tmp_path / 'final_metrics.json').read_text())
  assert final['members'] == twenty[1]['members']


def test_a_finished_run_with_one_checkpoint_too_many_is_pruned_to_keep(tmp_path, twenty):
  # A run killed after its last save but before orbax pruned leaves keep + 1 checkpoints
  # (the fault campaign's case); here: 3 left by keep=3, then the finished run with keep=2.
  first = _copy(twenty, tmp_path)
  saved = lambda: sorted(int(p.name) for p in (tmp_path / 'checkpoints').iterdir()
                         if p.name.isdigit())
  assert saved() == [10, 15, 20]
  again = dist_ens.train(_config(train__steps=20, checkpoint__keep=2), str(tmp_path))
  assert saved() == [15, 20]
  assert again['members'] == first['members']


def test_incompatible_config_is_refused_and_nothing_overwritten(tmp_path, twenty):
  _copy(twenty, tmp_path)
  before = {p: p.read_bytes() for p in tmp_path.rglob('*') if p.is_file()}
  with pytest.raises(ConfigError, match=r'differs in optim.learning_rate.*restore_incompatible='
                                        r'optim.learning_rate'):
    dist_ens.train(_config(**TWENTY, optim__learning_rate=0.1), str(tmp_path))
  with pytest.raises(ConfigError, match=r'different ensemble \(differing fields: num_members'):
    dist_ens.train(_config(**TWENTY, num_members=8,
                           checkpoint__restore_incompatible='num_members'), str(tmp_path))
  assert {p: p.read_bytes() for p in tmp_path.rglob('*') if p.is_file()} == before


def test_allowed_changes_resume(tmp_path, twenty):
  # Resumed after step 15 with a new learning rate and train.steps.
  _killed_after_15(twenty, tmp_path)
  final = dist_ens.train(_config(train__steps=25, checkpoint__keep=3, optim__learning_rate=0.1,
                                 checkpoint__restore_incompatible='optim.learning_rate'),
                         str(tmp_path))
  assert final['step'] == 25
  saved = json.loads((tmp_path / 'config.json').read_text())
  assert saved['optim']['learning_rate'] == 0.1
  # The new value is what the members train with after the resume, not the saved one:
  # at step 20 they are elsewhere than `twenty`'s, which trained steps 16-20 with the old
  # value (one resume, not a second one with the old value to compare with).
  changed, same = _final_state(tmp_path, 20)[1], _final_state(twenty[0], 20)[1]
  assert not np.allclose(jax.tree.leaves(changed['params'])[0], jax.tree.leaves(same['params'])[0])


def _restore(workdir, member, data_axis):
  from dist_ens.run import assemble  # pylint: disable=g-import-not-at-top
  from dist_ens.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  config = _config(mesh__member=member, mesh__data=data_axis)
  mesh = mesh_layout.build_mesh(config)
  abstract = assemble.build_parts(config, mesh, (40, 1), 10).abstract_state
  restored = checkpoint.Checkpointer(Path(workdir) / 'checkpoints', 5, 2).restore(abstract)
  assert jax.tree.leaves(restored.state.params)[0].sharding == mesh_lib.member_sharding(mesh)
  return restored


def test_restore_onto_another_mesh_gives_the_same_values(tmp_path, twenty):
  from dist_ens import data  # pylint: disable=g-import-not-at-top
  clean = _killed_after_15(twenty, tmp_path)
  written = _restore(tmp_path, 4, 2)  # The mesh that wrote it.
  assert written.step == 15 and written.data_state == data.IteratorState(epoch=0, index=15)
  # support.config's own mesh (-1 fits 4 x 1: the batch whole), and all members on one device.
  for member, data_axis in ((-1, 1), (1, 8)):
    restored = _restore(tmp_path, member, data_axis)
    assert restored.step == 15 and restored.data_state == written.data_state
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 restored.state, written.state)
  # Training on from there on a new mesh (steps 16-20): the same run to float tolerance.
  final = dist_ens.train(_config(**TWENTY, mesh__member=-1, mesh__data=1), str(tmp_path))
  assert final['step'] == 20
  np.testing.assert_allclose(final['members']['nll'], clean['members']['nll'], atol=1e-4)


def _poison_member(monkeypatch, member):
  from dist_ens.run import assemble  # pylint: disable=g-import-not-at-top
  original = assemble.init_state

  def poisoned(*args, **kwargs):
    state = original(*args, **kwargs)
    return state._replace(params=jax.tree.map(lambda p: p.at[member].set(np.nan), state.params))

  monkeypatch.setattr(assemble, 'init_state', poisoned)


def test_nonfinite_member_is_frozen_reported_and_excluded(tmp_path, monkeypatch, twenty):
  # 20 steps against the clean `twenty`: half the steps of `uninterrupted`, the same programs.
  _poison_member(monkeypatch, 3)
  final = dist_ens.train(_config(**TWENTY), str(tmp_path))
  assert final['frozen_members'] == [3]
  others = [i for i in range(4) if i != 3]
  for metric in ('accuracy', 'nll'):
    got, clean = np.array(final['members'][metric]), np.array(twenty[1]['members'][metric])
    np.testing.assert_array_equal(got[others], clean[others])
  assert np.isfinite(final['ensemble']['nll'])  # Member 3's NaNs are left out.
  saved = json.loads((tmp_path / 'final_metrics.json').read_text())
  assert saved['frozen_members'] == [3]


def test_on_nonfinite_stop_saves_and_raises(tmp_path, monkeypatch):
  _poison_member(monkeypatch, 2)
  with pytest.raises(TrainingError, match=r"members \[2\] went non-finite by step 1 .*'stop'"):
    dist_ens.train(_config(train__on_nonfinite='stop'), str(tmp_path))
  assert _final_state(tmp_path)[0] == 1
  with pytest.raises(ConfigError, match='on_nonfinite'):
    dist_ens.train(_config(train__on_nonfinite='ignore'), str(tmp_path / 'other'))


def _small_state(value):
  """A 4-member TrainState of jax arrays whose values depend on `value`: computed in numpy
  and put on the device (eager jax ops would compile a program each)."""
  from dist_ens.core.state import TrainState  # pylint: disable=import-outside-toplevel
  w = np.arange(4096, dtype=np.float32).reshape(4, 1024) * np.float32(value)
  return jax.device_put(TrainState(params={'w': w}, model_state={}, opt_state={'mu': w + 1},
                                   frozen=np.zeros(4, bool), step=np.int32(value)))


@pytest.mark.parametrize('offset', [0.25, 0.5, 0.75])
def test_corrupt_bytes_that_read_back_as_values_are_caught(tmp_path, offset):
  # Garbage inside an array's data reads back without an error (orbax's files carry no
  # checksum): the values saved with the checkpoint catch it, and the one before is used.
  saver = checkpoint.Checkpointer(tmp_path, every=1, keep=5)
  for step in (1, 2):
    saver.save(step, _small_state(step), dist_ens.data.IteratorState())
  saver.close()
  data = max((tmp_path / '2' / 'model').rglob('d/*'), key=lambda p: p.stat().st_size)
  raw = bytearray(data.read_bytes())
  at = int(len(raw) * offset)
  raw[at:at + 16] = bytes(b ^ 0x55 for b in raw[at:at + 16])
  data.write_bytes(bytes(raw))
  loader = checkpoint.Checkpointer(tmp_path, every=1, keep=5)
  restored = loader.restore(_small_state(0))
  loader.close()
  assert restored.step == 1
  np.testing.assert_array_equal(restored.state.params['w'], _small_state(1).params['w'])


def test_the_meta_is_saved_as_it_was_at_its_step(tmp_path, monkeypatch):
  """save() hands orbax its meta to write in the background (a commit thread awaiting
  the directory): a caller's list that grows after the call (PBT's rounds) must be
  written as it was at the step, not as it is when the thread gets to it (a checkpoint
  at step 2 was seen holding step 4's round)."""
  handed = []
  rounds = [{'step': 1, 'sources': [0, 1]}]
  saver = checkpoint.Checkpointer(tmp_path, every=1, keep=5)
  json_save = checkpoint.ocp.args.JsonSave  # Wrapped once the manager has its handlers.
  monkeypatch.setattr(checkpoint.ocp.args, 'JsonSave',
                      lambda item: handed.append(item) or json_save(item))
  saver.save(1, _small_state(1), dist_ens.data.IteratorState(), meta={'pbt': {'rounds': rounds}})
  rounds.append({'step': 2, 'sources': [1, 1]})
  rounds[0]['sources'][0] = 7
  saver.close()
  monkeypatch.undo()
  assert handed[0]['pbt']['rounds'] == [{'step': 1, 'sources': [0, 1]}]
  loader = checkpoint.Checkpointer(tmp_path, every=1, keep=5)
  restored = loader.restore(_small_state(0))
  loader.close()
  assert restored.meta['pbt']['rounds'] == [{'step': 1, 'sources': [0, 1]}]


def test_saving_small_replicated_arrays_builds_no_program(tmp_path):
  """A state replicated over 'data' (the members over 'member') is saved without a
  program: orbax would slice each replicated array among its replicas on the device,
  one compiled slice per leaf shape (48 of the 56 programs of a tiny 8-member run
  trained and resumed on member=2 x data=4), to write a few kilobytes each in parallel.
  Arrays under MIN_SLICE_BYTES are written by one replica."""
  from dist_ens.core.state import TrainState  # pylint: disable=import-outside-toplevel
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ('member', 'data'))
  members = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('member'))
  shapes = [(2, 44, 3), (2, 4, 7), (2, 13, 12)]  # New shapes, each with an axis
  # the 4 replicas divide (the one orbax would slice).
  leaves = [jax.device_put(np.arange(np.prod(s), dtype=np.float32).reshape(s), members)
            for s in shapes]
  state = TrainState(params={'a': leaves[0], 'b': leaves[1]}, model_state={},
                     opt_state={'c': leaves[2]}, frozen=jax.device_put(np.zeros(2, bool), members),
                     step=jax.device_put(np.int32(3), jax.sharding.NamedSharding(
                         mesh, jax.sharding.PartitionSpec())))
  programs = []

  def listen(event, *args, **kwargs):
    del args, kwargs
    if event in ('/jax/core/compile/backend_compile_duration', '/jax/compilation_cache/cache_hits'):
      programs.append(event)

  saver = checkpoint.Checkpointer(tmp_path, every=1, keep=1)
  jax.monitoring.register_event_listener(listen)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    saver.save(3, state, dist_ens.data.IteratorState())
    saver.wait()
  finally:
    jax.monitoring.unregister_event_listener(listen)
    jax.monitoring.unregister_event_duration_listener(listen)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  restored = saver.restore(abstract)
  saver.close()
  assert not programs, programs
  for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(got, want)
    assert got.sharding == want.sharding
