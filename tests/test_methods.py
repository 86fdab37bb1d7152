"""Ensemble methods (config.ensemble.method): snapshot ensembles and MultiSWAG.

Each method's defining property against a direct computation over the iterates it
saw, on a member x data mesh; exact resume; Ensemble.load predicting with the
method's members; the config errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support

import dist_ens
from dist_ens.config import specs
from dist_ens.run import mesh_layout
from dist_ens import Ensemble, data
from dist_ens.run import assemble, initial_state
from dist_ens.core import optim
from dist_ens.ensembles import methods, swag
from dist_ens.errors import ConfigError
from dist_ens.parallel import mesh as mesh_lib

STEPS, BATCH = 24, 32


def _config(method, member=1, data_axis=1, **fields):
  """support.config's tiny run (4 members of a (16,) MLP, batch 32) with `method` on a
  member x data mesh. 24 steps of a cosine schedule at 1e-2: 3 snapshot cycles of 8 steps
  whose rate restarts, and SWAG collecting every 3 steps from step 12 (5 iterates, 3
  deviations kept); `fields` are dotted overrides ({'ensemble.snapshot.start': 0.5})."""
  config = support.config({
      'train.steps': STEPS, 'data.batch_size': BATCH, 'mesh.member': member,
      'mesh.data': data_axis, 'optim.learning_rate': 1e-2, 'optim.schedule': 'cosine',
      'ensemble.method': method, 'ensemble.snapshot.cycles': 3})
  config.ensemble.swag.update(start=0.5, every=3, rank=3, samples=5)
  return support.override(config, fields)


def _iterates(config):
  """(final state, every member's params after each step [STEPS+1 entries], parts)."""
  devices = jax.devices()[:config.mesh.member * config.mesh.data]
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config, devices), (40, 1), 10)
  step = assemble.build_step(parts, per_member_batches=False, form=('vmap', None))
  state, sharding = initial_state.init_sharded(parts), mesh_lib.batch_sharding(parts.mesh)
  batches = data.BatchIterator(data.load_dataset('mnist1d').train, BATCH, seed=0)
  fetch = lambda tree: jax.tree.map(np.asarray, jax.jit(
      lambda t: t, out_shardings=mesh_lib.replicated(parts.mesh))(tree))
  seen = [fetch((state.params, state.model_state))]
  for _ in range(STEPS):
    x, y = next(batches)
    state, _ = step(state, parts.device_hparams(), data.to_global(x, sharding),
                    data.to_global(y, sharding))
    seen.append(fetch((state.params, state.model_state)))
  return state, seen, parts, fetch


def test_swag_moments_equal_a_direct_computation_over_the_iterates():
  config = _config('multiswag', member=2, data_axis=2)
  state, seen, _, fetch = _iterates(config)
  collected = fetch(state.method_state)
  steps = swag.swag_steps(round(0.5 * STEPS), 3, STEPS)
  assert steps == [12, 15, 18, 21, 24]
  params = [seen[s][0] for s in steps]
  mean = jax.tree.map(lambda *p: np.mean(np.stack(p), 0), *params)
  sq_mean = jax.tree.map(lambda *p: np.mean(np.stack(p) ** 2, 0), *params)
  np.testing.assert_array_equal(collected['n'], [len(steps)] * 4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               collected['mean'], mean)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               collected['sq_mean'], sq_mean)
  # The last `rank` deviations from the running mean, in a ring: collection i in slot i % 3.
  for i in range(len(steps) - 3, len(steps)):
    running = jax.tree.map(lambda *p: np.mean(np.stack(p), 0), *params[:i + 1])
    expected = jax.tree.map(lambda p, m: p - m, params[i], running)
    jax.tree.map(lambda d, e: np.testing.assert_allclose(d[:, i % 3], e, rtol=1e-4, atol=1e-6),
                 collected['deviations'], expected)


def test_snapshots_are_the_iterates_at_the_ends_of_the_cycles_and_the_rate_restarts():
  config = _config('snapshot', member=4, data_axis=2)
  state, seen, parts, fetch = _iterates(config)
  snap_params, _ = fetch(state.method_state)
  for c, step in enumerate((8, 16, 24)):
    jax.tree.map(lambda s, p: np.testing.assert_array_equal(s[:, c], p), snap_params,
                 seen[step][0])
  # The 4 x 3 predicting members: member m's snapshot c is row 3m + c.
  members = fetch(methods.predictive_members(parts.method, state, 0, parts.mesh))
  jax.tree.map(lambda rows, s: np.testing.assert_array_equal(rows, s.reshape(rows.shape)),
               members.params, snap_params)
  assert not members.frozen.any() and members.frozen.shape == (12,)
  # The rate restarts: plain SGD with a unit gradient moves by the rate multiplier.
  sgd = specs.optim_spec(config)._replace(
      name='sgd', learning_rate=1.0, weight_decay=0.0, momentum=0.0, nesterov=False,
      grad_clip_norm=0.0, schedule='cosine', warmup_steps=0)
  tx = optim.make_optimizer(sgd, STEPS, cycles=3)()
  opt_state, moves = tx.init(jnp.zeros(())), []
  for _ in range(17):
    update, opt_state = tx.update(jnp.ones(()), opt_state, jnp.zeros(()))
    moves.append(-float(update))
  assert moves[0] == moves[8] == moves[16] == 1.0  # the first update of every cycle
  assert moves[7] == moves[15] < 0.05 and moves[3] == moves[11]


def test_fast_geometric_cycles_begin_at_snapshot_start_at_the_cycle_rate():
  config = _config('snapshot', **{'ensemble.snapshot.start': 0.5,
                                  'ensemble.snapshot.cycle_rate': 0.05})
  # 24 steps: 12 of the schedule, then 3 cycles of 4.
  method = methods.from_spec(specs.method_spec(config))
  collected = method.hooks.init_collected({'w': jnp.zeros(())}, {})
  for step in range(1, STEPS + 1):  # The "weights" after each step are the step's number.
    collected = method.hooks.collect(collected, {'w': jnp.float32(step)}, {}, jnp.int32(step))
  np.testing.assert_array_equal(collected[0]['w'], [16, 20, 24])
  _, _, filled = method.members(collected, None, None, jnp.int32(20), None)
  np.testing.assert_array_equal(filled, [True, True, False])
  sgd = specs.optim_spec(config)._replace(
      name='sgd', learning_rate=1.0, weight_decay=0.0, momentum=0.0, nesterov=False,
      grad_clip_norm=0.0, schedule='cosine', warmup_steps=0)
  tx = optim.make_optimizer(sgd, STEPS, cycles=3, cycles_from=12, cycle_rate=0.05)()
  opt_state, moves = tx.init(jnp.zeros(())), []
  for _ in range(STEPS):
    update, opt_state = tx.update(jnp.ones(()), opt_state, jnp.zeros(()))
    moves.append(-float(update))
  assert moves[0] == 1.0 and moves[11] < 0.02  # One cosine decay over the first half,
  assert moves[12] == moves[16] == moves[20] == pytest.approx(0.05)  # then restarts at 0.05,
  assert moves[15] == moves[19] == moves[23] < 0.05 * 0.2  # each annealed to near zero.


def _run(config, workdir, actions=()):
  config.train.log_every, config.train.eval_every, config.checkpoint.every = 8, 0, 8
  return dist_ens.train(config, str(workdir), devices=jax.devices()[:2], actions=actions)


def test_resume_is_exact_and_ensemble_load_predicts_with_the_methods_members(tmp_path):
  method = 'multiswag'
  straight = _run(_config(method, member=2, data_axis=1), tmp_path / 'a')
  short = _config(method, member=2, data_axis=1)
  with pytest.raises(RuntimeError, match='injected fault'):  # After step 16's checkpoint.
    _run(short, tmp_path / 'b', actions=[_Stop(16)])
  assert sorted(int(p.name) for p in (tmp_path / 'b' / 'checkpoints').iterdir()
                if p.name.isdigit()) == [8, 16]
  resumed = _run(_config(method, member=2, data_axis=1), tmp_path / 'b')
  assert resumed[method] == straight[method]
  ens = Ensemble.load(tmp_path / 'a', devices=jax.devices()[:1])
  assert ens.num_members == 4 * 5
  test = data.load_dataset('mnist1d').test
  probs = ens.predict(test.x, preprocessed=True).probs
  accuracy = float(np.mean(probs.argmax(-1) == test.y))
  assert accuracy == pytest.approx(straight[method]['ensemble']['accuracy'], abs=2e-3)
  assert accuracy > 0.15  # Ten balanced classes: it learned in 24 steps.


class _Stop:
  """An action that fails once the run passes `step` (after its checkpoint)."""

  def __init__(self, step):
    self.step = step

  def on_step(self, call):
    if call.step > self.step:
      raise RuntimeError('injected fault')

  def on_end(self, call):
    pass

  def close(self):
    pass


def test_swag_samples_have_the_swag_mean_and_covariance():
  mean = {'w': jnp.array([1.0, -2.0])}
  collected = {'n': jnp.array(4), 'mean': mean, 'sq_mean': {'w': jnp.array([1.0 + 0.5, 4.0 + 2.0])},
               'deviations': {'w': jnp.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 3.0]])},
               'state_mean': {}}
  keys = jax.random.split(jax.random.key(0), 20_000)
  samples = jax.vmap(lambda k: swag.swag_sample(collected, 3, k))(keys)['w']
  # Var = diag / 2 + D D^T / (2 (R - 1)), R = 3 deviations kept.
  d = np.asarray(collected['deviations']['w'])
  expected = np.diag([0.5, 2.0]) / 2 + d.T @ d / 4
  np.testing.assert_allclose(samples.mean(0), mean['w'], atol=0.03)
  np.testing.assert_allclose(np.cov(np.asarray(samples).T), expected, atol=0.05)


@pytest.mark.parametrize('fields, match', [
    (dict(method='bagging'), "ensemble.method='bagging'"),
    (dict(method='snapshot', **{'snapshot.cycles': 5}), 'snapshot.cycles=5 must divide'),
    (dict(method='snapshot', **{'snapshot.start': 0.6}), r'must divide the 10 steps from'),
    (dict(method='snapshot', **{'snapshot.cycle_rate': 0}), r'snapshot.cycle_rate=0.0 must be a number > 0'),
    (dict(method='swag_like', ), 'use one of'),
    (dict(method='multiswag', **{'swag.every': 20}), 'fewer than 2 weight iterates'),
    (dict(method='multiswag', **{'swag.start': 1.0}), r'swag.start=1.0 must be a fraction'),
    (dict(method='multiswag', **{'swag.samples': 0}), r'swag.samples=0 must be an int >= 1'),
])
def test_bad_method_fields_are_refused_naming_the_field(fields, match):
  config = support.override(_config('deep'), {f'ensemble.{k}': v for k, v in fields.items()})
  with pytest.raises(ConfigError, match=match):
    methods.from_spec(specs.method_spec(config))


def test_snapshot_refuses_a_constant_schedule():
  config = _config('snapshot')
  config.optim.schedule = 'constant'
  with pytest.raises(ConfigError, match="'constant' has nothing to restart"):
    methods.from_spec(specs.method_spec(config))
