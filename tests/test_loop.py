"""The loop and its actions: user actions, the per-leaf sharding rule, resume bookkeeping."""

import dataclasses
import json
import os
import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import runs
import support

import dist_ens
from dist_ens.run import mesh_layout
from dist_ens.run import assemble
from dist_ens.parallel.layout import Layout
from dist_ens.errors import ConfigError
from dist_ens.training import loop

ROOT = Path(__file__).resolve().parents[1]


def _config(**overrides):
  return support.config({'train.steps': 12, 'train.log_every': 4}, **overrides)


def _events(workdir):
  return [json.loads(line) for line in (Path(workdir) / 'metrics.jsonl').read_text().splitlines()]


def _norms(params):
  """Each member's parameter norm, in numpy (the leaves' leading axis is the member)."""
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
  return np.sqrt(sum(np.sum(x.reshape(len(x), -1) ** 2, axis=1) for x in leaves))


def test_user_actions_run_when_due_add_results_and_events_and_may_replace_the_state(tmp_path):
  """One run for every kind of user action: a function every 6 steps that adds a result and
  an event; a PeriodicAction counting the calls; one that returns a new state (zeroed
  parameters, as population-based training replaces the state), which the actions after
  it and the loop go on with; and a function of the 0.x Context (still read, warned)."""
  seen, norms_at = {}, {}

  def norm(call):
    params = call.session.fetch(call.state.params)  # numpy, read from the devices
    norms_at[call.step] = _norms(params)
    call.session.write({'step': call.step, 'split': 'train',
                        'members': {'param_norm': norms_at[call.step].tolist()}})
    call.session.results['param_norm'] = norms_at[call.step].tolist()

  class CountSteps(dist_ens.PeriodicAction):
    calls, steps_per_call = 0, None

    def on_step(self, call):
      CountSteps.calls += 1
      CountSteps.steps_per_call = call.session.steps_per_call

  class Zero(dist_ens.PeriodicAction):

    def run(self, call):
      seen['before'] = float(np.sum(_norms(call.state.params) ** 2))
      return dataclasses.replace(call, state=call.state._replace(params=_zeros(
          call.state.params)))

    def on_end(self, call):  # (due at step 12 too)
      pass

  def after(call):
    seen.setdefault('after', float(np.sum(_norms(call.state.params) ** 2)))

  def old_style(ctx):  # The 17-field Context of 0.x: still read, with a warning.
    seen['members'] = ctx.config.num_members

  with pytest.warns(DeprecationWarning, match=r'call\.config is deprecated'):
    final = dist_ens.train(_config(), str(tmp_path), actions=[
        dist_ens.every(6, norm), CountSteps(), Zero(6), dist_ens.every(6, after),
        dist_ens.every(6, old_style, at_end=False)])
  assert sorted(norms_at) == [6, 12]  # Every 6 steps; the last step once (at the end).
  # steps_per_call 'auto' divides the user's period too: gcd(12 steps, log and checkpoint
  # every 4, every(6)) = 2 (without the 6 it would be 4, and step 6 never seen).
  assert CountSteps.steps_per_call == 2
  assert CountSteps.calls == 12 // 2  # on_step once per call
  assert len(final['param_norm']) == 4 and all(n > 0 for n in final['param_norm'])
  saved = json.loads((tmp_path / 'final_metrics.json').read_text())
  assert saved['param_norm'] == final['param_norm'] == norms_at[12].tolist()
  events = [e for e in _events(tmp_path) if 'param_norm' in e.get('members', {})]
  assert [e['step'] for e in events] == [6, 12]
  # Actions run in the order given: the norm at 6 saw the state Zero replaced.
  np.testing.assert_allclose(np.sum(norms_at[6] ** 2), seen['before'], rtol=1e-6)
  assert seen['before'] > 1 and seen['after'] == 0.0 and seen['members'] == 4
  # Steps 7-12 trained from zeros: Adam moved only the last bias, by about lr a step.
  restored = dist_ens.Ensemble.load(tmp_path)
  np.testing.assert_allclose(_norms(restored.params), norms_at[12], rtol=1e-6)
  assert np.sum(norms_at[12] ** 2) < seen['before'] / 100
  with pytest.warns(DeprecationWarning, match='dist_ens.Context is deprecated'):
    assert dist_ens.Context is dist_ens.Call


def _zeros(params):
  """`params` zeroed in one program, each leaf keeping its layout (eager zeros_like
  compiled a program per leaf shape)."""
  return jax.jit(lambda p: jax.tree.map(jax.numpy.zeros_like, p),
                 out_shardings=jax.tree.map(lambda x: x.sharding, params))(params)


def test_every_rejects_a_negative_interval():
  with pytest.raises(ValueError, match='steps=-1'):
    dist_ens.every(-1, lambda call: None)


def test_layout_decides_each_leaf(devices):
  config = _config()
  mesh = mesh_layout.build_mesh(config, devices)
  parts = assemble.build_parts(config, mesh, (40, 1), 10)
  specs = parts.layout.state_specs(parts.abstract_state)
  assert specs.step == P() and specs.frozen == P('member')
  # Sharing the first layer's weight between members: stored once, replicated.
  shared = Layout(shared=lambda path: jax.tree_util.keystr(path).startswith('.params[0]'))
  custom = shared.state_shardings(parts.abstract_state, mesh)
  assert custom.params[0]['w'].spec == P() and custom.params[1]['w'].spec == P('member')
  # A rule sees one member's leaf and the layout prepends the member axis.
  seen = []
  rule = lambda path, leaf: seen.append(leaf.shape) or P(*([None] * leaf.ndim))
  ruled = Layout(rule=rule).state_specs(parts.abstract_state)
  assert ruled.params[1]['w'] == P('member', None, None)
  assert parts.abstract_state.params[1]['w'].shape[1:] in seen


def test_resume_keeps_training_time_and_labels_its_averages(tmp_path, tiny_run):
  # The shared run cut back to its step-4 checkpoint (logged every 4), resumed to 12.
  workdir = runs.killed_after(tiny_run, 4, tmp_path / 'run')
  # The resumed run adds its own time to the saved figure. Comparing wall times of two runs
  # raced on a loaded machine (the first run's final save, on its clock, can outlast the
  # whole resumed run), so the saved figure is made far larger than any run here takes.
  meta_file = workdir / 'checkpoints' / '4' / 'meta' / 'metadata'
  meta = json.loads(meta_file.read_text())
  meta_file.write_text(json.dumps({**meta, 'train_seconds': 10_000.0}))
  final = dist_ens.train(runs.tiny_config(train__steps=12, train__log_every=6), str(workdir))
  assert 10_000.0 < final['train_seconds'] < 20_000.0
  train_events = [e for e in _events(workdir) if e['split'] == 'train']
  # Resumed at 4 with log_every=6: the event at 6 averages steps 5-6 and says so.
  assert [(e['step'], e['steps_averaged']) for e in train_events] == [(4, 4), (6, 2), (12, 6)]


def test_a_stop_between_log_steps_keeps_the_intervals_losses(tmp_path, tiny_run):
  """SIGTERM at step 6 of 8, logging every 4: the checkpoint carries steps 5-6's metrics, so
  the resumed run's record at 8 is the uninterrupted run's (they once never reached
  metrics.jsonl and the record averaged the resumed steps alone). The uninterrupted run is
  the session's shared one: the same config but for the checkpoints' cadence, and the same
  programs (steps_per_call 2: the stop action runs every 2 steps)."""
  config = runs.tiny_config(checkpoint__every=2)

  def sigterm_at_6(call):
    if call.step == 6:
      os.kill(os.getpid(), signal.SIGTERM)

  stopped = dist_ens.train(config, str(tmp_path), actions=[
      dist_ens.every(2, sigterm_at_6, at_end=False)])
  # A single process's handler has run before the loop asks whether to stop after step 6.
  assert stopped['preempted'] and stopped['step'] == 6
  dist_ens.train(config, str(tmp_path))
  whole, resumed = ([e for e in _events(run) if e['split'] == 'train']
                    for run in (tiny_run[0], tmp_path))
  assert [(e['step'], e['steps_averaged']) for e in resumed] == [(4, 4), (8, 4)]
  assert [(e['step'], e['steps_averaged']) for e in whole] == [(4, 4), (8, 4)]
  assert resumed[-1]['members'] == whole[-1]['members']  # bit for bit, on this topology


@pytest.fixture(scope='module')
def finished(tiny_run):
  """A finished run of support.config's model (the session's shared run, tests/runs.py:
  8 steps, checkpoints 4 and 8) that the tests below each damage on their own copy; it
  differs from _config() only in fields a resume may change (steps, eval and checkpoint
  fields)."""
  return tiny_run[0]


def _copy(run, to):
  runs.copy(run, to)


def test_missing_config_json_is_checked_against_the_checkpoint(tmp_path, finished):
  _copy(finished, tmp_path)
  (tmp_path / 'config.json').unlink()
  with pytest.raises(ConfigError, match='differs in optim.learning_rate'):
    dist_ens.train(_config(optim__learning_rate=0.5), str(tmp_path))
  (tmp_path / 'config.json').write_text('{"num_members": 4,')  # Torn file.
  with pytest.raises(ConfigError, match='config.json is not valid JSON'):
    dist_ens.train(_config(), str(tmp_path))


def test_checkpoint_of_another_format_is_refused(tmp_path, finished):
  _copy(finished, tmp_path)
  metas = sorted((tmp_path / 'checkpoints').glob('*/meta/metadata'))
  assert metas
  for meta in metas:  # Every checkpoint, as a run of that format leaves them.
    saved = json.loads(meta.read_text())
    saved['format'] = 1
    meta.write_text(json.dumps(saved))
  with pytest.raises(ConfigError, match='format 1'):
    dist_ens.train(_config(), str(tmp_path))


def test_loading_needs_neither_the_dataset_nor_config_json(tmp_path, monkeypatch, finished):
  _copy(finished, tmp_path)
  (tmp_path / 'config.json').unlink()
  from dist_ens import data  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(data, 'load_dataset', lambda *a, **k: pytest.fail('dataset loaded'))
  ensemble = dist_ens.Ensemble.load(tmp_path)
  out = ensemble.predict(np.zeros((3, 40, 1), np.float32), preprocessed=True)
  assert out.member_probs.shape == (4, 3, 10)


def test_train_from_python_shows_progress_without_absl_settings(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ('import dist_ens\n'
          f"c = dist_ens.load_config({str(ROOT / 'configs' / 'default.py')!r})\n"
          # support.config's model, batch and steps per call (2): the child reads the
          # programs the shared run (compiled by the tests above) from the persistent
          # compilation cache its environment names.
          'c.num_members, c.model.widths, c.data.batch_size = 4, (16,), 32\n'
          'c.train.steps, c.train.log_every, c.train.eval_every = 4, 2, 0\n'
          'c.checkpoint.every = 4\n'
          # No joint evaluation or tensorboardX: what this test reads is the console.
          "c.eval.joint_tau, c.writers = 0, ('jsonl',)\n"
          f'dist_ens.train(c, {str(tmp_path)!r})\n')
  result = subprocess.run(['timeout', '-k', '5', '300', sys.executable, '-c', code],
                          capture_output=True, text=True, timeout=330, cwd=ROOT)
  assert result.returncode == 0, result.stderr
  assert 'step 2/4' in result.stderr and 'step 4/4' in result.stderr
  assert 'final test metrics' in result.stderr


def test_a_log_steps_read_waits_for_its_call_not_for_the_call_queued_after_it():
  """In one process Session.fetch reads the arrays as they are: a program gathering them
  would run after the next call, already queued, and the read would wait for that call
  too, the device idle while the host writes the log step's record
  (benchmarks/metrics_read.py)."""
  call = jax.jit(lambda x: (x @ x) @ x / x.size)
  x = jax.numpy.ones((1200, 1200))
  jax.block_until_ready(call(x))
  state = call(x)
  metrics = {'loss': state[0, :4]}
  queued = call(call(state))  # the next calls, queued behind this one
  fetched = loop.Session.fetch(None, metrics)  # one process: `self` is not read
  assert not queued.is_ready()
  np.testing.assert_array_equal(fetched['loss'], np.asarray(state[0, :4]))
