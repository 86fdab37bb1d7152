"""The sharded, vmapped train step against the seed article's Python loop over members."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

import dist_ens
from dist_ens import data, models
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.core import optim
from dist_ens.training import step as step_lib

NUM_MEMBERS, STEPS, BATCH = 8, 20, 32


def _setup(member, data_axis, optimizer='adam'):
  model = models.get_model(ml_collections.ConfigDict(
      dict(name='mlp', widths=(64, 64), init_scale=1.0)), num_classes=10)
  tx = optim.make_optimizer(ml_collections.ConfigDict(dict(
      name=optimizer, learning_rate=3e-3 if optimizer == 'adam' else 0.1, weight_decay=1e-4,
      b1=0.9, b2=0.999, eps=1e-8, momentum=0.9, nesterov=False, grad_clip_norm=0.0,
      schedule='cosine', warmup_steps=5)), STEPS)
  mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(
      dict(member=member, data=data_axis, hosts_along='member')))
  return model, tx, mesh


def _batches(dataset, n=STEPS):
  it = data.BatchIterator(dataset.train, BATCH, seed=0)
  return [next(it) for _ in range(n)]


@pytest.fixture(scope='module')
def mnist1d():
  return data.load_dataset('mnist1d')


def _train_sharded(model, tx, mesh, dataset, batches, state=None):
  state = state or jax.jit(
      lambda: step_lib.init_state(model, tx, 0, NUM_MEMBERS, dataset.input_shape),
      out_shardings=mesh_lib.member_sharding(mesh))()
  train_step = step_lib.make_train_step(model, tx, mesh)
  sharding = mesh_lib.batch_sharding(mesh)
  losses = []
  for x, y in batches:
    state, m = train_step(state, data.to_global(x, sharding), data.to_global(y, sharding))
    losses.append(np.asarray(m.loss))
    jax.block_until_ready(m)  # CPU collectives must not queue up (see train.py).
  return state, np.stack(losses), train_step


@pytest.mark.parametrize('member,data_axis,optimizer', [
    (4, 2, 'adam'), (2, 4, 'sgd'), (1, 8, 'adam')])
def test_matches_python_loop_over_members(mnist1d, member, data_axis, optimizer):
  model, tx, mesh = _setup(member, data_axis, optimizer)
  batches = _batches(mnist1d)
  state, losses, _ = _train_sharded(model, tx, mesh, mnist1d, batches)

  # The seed article's baseline: each member alone, its own jitted step, one device.
  init = step_lib.init_state(model, tx, 0, NUM_MEMBERS, mnist1d.input_shape)

  @jax.jit
  def single_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(
        lambda p: step_lib.cross_entropy(model.apply(p, x), y, 0.0))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  for i, params in enumerate(dist_ens.unstack(init.params)):
    opt_state = tx.init(params)
    member_losses = []
    for x, y in batches:
      params, opt_state, loss = single_step(params, opt_state, x, y)
      member_losses.append(float(loss))
    np.testing.assert_allclose(losses[:, i], member_losses, atol=1e-5, rtol=1e-5)
    # The whole state, optimizer moments included: a gradient scaled by the number of
    # data shards would leave Adam's parameters almost unchanged but not its moments.
    # Adam divides by sqrt(v): where a gradient is ~0, summation-order rounding can
    # move single weights by up to ~1e-4 over 20 steps.
    expected = (params, opt_state)
    got = jax.tree.map(lambda leaf: np.asarray(leaf)[i], (state.params, state.opt_state))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-3),
                 got, expected)


def test_members_keep_their_own_optimizer_state(mnist1d):
  model, tx, mesh = _setup(4, 2)
  state, _, _ = _train_sharded(model, tx, mesh, mnist1d, _batches(mnist1d, 3))
  mus = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
         if 'mu' in jax.tree_util.keystr(path)]  # Adam's first moments.
  assert mus
  first = np.asarray(mus[0])
  assert first.shape[0] == NUM_MEMBERS
  assert not np.allclose(first[0], first[1])  # Different members, different moments.


def test_step_traces_once_and_state_stays_sharded(mnist1d):
  model, tx, mesh = _setup(2, 4)
  state, _, train_step = _train_sharded(model, tx, mesh, mnist1d, _batches(mnist1d, 12))
  assert train_step.traces == 1
  for leaf in jax.tree.leaves(state):
    assert leaf.sharding.spec[0] == 'member'


def test_nonfinite_member_is_frozen_and_others_unaffected(mnist1d):
  model, tx, mesh = _setup(4, 2)
  batches = _batches(mnist1d, 6)
  init = jax.jit(lambda: step_lib.init_state(model, tx, 0, NUM_MEMBERS, mnist1d.input_shape),
                 out_shardings=mesh_lib.member_sharding(mesh))
  clean, _, _ = _train_sharded(model, tx, mesh, mnist1d, batches, state=init())
  poisoned = init()
  # Member 3's weights become NaN: its loss and gradients are non-finite from step 1.
  bad_params = jax.tree.map(lambda p: p.at[3].set(jnp.nan), poisoned.params)
  poisoned = jax.device_put(poisoned._replace(params=bad_params), mesh_lib.member_sharding(mesh))
  before = jax.tree.map(np.asarray, poisoned)
  state, losses, _ = _train_sharded(model, tx, mesh, mnist1d, batches, state=poisoned)
  assert np.asarray(state.frozen).tolist() == [i == 3 for i in range(NUM_MEMBERS)]
  assert not np.isfinite(losses[:, 3]).any()
  # The frozen member's parameters did not move; its optimizer saw only zero
  # gradients, so its state stayed finite.
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a)[3], b[3]),
               state.params, before.params)
  for leaf in jax.tree.leaves(state.opt_state):
    assert np.isfinite(np.asarray(leaf)[3]).all()
  for i in (0, 1, 2, 4, 5, 6, 7):  # Everyone else: bit for bit the clean run.
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a)[i], np.asarray(b)[i]),
                 state.params, clean.params)


@pytest.mark.parametrize('parallelism,chunk', [('map', None), ('map', 4)])
def test_lax_map_over_members_matches_vmap(mnist1d, parallelism, chunk):
  model, tx, mesh = _setup(2, 4)
  batches = _batches(mnist1d, 5)
  init = jax.jit(lambda: step_lib.init_state(model, tx, 0, NUM_MEMBERS, mnist1d.input_shape),
                 out_shardings=mesh_lib.member_sharding(mesh))
  sharding = mesh_lib.batch_sharding(mesh)
  results = []
  for how, size in (('vmap', None), (parallelism, chunk)):
    state = init()
    step = step_lib.make_train_step(model, tx, mesh, member_parallelism=how, map_batch_size=size)
    for x, y in batches:
      state, m = step(state, data.to_global(x, sharding), data.to_global(y, sharding))
      jax.block_until_ready(m)
    assert step.traces == 1
    results.append(jax.tree.map(np.asarray, state.params))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), *results)


@pytest.mark.parametrize('per_member', [False, True])
def test_steps_per_call_equals_that_many_calls(mnist1d, per_member):
  """One call of K scanned steps == K calls of the one-step function, on a 4x2 mesh."""
  model, tx, mesh = _setup(4, 2)
  k, calls = 3, 2
  rng = np.random.default_rng(0)
  lead = (k * calls, NUM_MEMBERS, BATCH) if per_member else (k * calls, BATCH)
  xs = mnist1d.train.x[rng.integers(0, 1000, lead)]
  ys = mnist1d.train.y[rng.integers(0, 1000, lead)]
  init = jax.jit(lambda: step_lib.init_state(model, tx, 0, NUM_MEMBERS, mnist1d.input_shape),
                 out_shardings=mesh_lib.member_sharding(mesh))
  spec = ('member', 'data') if per_member else ('data',)
  one_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  many_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, *spec))

  single = step_lib.make_train_step(model, tx, mesh, per_member_batches=per_member)
  state, losses = init(), []
  for x, y in zip(xs, ys):
    state, m = single(state, jax.device_put(x, one_sharding), jax.device_put(y, one_sharding))
    losses.append(np.asarray(m.loss))
  scanned = step_lib.make_train_step(model, tx, mesh, per_member_batches=per_member,
                                     steps_per_call=k)
  state_k, losses_k = init(), []
  for c in range(calls):
    block = slice(c * k, (c + 1) * k)
    state_k, m = scanned(state_k, jax.device_put(xs[block], many_sharding),
                         jax.device_put(ys[block], many_sharding))
    assert m.loss.shape == (k, NUM_MEMBERS)
    losses_k.append(np.asarray(m.loss))
  assert scanned.traces == 1
  np.testing.assert_allclose(np.concatenate(losses_k), np.stack(losses), rtol=1e-6, atol=1e-7)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                                                       atol=1e-7), state_k, state)
  assert jax.tree.leaves(state_k.params)[0].sharding.spec[0] == 'member'


def test_steps_per_call_must_be_positive(mnist1d):
  model, tx, mesh = _setup(8, 1)
  with pytest.raises(ValueError, match='steps_per_call=0'):
    step_lib.make_train_step(model, tx, mesh, steps_per_call=0)
