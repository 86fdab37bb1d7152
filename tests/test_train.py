"""train.run end to end: topology invariance, member independence, bad input, defaults."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import runs
import support

import dist_ens
from dist_ens.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _config(**overrides):
  """support.config's tiny run (4 members of a (16,) MLP, batch 32) for the refusals: 20
  steps logged every 10, for steps_per_call to divide or not (the refusals below name
  them); saved at the end only."""
  return support.config({'train.steps': 20, 'train.log_every': 10, 'checkpoint.every': 20},
                        **overrides)


def _run(tmp_path, name, devices=None, **overrides):
  """The session's shared run (tests/runs.py: support.config's run for 8 steps, logged,
  evaluated and saved at 4 and 8) with `overrides`, trained into tmp_path / name: what
  these tests compare (meshes, M, seeds, resume) does not depend on the sizes, and where
  they change none of those its programs are the shared run's."""
  return dist_ens.train(runs.tiny_config(**overrides), str(tmp_path / name), devices=devices)


# A run compared by its final results only: evaluated and saved at its end, not at step 4
# too (an evaluation program and a save fewer), 2 steps a call (as the shared run).
AT_THE_END = {'train__eval_every': 0, 'checkpoint__every': 8, 'train__steps_per_call': 2}


@pytest.fixture
def reference(tiny_run):
  """The results the runs here are compared with: the session's shared run (4 members on
  support.config's mesh, member=-1 fitted to 4 x 1: one member on each of 4 devices), not
  a run of this file's own (a training and its programs fewer)."""
  return tiny_run[1]


def _assert_results_as_the_references(result, reference, member, data):
  # Splitting members is (near) bit-exact; splitting the batch reorders the gradient
  # sum, a rounding difference (measured: 2.4e-7 in NLL on 2 x 4 after the 8 steps, as
  # after 20).
  tol = 1e-6 if data == 1 else 2e-6
  for metric in ('nll', 'accuracy', 'brier'):
    np.testing.assert_allclose(result['members'][metric], reference['members'][metric],
                               atol=tol, err_msg=f'{metric} on mesh {member}x{data}')
  assert abs(result['ensemble']['nll'] - reference['ensemble']['nll']) < tol
  assert result['train_step_traces'] == 1


# Against the reference's 4 x 1 (one member a device): 1 x 1 (all 4 members on one device),
# 2 x 4 and 1 x 8 (an explicit mesh uses all of the devices it is given). All three are in
# the slow tier ([1-8] by tests/conftest.py, the others here); the fast cover of [2-4] is
# test_steps_per_call_and_resume_across_it_keep_results, the same checks on the same 2 x 4
# mesh against the same reference, of a run resumed across steps_per_call, whose 2 x 4 mesh
# also holds two members on each device, as [1-1] holds four. Each run is compared by its
# final results only, so it evaluates and saves at its end only (AT_THE_END: 24 -> 21
# programs for the three).
@pytest.mark.parametrize('member,data', [pytest.param(1, 1, marks=pytest.mark.slow),
                                         pytest.param(2, 4, marks=pytest.mark.slow),
                                         (1, 8)])
def test_topology_does_not_change_results(tmp_path, reference, member, data):
  result = _run(tmp_path, 'w', devices=jax.devices()[:member * data], mesh__member=member,
                mesh__data=data, **AT_THE_END)
  _assert_results_as_the_references(result, reference, member, data)


@pytest.fixture(scope='module')
def three(tmp_path_factory):
  """3 members on one device: the reference's first three (seed 0) in a smaller ensemble
  laid out otherwise (one device holds them all; the reference has one member a device,
  as the slow [1-1] topology case compares). A run on one device costs about half the CPU
  of one on the shared run's four (measured here, a seed run from cached programs: 0.75
  against 1.47 CPU s)."""
  return _run(tmp_path_factory.mktemp('three'), 'w', devices=jax.devices()[:1],
              num_members=3, **AT_THE_END)


def test_member_does_not_depend_on_ensemble_size(three, reference):
  for metric in ('nll', 'accuracy', 'ece'):
    np.testing.assert_allclose(three['members'][metric], reference['members'][metric][:3],
                               atol=1e-6)


def test_seed_changes_members(tmp_path, three):
  other = _run(tmp_path, 'seed', devices=jax.devices()[:1], num_members=3, seed=1,
               **AT_THE_END)  # `three`'s programs.
  assert not np.allclose(other['members']['nll'], three['members']['nll'])


def test_steps_per_call_and_resume_across_it_keep_results(tmp_path, reference):
  """4 steps per call on a 2x4 mesh: the first 4 steps, then resumed with 2 per call; the
  results are the reference's as test_topology_does_not_change_results checks them (this
  is the fast tier's 2 x 4 topology check)."""
  first = _run(tmp_path, 'w', mesh__member=2, mesh__data=4, train__steps=4,
               train__steps_per_call=4)
  assert first['step'] == 4 and first['train_step_traces'] == 1
  result = _run(tmp_path, 'w', mesh__member=2, mesh__data=4, train__steps_per_call=2)
  _assert_results_as_the_references(result, reference, 2, 4)
  events = [json.loads(line) for line in (tmp_path / 'w' / 'metrics.jsonl').read_text().splitlines()]
  assert [e['step'] for e in events if e['split'] == 'train'] == [4, 8]
  # A checkpoint at step 8 cannot be resumed with calls of 3 steps (which divide every
  # cadence of the config): the error says so.
  with pytest.raises(ConfigError, match='steps_per_call=3 does not divide'):
    _run(tmp_path, 'w', train__steps=12, train__log_every=12, train__eval_every=12,
         checkpoint__every=12, train__steps_per_call=3)


def test_workdir_files(tiny_run):
  """A finished run's workdir: its config, final metrics as returned, and the train and
  test events of each log and evaluation step. Read from the session's shared run
  (tests/runs.py: support.config's run for 8 steps, logged and evaluated at 4 and 8)."""
  workdir, result = tiny_run
  assert json.loads((workdir / 'config.json').read_text())['num_members'] == 4
  assert json.loads((workdir / 'final_metrics.json').read_text()) == json.loads(json.dumps(result))
  events = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  train_events = [e for e in events if e['split'] == 'train']
  test_events = [e for e in events if e['split'] == 'test']
  assert [e['step'] for e in train_events] == [4, 8]
  assert [e['step'] for e in test_events] == [4, 8]
  assert len(train_events[0]['members']['loss']) == 4
  assert set(test_events[-1]['ensemble']) >= {'accuracy', 'nll', 'brier', 'ece', 'disagreement'}
  assert set(result['members']) >= {'accuracy', 'nll'}
  assert result['frozen_members'] == []


@pytest.mark.parametrize('overrides,message', [
    (dict(num_members=6, mesh__member=4, mesh__data=2), 'config.num_members=6'),
    (dict(mesh__member=4, mesh__data=2, data__batch_size=63), 'config.data.batch_size=63'),
    (dict(mesh__member=3, mesh__data=2), 'config.mesh.member x config.mesh.data'),
    (dict(model__name='resnet9000'), 'config.model.name'),
    (dict(data__name='imagenet'), 'config.data.name'),
    (dict(optim__name='lion'), 'config.optim.name'),
    (dict(optim__learning_rate=-1.0), 'config.optim.learning_rate'),
    (dict(train__steps=0), 'config.train.steps'),
    (dict(num_members=0), 'config.num_members'),
    (dict(data__batch_size=10**6), 'config.data.batch_size'),
    (dict(ensemble__member_parallelism='pmap'), 'config.ensemble.member_parallelism'),
    (dict(ensemble__map_batch_size=-1), 'config.ensemble.map_batch_size'),
    (dict(train__steps_per_call=-1), 'config.train.steps_per_call'),
    (dict(train__steps_per_call=3), 'config.train.(steps=20|log_every=10)'),
    (dict(train__steps_per_call=4), 'config.train.log_every=10'),
])
def test_bad_config_fails_before_touching_workdir(tmp_path, overrides, message):
  workdir = tmp_path / 'w'
  with pytest.raises(ConfigError, match=message.replace('.', r'\.')):
    dist_ens.train(_config(**overrides), str(workdir))
  assert not workdir.exists()


def test_workdir_of_another_run_is_refused_and_kept(tmp_path, tiny_run):
  """Another config's run in a finished run's workdir (a copy of the session's shared run,
  tests/runs.py) is refused, naming the field that may not differ, and leaves every file."""
  workdir = runs.copy(tiny_run, tmp_path / 'w')
  files = lambda: {p: p.read_bytes() for p in workdir.rglob('*') if p.is_file()}
  before = files()
  with pytest.raises(ConfigError, match=r'differing fields: num_members\)'):
    dist_ens.train(runs.tiny_config(num_members=8, optim__learning_rate=0.1), str(workdir))
  assert files() == before


def _cli(*args, timeout=600, llvm_o0=True):
  flags = support.xla_flags(8)
  if not llvm_o0:  # LLVM at XLA's default level, as a user's run compiles.
    flags = ' '.join(f for f in flags.split() if f != support.LLVM_O0)
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, '-m', 'dist_ens.main', *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_cli_bad_config_exits_nonzero_with_field_and_keeps_workdir(tmp_path):
  workdir = tmp_path / 'w'
  workdir.mkdir()
  (workdir / 'keep.txt').write_text('precious')
  # An explicit mesh is kept as given (a -1 axis would be fitted to M instead).
  proc = _cli('--config=configs/default.py', f'--workdir={workdir}', '--config.num_members=6',
              '--config.mesh.member=8', timeout=120)
  assert proc.returncode != 0
  assert 'config.num_members=6 is not divisible by mesh.member=8' in proc.stderr
  assert [p.name for p in workdir.iterdir()] == ['keep.txt']


@pytest.mark.parametrize('steps', [100, pytest.param(2000, marks=pytest.mark.slow)])
def test_default_config_end_to_end(tmp_path, steps):
  """The README's main command, as a user runs it: the ensemble beats its members. The
  fast tier stops it at step 100 (an evaluation and checkpoint at its end; the same
  programs as 500 or 2,000 steps: train.steps_per_call's automatic choice is 50 for each),
  where the ensemble already beats its members' mean in both (measured: NLL 1.46 against
  1.52, accuracy 0.442 against 0.408; at step 500, 1.01 against 1.11 and 0.612 against
  0.577) for 40% less of the command's CPU time than 500 steps (6.6 s against 11.0 s);
  the slow tier runs all 2,000 steps (47 s of the fast tier's time before). Compiled at
  XLA's default level, not the tests' -O0: a user's run does, and its programs are its own
  (no other test's); at 500 steps -O0's slower code cost more than it saved (the command
  alone, cold cache: 7.5-7.9 CPU s against 10.5-10.7 at -O0), at 100 about the same (6.6
  against 6.3 user CPU s)."""
  extra = () if steps == 2000 else (f'--config.train.steps={steps}',)
  proc = _cli('--config=configs/default.py', f'--workdir={tmp_path}', *extra, llvm_o0=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  final = json.loads((tmp_path / 'final_metrics.json').read_text())
  members, ens = final['members'], final['ensemble']
  assert final['num_members'] == 8 and final['train_step_traces'] == 1
  assert ens['nll'] < np.mean(members['nll'])
  assert ens['accuracy'] >= np.mean(members['accuracy'])
  assert 'ensemble' in proc.stderr and 'member-examples/s' in proc.stderr
