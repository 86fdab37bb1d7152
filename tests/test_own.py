"""config.ensemble.own: members own their heads, every other leaf is one frozen backbone.

The backbone starts from a file (config.model.init_from) and is stored once: bit-identical
after training, no member axis and no optimizer state, its bytes per device the same for
any M; each member's first loss is the model's on the backbone and its own head, computed
here with numpy; resume is exact and Ensemble.load predicts; bad values are refused.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dist_ens
from dist_ens.run import mesh_layout
from dist_ens import Ensemble, data
from dist_ens.run import assemble, initial_state
from dist_ens.config import checks, loading
from dist_ens.errors import ConfigError
from dist_ens.io.pretrained import load_pretrained, read_orbax
from dist_ens.parallel import mesh as mesh_lib, placement, sharding_rules
import runs
from test_methods import _config

BATCH = 32


def _backbone_file(tmp_path):
  """An MLP 40-16-10's body under the model's names (no head: it starts per member)."""
  r = np.random.default_rng(3)
  body = {'0/w': r.normal(size=(40, 16)).astype(np.float32) * 0.2,
          '0/b': r.normal(size=(16,)).astype(np.float32) * 0.1}
  np.savez(tmp_path / 'body.npz', **body)
  return str(tmp_path / 'body.npz'), body


def _own_config(source, own='head', members=4, **fields):
  config = _config('deep', member=2, data_axis=2, **fields)
  config.num_members = members
  config.ensemble.own, config.model.init_from = own, source
  config.optim.learning_rate = 0.05  # Only heads train, on a random backbone: faster.
  return config


def _parts(config):
  devices = jax.devices()[:config.mesh.member * config.mesh.data * config.mesh.model]
  return assemble.build_parts(config, mesh_layout.build_mesh(config, devices), (40, 1), 10)


def _steps(config, steps, form=('vmap', None)):
  """(params before, params after, first step's losses [M], parts, final state)."""
  parts = _parts(config)
  (before, _), after, first_loss, state = _train(parts, steps, form)
  return before, after, first_loss, parts, state


def _train(parts, steps, form=('vmap', None)):
  """((params, model state) before, params after, first step's losses [M], final state)
  of `steps` steps on MNIST-1D's first batches."""
  step = assemble.build_step(parts, per_member_batches=False, form=form)
  state, sharding = initial_state.init_sharded(parts), mesh_lib.batch_sharding(parts.mesh)
  fetch = lambda tree: jax.tree.map(np.asarray, jax.device_get(tree))  # no program
  before, losses = fetch((state.params, state.model_state)), []
  batches = data.BatchIterator(data.load_dataset('mnist1d').train, BATCH, seed=0)
  for _ in range(steps):
    x, y = next(batches)
    state, metrics = step(state, parts.device_hparams(), data.to_global(x, sharding),
                          data.to_global(y, sharding))
    losses.append(np.asarray(metrics.loss))
  return before, fetch(state.params), losses[0], state


def _numpy_loss(w0, b0, w1, b1, x, y):
  """The MLP's mean cross-entropy (relu hidden layer), in float64 numpy."""
  h = np.maximum(x.reshape(len(x), -1) @ w0 + b0, 0)
  logits = h @ w1 + b1
  logits = logits - logits.max(-1, keepdims=True)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return -np.mean(log_probs[np.arange(len(y)), y])


@pytest.fixture(scope='module')
def head_steps(tmp_path_factory):
  """(the backbone file's arrays, _steps of own='head' from it: 3 steps of the vmapped
  step), read by the heads test and the member loop's."""
  source, body = _backbone_file(tmp_path_factory.mktemp('own_head'))
  return body, _steps(_own_config(source), 3)


def test_heads_train_and_the_backbone_is_the_file_bit_for_bit(head_steps):
  body, (before, after, first_loss, _, state) = head_steps
  (layer0, head) = after
  for name in ('w', 'b'):
    assert set(layer0[name]) == {'shared'} and layer0[name]['shared'].shape == body[
        f'0/{name}'].shape  # One array, no member axis.
    np.testing.assert_array_equal(layer0[name]['shared'], body[f'0/{name}'])
    assert head[name]['own'].shape[0] == 4
    assert not np.array_equal(head[name]['own'], before[1][name]['own'])
  # Each member's head its own, fresh from (seed, member).
  assert not np.allclose(before[1]['w']['own'][0], before[1]['w']['own'][1])
  # The optimizer holds moments of the heads only.
  moments = [leaf.shape for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim > 1]
  assert sorted(moments) == [(4, 10), (4, 10), (4, 16, 10), (4, 16, 10)]
  # The first loss is the model's on the file's body and the member's own head.
  x, y = next(data.BatchIterator(data.load_dataset('mnist1d').train, BATCH, seed=0))
  for m in range(4):
    expected = _numpy_loss(body['0/w'], body['0/b'], before[1]['w']['own'][m],
                           before[1]['b']['own'][m], np.asarray(x, np.float64), y)
    np.testing.assert_allclose(first_loss[m], expected, rtol=2e-5)


def test_the_member_loop_steps_as_the_vmap(head_steps):
  _, (_, vmapped, _, parts, _) = head_steps
  _, looped, _, _ = _train(parts, 3, form=('map', None))  # The same parts, looped.
  for a, b in zip(jax.tree.leaves(vmapped), jax.tree.leaves(looped)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _bytes_per_device(parts):
  """The train state's bytes on one device, as `dist-ens plan` counts them (its
  state_bytes_per_device, plan/planner.py _placement)."""
  state = parts.abstract_state
  return placement.state_bytes_per_device(parts.layout.state_specs(state), state,
                                               parts.mesh.shape)


def test_the_backbone_is_stored_once_whatever_m(tmp_path):
  source, body = _backbone_file(tmp_path)
  backbone = sum(v.nbytes for v in body.values())
  sizes = {}
  for m in (2, 4):
    parts = _parts(_own_config(source, members=m))
    leaves = jax.tree_util.tree_flatten_with_path(parts.abstract_state)[0]
    shared = [leaf for path, leaf in leaves if 'shared' in sharding_rules.path_names(path)]
    # Replicated: every device holds the whole backbone, once.
    assert sum(leaf.size * 4 for leaf in shared) == backbone
    assert all(leaf.sharding.shard_shape(leaf.shape) == leaf.shape for leaf in shared)
    sizes[m] = _bytes_per_device(parts)
  # 2 devices on 'member': 1 then 2 members per device. Growing M by one member per
  # device adds that member's head, its Adam moments and counters, not the backbone.
  head = (16 * 10 + 10) * 4
  # params, Adam's mu and nu; Adam's and the schedule's int32 counts; the frozen flag.
  assert sizes[4] - sizes[2] == 3 * head + 4 + 4 + 1
  assert sizes[2] - (sizes[4] - sizes[2]) == backbone + 4  # the backbone and the step


def straight_and_resumed(tmp_path, config):
  """(results of a 24-step run in tmp_path/a, of the same run resumed in tmp_path/b from
  what a kill right after its step-16 checkpoint leaves: runs.killed_after's copy of a,
  one training fewer than killing a second run); `config()` gives a fresh config,
  checkpoints every 8 steps."""
  def run(workdir):
    c = config()
    c.train.log_every, c.train.eval_every, c.checkpoint.every = 8, 0, 8
    c.mesh.data = 1
    return dist_ens.train(c, str(workdir), devices=jax.devices()[:2])

  straight = run(tmp_path / 'a')
  return straight, run(runs.killed_after(tmp_path / 'a', 16, tmp_path / 'b'))


def test_resume_is_exact_and_ensemble_load_predicts(tmp_path):
  source, body = _backbone_file(tmp_path)
  straight, resumed = straight_and_resumed(tmp_path, lambda: _own_config(source, members=4))
  assert resumed['members'] == straight['members']
  assert resumed['ensemble'] == straight['ensemble']
  # The checkpoint holds the backbone once, as the file's values.
  saved = read_orbax(tmp_path / 'a' / 'checkpoints' / '24' / 'model')
  np.testing.assert_array_equal(saved['params'][0]['w']['shared'], body['0/w'])
  assert saved['params'][1]['w']['own'].shape == (4, 16, 10)

  ens = Ensemble.load(tmp_path / 'a', devices=jax.devices()[:1])
  assert ens.num_members == 4
  for m in range(4):  # A member is the backbone and its own head.
    np.testing.assert_array_equal(ens.member(m)[0]['w'], body['0/w'])
  assert not np.allclose(ens.member(0)[1]['w'], ens.member(1)[1]['w'])
  # The workdir's member 1 as config.model.init_from reads it: backbone and its head.
  loaded = load_pretrained(f'{tmp_path / "a"}#1')
  for i in range(2):
    np.testing.assert_array_equal(loaded[f'params/{i}/w'], ens.member(1)[i]['w'])
  test = data.load_dataset('mnist1d').test
  probs = ens.predict(test.x, preprocessed=True).probs
  accuracy = float(np.mean(probs.argmax(-1) == test.y))
  assert accuracy == pytest.approx(straight['ensemble']['accuracy'], abs=2e-3)
  assert accuracy > 0.15  # Ten balanced classes: the heads learned in 24 steps.


def test_a_regex_owns_what_it_matches_and_all_changes_nothing(tmp_path):
  source, _ = _backbone_file(tmp_path)
  by_regex = _parts(_own_config(source, own=r'^1/'))
  by_head = _parts(_own_config(source))
  assert by_regex.method.owned == by_head.method.owned == frozenset({'1/w', '1/b'})
  plain = _parts(_own_config('', own='all'))
  assert plain.method.hooks.members_update is None  # The default step, as before.
  assert all(leaf.shape[0] == 4 for leaf in jax.tree.leaves(plain.abstract_state.params))
  # A config saved before ensemble.own existed reads as 'all'.
  saved = _own_config('', own='all').to_dict()
  del saved['ensemble']['own']
  assert loading.upgrade(saved)['ensemble']['own'] == 'all'


@pytest.mark.parametrize('own,fields,match', [
    ('^nothing$', {}, "own='\\^nothing\\$' matches no leaf"),
    ('.', {}, "matches every leaf \\(that is own='all'\\)"),
    ('(', {}, 'is not a regular expression'),
    ('', {}, "must be 'all', 'head', 'lora' or a regex"),
    ('head', {'ensemble.method': 'batchensemble'}, "works with ensemble.method='deep'"),
])
def test_bad_values_give_one_line_naming_the_field(own, fields, match):
  with pytest.raises(ConfigError, match=match) as e:
    _parts(_own_config('', own=own, **fields))
  assert 'config.ensemble.own' in str(e.value) and '\n' not in str(e.value)


def test_pbt_is_refused_with_shared_leaves():
  config = _own_config('', own='head')
  config.pbt.enabled, config.data.validation_size = True, 500
  with pytest.raises(ConfigError, match="needs ensemble.own='all'"):
    checks.validate(config)


def test_path_rules_split_shared_and_own_leaves_over_model(tmp_path):
  """On a 'model' axis the layout's rules see a member's leaf paths ('params/0/w'), as
  without own: the backbone is split as a member's leaf would be, once."""
  source, _ = _backbone_file(tmp_path)
  config = _own_config(source)
  config.mesh.member, config.mesh.data, config.mesh.model = 2, 1, 2
  config.mesh.rules = (('^params/0/w$', (None, 'model')), ('1/w$', ('model', None)))
  parts = _parts(config)
  specs = jax.tree.map(lambda a: a.sharding.spec, parts.abstract_state)
  assert specs.params[0]['w']['shared'] == P(None, 'model')
  assert specs.params[1]['w']['own'] == P('member', 'model', None)
  assert specs.opt_state[0][0].mu[1]['w']['own'] == P('member', 'model', None)


def _step_flops(own, members):
  """XLA's FLOPs of one device's step as lowered (2 devices on 'member', shared batches):
  before XLA's optimisations, so a forward pass repeated or a backward pass computed and
  then dropped counts too, and nothing is compiled."""
  config = _own_config('', own=own, members=members)
  config.mesh.data, config.model.widths = 1, (256, 256)
  parts = _parts(config)
  step = assemble.build_step(parts, per_member_batches=False, form=('vmap', None))
  batch = mesh_lib.batch_sharding(parts.mesh)
  x = jax.ShapeDtypeStruct((BATCH, 40, 1), np.float32, sharding=batch)
  y = jax.ShapeDtypeStruct((BATCH,), np.int32, sharding=batch)
  members = mesh_lib.member_sharding(parts.mesh)
  hp = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=members),
                    parts.device_hparams())
  return step.fn.lower(parts.abstract_state, hp, x, y).cost_analysis()['flops']


def test_the_backbone_runs_forward_once_per_device_and_never_backward():
  """A second member per device costs a deep member's forward and backward pass with
  own='all', and with own='head' only its head's: the backbone's forward pass on the
  shared batch is not repeated, and its backward pass is not computed."""
  flops = {(own, m): _step_flops(own, m) for own in ('all', 'head') for m in (2, 4)}
  per_member = {own: flops[own, 4] - flops[own, 2] for own in ('all', 'head')}
  backbone_forward = 2 * BATCH * (40 * 256 + 256 * 256)
  assert per_member['all'] > 2.5 * backbone_forward  # forward and backward, every member
  assert per_member['head'] < 0.1 * backbone_forward
  assert flops['head', 2] < 1.5 * backbone_forward  # one forward, no backward


def test_batchnorm_statistics_stay_each_members_and_follow_its_batches(tmp_path):
  """The linen ResNet (examples/): conv kernels and BatchNorm scales are the shared, frozen
  backbone; each member's running statistics [M, ...] move with the batches it sees."""
  from flax import serialization
  from examples.flax_linen_resnet import make_model

  # The model's variables drawn in numpy on its init's structure (traced, not compiled).
  shapes = jax.eval_shape(make_model(channels=8).init, jax.random.key(7), np.zeros((1, 40, 1)))
  r = np.random.default_rng(7)
  variables = jax.tree.map(lambda s: r.normal(size=s.shape).astype(s.dtype) * 0.3, shapes)
  variables['batch_stats'] = jax.tree.map(np.abs, variables['batch_stats'])  # var > 0
  (tmp_path / 'v.msgpack').write_bytes(serialization.to_bytes(variables))
  config = _own_config(str(tmp_path / 'v.msgpack'))
  config.model.factory, config.model.kwargs.channels = 'examples.flax_linen_resnet:make_model', 8
  parts = _parts(config)
  assert parts.method.owned == frozenset({'Dense_0/kernel', 'Dense_0/bias'})
  (params, model_state), after, _, state = _train(parts, 2)
  np.testing.assert_array_equal(after['Conv_0']['kernel']['shared'],
                                variables['params']['Conv_0']['kernel'])
  np.testing.assert_array_equal(after['BatchNorm_0']['scale']['shared'],
                                variables['params']['BatchNorm_0']['scale'])
  mean = lambda s: np.asarray(s['batch_stats']['BatchNorm_0']['mean'])
  assert mean(model_state).shape[0] == 4
  assert not np.allclose(mean(model_state), mean(jax.device_get(state.model_state)))
  head = params['Dense_0']['kernel']['own']
  assert not np.allclose(after['Dense_0']['kernel']['own'], head)
