"""BatchEnsemble (config.ensemble.method='batchensemble').

Its defining property: one shared weight per layer (one array, replicated over the
mesh), each member's kernel W * outer(r_m, s_m); one step moves W by the mean of the
members' gradients and each member's factors by its own, checked against gradients
computed here from the model alone, on a 2 x 2 mesh. Then: it learns, resumes
exactly, and Ensemble.load predicts with its members; bad configs are refused. What every
method's run keeps, one trace, predict as reported, the same on one device and export
per member, is the combination matrix's (tests/test_combinations.py, its batchensemble
case, a regression run).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dist_ens.run import mesh_layout
from dist_ens import Ensemble, data
from dist_ens.run import assemble, initial_state
from dist_ens.ensembles import batchensemble
from dist_ens.errors import ConfigError
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.parallel.layout import Layout
from runs import killed_after
from test_methods import _config, _run

LR = 0.1


def _sgd_config(**fields):
  config = _config('batchensemble', member=2, data_axis=2, **fields)
  config.optim.update(name='sgd', momentum=0.0, weight_decay=0.0, schedule='constant',
                      learning_rate=LR)
  return config


def _one_step(config):
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:4]), (40, 1),
                               10)
  step = assemble.build_step(parts, per_member_batches=False, form=('vmap', None))
  state = initial_state.init_sharded(parts)
  x, y = next(data.BatchIterator(data.load_dataset('mnist1d').train, 32, seed=0))
  fetch = lambda tree: jax.tree.map(np.asarray, tree)
  before = fetch(state.params)
  shardings = jax.tree.map(lambda a: a.sharding.spec, state.params)
  sharding = mesh_lib.batch_sharding(parts.mesh)
  state, _ = step(state, parts.device_hparams(), data.to_global(x, sharding),
                  data.to_global(y, sharding))
  return parts, before, fetch(state.params), shardings, (x, y)


def _is_entry(e):
  return isinstance(e, dict) and ('own' in e or 'shared' in e)


def test_one_shared_weight_steps_by_the_members_mean_gradient():
  parts, before, after, specs, (x, y) = _one_step(_sgd_config())
  kernels = [e for e in jax.tree.leaves(before, is_leaf=_is_entry) if 'shared' in e]
  assert len(kernels) == 2  # The MLP's two weight matrices (40 -> 16 -> 10).
  for e in kernels:
    assert e['shared'].shape == (e['r'].shape[1], e['s'].shape[1])  # One W, not M.
    assert e['r'].shape[0] == e['s'].shape[0] == 4
    assert set(np.unique(e['r'])) <= {-1.0, 1.0}  # Random-sign factors.
  assert all(e['shared'] == P() and e['r'] == P('member')
             for e in jax.tree.leaves(specs, is_leaf=_is_entry) if 'shared' in e)

  def loss(params):
    logits, _ = parts.model.apply(params, {}, x, train=True, rng=jax.random.key(0))
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

  # Each member's gradient with respect to its own formed kernels K_m = W * r_m s_m^T.
  def formed(m):
    return jax.tree.map(lambda e: e['own'][m] if 'own' in e else
                        e['shared'] * np.outer(e['r'][m], e['s'][m]), before, is_leaf=_is_entry)

  grad = jax.jit(jax.grad(loss))  # one compile for the 4 members, not one an operation
  grads = [jax.tree.leaves(grad(formed(m))) for m in range(4)]
  for i, (b, a) in enumerate(zip(jax.tree.leaves(before, is_leaf=_is_entry),
                                 jax.tree.leaves(after, is_leaf=_is_entry))):
    g = [np.asarray(grads[m][i]) for m in range(4)]
    close = lambda actual, expected: np.testing.assert_allclose(actual, expected, rtol=1e-4,
                                                                atol=1e-6)
    if 'own' in b:
      for m in range(4):
        close(a['own'][m], b['own'][m] - LR * g[m])
      continue
    close(a['shared'], b['shared'] - LR * np.mean(
        [g[m] * np.outer(b['r'][m], b['s'][m]) for m in range(4)], axis=0))
    for m in range(4):
      close(a['r'][m], b['r'][m] - LR * (g[m] * b['shared']) @ b['s'][m])
      close(a['s'][m], b['s'][m] - LR * b['r'][m] @ (g[m] * b['shared']))


def test_it_learns_resumes_exactly_and_ensemble_load_predicts(tmp_path):
  """Resumed from what a kill after step 16's checkpoint leaves (the matrix's
  batchensemble case preempts a run and resumes it), the run ends as the straight one;
  loaded, its 4 members predict the reported accuracy (the matrix's batchensemble case
  is a regression run), and they learned."""
  config = lambda: _config('batchensemble', member=2, data_axis=1)
  straight = _run(config(), tmp_path / 'a')
  resumed = _run(config(), killed_after(tmp_path / 'a', 16, tmp_path / 'b'))
  assert resumed['ensemble'] == straight['ensemble']
  assert resumed['members'] == straight['members']
  ens = Ensemble.load(tmp_path / 'a', devices=jax.devices()[:1])
  assert ens.num_members == 4
  test = data.load_dataset('mnist1d').test
  probs = ens.predict(test.x, preprocessed=True).probs
  accuracy = float(np.mean(probs.argmax(-1) == test.y))
  assert accuracy == pytest.approx(straight['ensemble']['accuracy'], abs=2e-3)
  assert accuracy > 0.15  # Ten balanced classes: it learned in 24 steps.


def test_refused_with_reproducible_mode_or_a_swept_optimizer():
  config = _config('batchensemble')
  config.reproducible = True
  with pytest.raises(ConfigError, match="reproducible=True with config.ensemble.method="):
    assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:1]), (40, 1), 10)
  config = _config('batchensemble')
  config.optim.learning_rate = [1e-3, 2e-3, 3e-3, 4e-3]
  with pytest.raises(ConfigError, match=r"varies \['optim.learning_rate'\]"):
    assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:1]), (40, 1), 10)


def test_member_params_form_w_times_the_outer_product():
  w = jnp.arange(6.0).reshape(2, 3)
  params = {'k': {'shared': w, 'r': jnp.array([1.0, -1.0]), 's': jnp.array([2.0, 1.0, -1.0])},
            'b': {'own': jnp.ones(3)}}
  formed = batchensemble.member_params(params)
  np.testing.assert_array_equal(formed['k'], [[0.0, 1.0, -2.0], [-6.0, -4.0, 5.0]])
  np.testing.assert_array_equal(formed['b'], np.ones(3))
  shared, own = batchensemble.split(params)
  assert jax.tree.leaves(shared) == [w]
  assert batchensemble.merge(shared, own).keys() == params.keys()


def test_a_model_with_layers_named_shared_or_own_is_wrapped_correctly():
  entry = {'shared': jnp.ones((2, 3)), 'r': jnp.array([1.0, -1.0]), 's': jnp.ones(3)}
  params = {'shared': {'kernel': entry}, 'own': {'bias': {'own': jnp.zeros(3)}}}
  shared, own = batchensemble.split(params)
  assert len(jax.tree.leaves(shared)) == 1 and len(jax.tree.leaves(own)) == 3
  assert jax.tree.structure(batchensemble.merge(shared, own)) == jax.tree.structure(params)
  formed = batchensemble.member_params(params)
  np.testing.assert_array_equal(formed['shared']['kernel'], [[1.0] * 3, [-1.0] * 3])
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  layout = Layout(shared=batchensemble.is_shared)
  specs = [layout.leaf_spec(p, jax.ShapeDtypeStruct((1,), jnp.float32)) for p in paths]
  assert specs.count(P()) == 1  # Only the kernel's W is replicated.
