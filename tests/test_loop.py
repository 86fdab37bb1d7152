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


def test_user_actions_run_when_due_and_add_results_and_events(tmp_path):
  seen = []

  def norm(call):
    seen.append(call.step)
    norms = call.session.fetch(jax.vmap(lambda p: jax.numpy.sqrt(sum(
        jax.numpy.sum(x ** 2) for x in jax.tree.leaves(p))))(call.state.params))
    call.session.write({'step': call.step, 'split': 'train',
                        'members': {'param_norm': norms.tolist()}})
    call.session.results['param_norm'] = norms.tolist()

  class CountSteps(dist_ens.PeriodicAction):
    calls, steps_per_call = 0, None

    def on_step(self, call):
      CountSteps.calls += 1
      CountSteps.steps_per_call = call.session.steps_per_call

  final = dist_ens.train(_config(), str(tmp_path), actions=[dist_ens.every(6, norm),
                                                            CountSteps()])
  assert seen == [6, 12]  # Every 6 steps; the last step once (at the end), not twice.
  # steps_per_call 'auto' divides the user's period too: gcd(12 steps, log and checkpoint
  # every 4, every(6)) = 2 (without the 6 it would be 4, and step 6 never seen).
  assert CountSteps.steps_per_call == 2
  assert CountSteps.calls == 12 // 2  # on_step once per call
  assert len(final['param_norm']) == 4 and all(n > 0 for n in final['param_norm'])
  saved = json.loads((tmp_path / 'final_metrics.json').read_text())
  assert saved['param_norm'] == final['param_norm']
  norms = [e for e in _events(tmp_path) if 'param_norm' in e.get('members', {})]
  assert [e['step'] for e in norms] == [6, 12]


def test_an_action_that_returns_a_new_state_is_what_the_rest_and_the_loop_go_on_with(tmp_path):
  norm = lambda params: float(sum(jax.numpy.sum(x ** 2) for x in jax.tree.leaves(params)))
  seen = {}

  class Zero(dist_ens.PeriodicAction):  # As population-based training replaces the state.

    def run(self, call):
      seen['before'] = norm(call.state.params)
      zeroed = jax.tree.map(jax.numpy.zeros_like, call.state.params)
      return dataclasses.replace(call, state=call.state._replace(params=zeroed))

    def on_end(self, call):  # (due at step 12 too)
      pass

  def after(call):
    seen.setdefault('after', norm(call.state.params))

  def old_style(ctx):  # The 17-field Context of 0.x: still read, with a warning.
    seen['members'] = ctx.config.num_members

  with pytest.warns(DeprecationWarning, match=r'call\.config is deprecated'):
    dist_ens.train(_config(), str(tmp_path), actions=[
        Zero(6), dist_ens.every(6, after), dist_ens.every(6, old_style, at_end=False)])
  restored = dist_ens.Ensemble.load(tmp_path)
  assert seen['before'] > 1 and seen['after'] == 0.0 and seen['members'] == 4
  # Steps 7-12 trained from zeros: Adam moved only the last bias, by about lr a step.
  assert norm(restored.params) < seen['before'] / 100
  with pytest.warns(DeprecationWarning, match='dist_ens.Context is deprecated'):
    assert dist_ens.Context is dist_ens.Call


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


def test_resume_keeps_training_time_and_labels_its_averages(tmp_path):
  dist_ens.train(_config(train__steps=6, train__log_every=6, checkpoint__every=6), str(tmp_path))
  # The resumed run adds its own time to the saved figure. Comparing wall times of two runs
  # raced on a loaded machine (the first run's final save, on its clock, can outlast the
  # whole resumed run), so the saved figure is made far larger than any run here takes.
  meta_file = tmp_path / 'checkpoints' / '6' / 'meta' / 'metadata'
  meta = json.loads(meta_file.read_text())
  meta_file.write_text(json.dumps({**meta, 'train_seconds': 10_000.0}))
  final = dist_ens.train(_config(train__log_every=4), str(tmp_path))
  assert 10_000.0 < final['train_seconds'] < 20_000.0
  train_events = [e for e in _events(tmp_path) if e['split'] == 'train']
  # Resumed at 6 with log_every=4: the event at 8 averages steps 7-8 and says so.
  assert [(e['step'], e['steps_averaged']) for e in train_events] == [(6, 6), (8, 2), (12, 4)]


def test_a_stop_between_log_steps_keeps_the_intervals_losses(tmp_path):
  """SIGTERM at step 6 of 8, logging every 4: the checkpoint carries steps 5-6's metrics, so
  the resumed run's record at 8 is the uninterrupted run's (they once never reached
  metrics.jsonl and the record averaged the resumed steps alone)."""
  config = _config(train__steps=8, checkpoint__every=2, train__steps_per_call=1)
  dist_ens.train(config, str(tmp_path / 'whole'))

  def sigterm_at_6(call):
    if call.step == 6:
      os.kill(os.getpid(), signal.SIGTERM)

  stopped = dist_ens.train(config, str(tmp_path / 'stopped'),
                           actions=[dist_ens.every(1, sigterm_at_6, at_end=False)])
  assert stopped['preempted'] and stopped['step'] in (6, 7)
  dist_ens.train(config, str(tmp_path / 'stopped'))
  whole, resumed = ([e for e in _events(tmp_path / run) if e['split'] == 'train']
                    for run in ('whole', 'stopped'))
  assert [(e['step'], e['steps_averaged']) for e in resumed] == [(4, 4), (8, 4)]
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
          'c.num_members, c.model.widths, c.train.steps = 2, (8,), 20\n'
          'c.train.log_every, c.train.eval_every, c.checkpoint.every = 10, 0, 20\n'
          # No joint evaluation or tensorboardX: what this test reads is the console.
          "c.eval.joint_tau, c.writers = 0, ('jsonl',)\n"
          f'dist_ens.train(c, {str(tmp_path)!r})\n')
  result = subprocess.run(['timeout', '-k', '5', '300', sys.executable, '-c', code],
                          capture_output=True, text=True, timeout=330, cwd=ROOT)
  assert result.returncode == 0, result.stderr
  assert 'step 10/20' in result.stderr and 'step 20/20' in result.stderr
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
