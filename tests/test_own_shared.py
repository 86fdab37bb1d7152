"""config.ensemble.train_shared, and own='batchensemble'.

train_shared trains every shared leaf as ONE leaf: one SGD step moves it by member 0's
learning rate times the SUM of the members' gradients, each computed here with jax.grad
of the plain model's loss on that member's params, while each member's own leaves move
by its own rate and gradient (own='head', a regex, 'lora'). The shared part and its one
optimizer state are stored and counted by `dist-ens plan` once; 1 device and 8 give the
same run; resume is exact. own='batchensemble' is method='batchensemble', bit for bit,
also from config.model.init_from. Combinations that mean nothing are refused in one line.
(train_shared=False leaving the backbone bit-identical is tests/test_own.py's.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dist_ens
from dist_ens.run import mesh_layout
from dist_ens import data, plan as plan_lib
from dist_ens.run import assemble, initial_state
from dist_ens.config import checks
from dist_ens.errors import ConfigError
from dist_ens.io.pretrained import read_orbax
from dist_ens.parallel import mesh as mesh_lib
from test_methods import _config
from test_own import BATCH, _backbone_file, _own_config, _parts, _steps, straight_and_resumed

RATES = [0.1, 0.2, 0.3, 0.4]  # optim.learning_rate swept over the 4 members


def _is_entry(e):
  return isinstance(e, dict) and ('own' in e or 'shared' in e)


def _sgd(config, rate=RATES):
  config.optim.update(name='sgd', momentum=0.0, weight_decay=0.0, schedule='constant',
                      learning_rate=rate)
  return config


def _formed(params, m):
  """Member m's model params from the train state's entries, written out here."""
  def form(e):
    if 'own' in e:
      return e['own'][m]
    if 'lora_a' in e:
      return e['shared'] + e['lora_scale'] * e['lora_a'][m] @ e['lora_b'][m]
    return e['shared']
  return jax.tree.map(form, params, is_leaf=_is_entry)


def _member_grads(parts, params, x, y):
  """Each member's gradient of its mean cross-entropy w.r.t. its formed params."""
  def loss(p):
    logits, _ = parts.model.apply(p, {}, x, train=True, rng=jax.random.key(0))
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
  grad = jax.jit(jax.grad(loss))  # one compile for the 4 members, not one an operation
  return [jax.tree.map(np.asarray, grad(_formed(params, m))) for m in range(4)]


@pytest.mark.parametrize('own', ['head', r'^1/|^0/b$', 'lora'])
def test_one_step_moves_a_shared_leaf_by_the_sum_of_the_members_gradients(tmp_path, own):
  source, _ = _backbone_file(tmp_path)
  config = _sgd(_own_config(source, own=own, **{'ensemble.train_shared': True,
                                                'ensemble.lora_rank': 2}))
  before, after, _, parts, state = _steps(config, 1)
  x, y = next(data.BatchIterator(data.load_dataset('mnist1d').train, BATCH, seed=0))
  grads = _member_grads(parts, before, x, y)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  entries = lambda tree: jax.tree.leaves(tree, is_leaf=_is_entry)
  shared = 0
  for i, (b, a) in enumerate(zip(entries(before), entries(after))):
    g = [jax.tree.leaves(grads[m])[i] for m in range(4)]
    if 'own' in b:
      for m in range(4):
        close(a['own'][m], b['own'][m] - RATES[m] * g[m])
      continue
    shared += 1
    assert b['shared'].shape == g[0].shape  # Stored once: no member axis.
    # ONE leaf: member 0's rate times the sum of the four members' gradients.
    close(a['shared'], b['shared'] - RATES[0] * np.sum(g, axis=0))
    if 'lora_a' in b:  # The factors by each member's own gradient; the scale is constant.
      np.testing.assert_array_equal(a['lora_scale'], b['lora_scale'])
      for m in range(4):
        s = b['lora_scale']
        close(a['lora_a'][m], b['lora_a'][m] - RATES[m] * s * g[m] @ b['lora_b'][m].T)
        close(a['lora_b'][m], b['lora_b'][m] - RATES[m] * s * b['lora_a'][m].T @ g[m])
  assert shared == (1 if own == r'^1/|^0/b$' else 2)
  assert set(state.opt_state) == {'shared', 'members'}


def _adam_steps(source, mesh, steps=3):
  config = _own_config(source, **{'ensemble.train_shared': True})
  config.mesh.member, config.mesh.data = mesh
  config.optim.weight_decay = 0.01
  _, after, _, _, state = _steps(config, steps)
  return after, jax.tree.map(np.asarray, jax.device_get(state.opt_state))


def test_one_device_and_eight_train_alike(tmp_path):
  """Adam and weight decay on the shared leaves' summed gradient, member 4 x data 2
  against everything on one device."""
  source, body = _backbone_file(tmp_path)
  one, one_opt = _adam_steps(source, (1, 1))
  eight, eight_opt = _adam_steps(source, (4, 2))
  assert not np.allclose(one[0]['w']['shared'], body['0/w'])  # The backbone trained.
  for a, b in zip(jax.tree.leaves((one, one_opt)), jax.tree.leaves((eight, eight_opt))):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def _trace(config, steps=3):
  """Every leaf of the train state after `steps` steps on a 2 x 2 mesh."""
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:4]), (40, 1),
                               10)
  step = assemble.build_step(parts, per_member_batches=False, form=('vmap', None))
  state = initial_state.init_sharded(parts)
  sharding = mesh_lib.batch_sharding(parts.mesh)
  batches = data.BatchIterator(data.load_dataset('mnist1d').train, BATCH, seed=0)
  for _ in range(steps):
    x, y = next(batches)
    state, _ = step(state, parts.device_hparams(), data.to_global(x, sharding),
                    data.to_global(y, sharding))
  return parts, jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]


def test_own_batchensemble_is_method_batchensemble_bit_for_bit():
  method_parts, by_method = _trace(_config('batchensemble', member=2, data_axis=2))
  own_parts, by_own = _trace(_config('deep', member=2, data_axis=2,
                                     **{'ensemble.own': 'batchensemble'}))
  assert own_parts.method.name == 'batchensemble' and own_parts.method.shares
  assert [p for p, _ in by_own] == [p for p, _ in by_method]
  for (path, a), (_, b) in zip(by_method, by_own):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize('fields', [{'ensemble.method': 'batchensemble'},
                                    {'ensemble.own': 'batchensemble'}])
def test_batchensemble_starts_w_from_the_file_and_factors_per_member(tmp_path, fields):
  source, body = _backbone_file(tmp_path)  # The MLP's first layer; its head is fresh.
  config = _config('deep', member=2, data_axis=2, **{'model.init_from': source, **fields})
  parts = _parts(config)
  params = jax.device_get(initial_state.init_sharded(parts)).params
  layer0, head = params
  np.testing.assert_array_equal(layer0['w']['shared'], body['0/w'])  # W once, the file's.
  for m in range(4):  # Biases are each member's own: the file's in every member.
    np.testing.assert_array_equal(layer0['b']['own'][m], body['0/b'])
  for e in (layer0['w'], head['w']):
    for factor in (e['r'], e['s']):  # Random signs, drawn per member.
      assert set(np.unique(factor)) == {-1.0, 1.0}
      assert not np.array_equal(factor[0], factor[1])
  assert head['w']['shared'].shape == (16, 10)
  assert not np.allclose(head['w']['shared'][:, :2], body['0/w'][:16, :2])


def test_resume_is_exact_and_the_checkpoint_holds_the_shared_part_once(tmp_path):
  source, body = _backbone_file(tmp_path)
  straight, resumed = straight_and_resumed(
      tmp_path, lambda: _own_config(source, members=4, **{'ensemble.train_shared': True}))
  assert resumed['members'] == straight['members']
  assert resumed['ensemble'] == straight['ensemble']
  saved = {(d, item): read_orbax(tmp_path / d / 'checkpoints' / '24' / item)
           for d in 'ab' for item in ('model', 'optimizer')}
  for item in ('model', 'optimizer'):
    for a, b in zip(jax.tree.leaves(saved['a', item]), jax.tree.leaves(saved['b', item])):
      np.testing.assert_array_equal(a, b)
  w = saved['a', 'model']['params'][0]['w']['shared']
  assert w.shape == body['0/w'].shape and not np.allclose(w, body['0/w'])  # Once, trained.
  # One Adam state of the backbone (no member axis), each member's of its head.
  opt = saved['a', 'optimizer']
  shared_mu = opt['shared'][0][0]['mu'][0]['w']['shared']
  assert shared_mu.shape == (40, 16) and np.any(shared_mu != 0)
  assert opt['members'][0][0]['mu'][1]['w']['own'].shape == (4, 16, 10)
  ens = dist_ens.Ensemble.load(tmp_path / 'a', devices=jax.devices()[:1])
  for m in range(4):  # Every member reads the one trained backbone.
    np.testing.assert_array_equal(ens.member(m)[0]['w'], w)


def _state_bytes_per_device(config, devices):
  """What make_plan reports as state_bytes_per_device (plan.sizes.placement_of of the
  run's parts), without compiling the step at M and 2M as make_plan does."""
  shapes = plan_lib.planner.data_shape(config)
  run = assemble.build_run(config, devices=devices, shapes=shapes)
  return plan_lib.sizes.placement_of(run.parts)['state_bytes_per_device']


def test_plan_counts_the_shared_part_and_its_optimizer_state_once(tmp_path):
  source, body = _backbone_file(tmp_path)
  backbone = sum(v.nbytes for v in body.values())
  state, devices = {}, jax.devices()[:2]
  for members in (2, 4):
    for train_shared in (False, True):
      config = _own_config(source, members=members,
                           **{'ensemble.train_shared': train_shared})
      config.mesh.data = 1
      state[members, train_shared] = _state_bytes_per_device(config, devices)
  # `dist-ens plan` itself (its step compiled at M and 2M) on one of the four: the same
  # count. The other three need only the count, not three more pairs of compiles.
  config = _own_config(source, members=4, **{'ensemble.train_shared': True})
  config.mesh.data = 1
  assert plan_lib.make_plan(config, devices, measure_programs=False).state_bytes_per_device == (
      state[4, True])
  for members in (2, 4):
    # Adam's two moments of the backbone, its count and the schedule's (int32), once.
    assert state[members, True] - state[members, False] == 2 * backbone + 2 * 4
  # One more member per device adds its head's params and moments, counts and flag.
  head = (16 * 10 + 10) * 4
  assert state[4, True] - state[2, True] == 3 * head + 4 + 4 + 1


def test_a_swept_learning_rate_is_said_to_reach_the_owned_leaves_only(caplog):
  config = _sgd(_own_config('', **{'ensemble.train_shared': True}))
  checks.validate(config)
  assert "member 0's optim.learning_rate" in caplog.text


@pytest.mark.parametrize('fields,match', [
    ({'own': 'all'}, "train_shared=True with ensemble.own='all': every leaf"),
    ({'own': 'batchensemble'}, "BatchEnsemble's shared W always trains"),
    ({'train_shared': None}, 'train_shared=None must be True or False'),
    ({'reproducible': True, 'micro_batches': 2},
     'train_shared=True with config.reproducible=True'),
    ({'train_shared': False, 'own': 'batchensemble', 'method': 'mimo'},
     "own='batchensemble' is method='batchensemble'; it works with ensemble.method='deep'"),
])
def test_combinations_that_mean_nothing_give_one_line_naming_the_field(fields, match):
  config = _own_config('')
  config.ensemble.train_shared = True
  for field, value in fields.items():
    group = {'reproducible': config, 'micro_batches': config.train}.get(field, config.ensemble)
    group[field] = value
  with pytest.raises(ConfigError, match=match) as e:
    _parts(config)
  field = 'own' if 'method' in fields else 'train_shared'
  assert f'config.ensemble.{field}' in str(e.value) and '\n' not in str(e.value)
