"""config.ensemble.own='lora': rank-r adapters per member on one frozen backbone.

The backbone and head start from a file written here (config.model.init_from); with B = 0
every member's first forward pass is the file's model, computed with numpy. After training
the file's kernels are bit-identical, stored once whatever M, and only the factors and the
heads have optimizer state; merged members are W + scale * A @ B computed with numpy from
the checkpoint's factors; resume is exact; bad fields are refused with one line.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dist_ens
from runs import killed_after
import support
from dist_ens import Ensemble, data
from dist_ens.ensembles import lora, stored
from dist_ens.errors import ConfigError
from dist_ens.io.adapters import export_adapters
from dist_ens.io.member_files import load_member
from dist_ens.io.pretrained import load_pretrained, read_orbax
from test_own import BATCH, _bytes_per_device, _numpy_loss, _own_config, _parts, _steps


def _model_file(tmp_path):
  """An MLP 40-16-10's body and head under the model's names."""
  r = np.random.default_rng(5)
  weights = {'0/w': r.normal(size=(40, 16)).astype(np.float32) * 0.2,
             '0/b': r.normal(size=(16,)).astype(np.float32) * 0.1,
             '1/w': r.normal(size=(16, 10)).astype(np.float32) * 0.3,
             '1/b': r.normal(size=(10,)).astype(np.float32) * 0.1}
  np.savez(tmp_path / 'mlp.npz', **weights)
  return str(tmp_path / 'mlp.npz'), weights


def _lora_config(source, members=4, rank=4, alpha=0.0, targets='', from_file=True):
  config = _own_config(source, own='lora', members=members)
  config.ensemble.lora_rank, config.ensemble.lora_alpha = rank, alpha
  config.ensemble.lora_targets = targets
  config.model.init_owned_from_file = from_file
  return config


def _sgd_config(source):
  """_lora_config's with SGD (momentum 0.9, the default): test_the_member_loop_steps_as_the_vmap
  says why not Adam."""
  return support.override(_lora_config(source), optim__name='sgd')


@pytest.fixture(scope='module')
def vmapped(tmp_path_factory):
  """3 steps of the 4 members (vmapped) adapting the file's layer 0, the heads from the
  file and A drawn per member: (source, file, _steps' result), read by three tests (the
  first step's losses are the pretrained model's, the member loop's steps are compared
  with these; each took the same steps in a build of its own)."""
  source, file = _model_file(tmp_path_factory.mktemp('lora'))
  return source, file, _steps(_sgd_config(source), 3)


def test_every_members_first_forward_is_the_pretrained_models(vmapped):
  _, file, (before, _, first_loss, parts, _) = vmapped
  assert parts.method.lora == lora.Lora(frozenset({'0/w'}), 4, 1.0)
  x, y = next(data.BatchIterator(data.load_dataset('mnist1d').train, BATCH, seed=0))
  expected = _numpy_loss(file['0/w'], file['0/b'], file['1/w'], file['1/b'],
                         np.asarray(x, np.float64), y)
  np.testing.assert_allclose(first_loss, [expected] * 4, rtol=2e-5)
  # The members evaluation forms: the file's kernel exactly (B = 0), A drawn per member.
  state = jax.device_get(dist_ens.run.initial_state.init_sharded(parts))
  formed = jax.device_get(stored.form_all(parts.predict_model, state.params, parts.mesh))
  for m in range(4):
    np.testing.assert_array_equal(formed[0]['w'][m], file['0/w'])
  a = before[0]['w']['lora_a']
  assert a.shape == (4, 40, 4) and not np.allclose(a[0], a[1])
  assert np.std(a) == pytest.approx(1 / np.sqrt(40), rel=0.2)
  np.testing.assert_array_equal(before[0]['w']['lora_b'], np.zeros((4, 4, 16)))


def test_training_moves_only_the_factors_and_heads(vmapped):
  _, file, (before, after, _, _, state) = vmapped
  layer0, head = after
  np.testing.assert_array_equal(layer0['w']['shared'], file['0/w'])
  np.testing.assert_array_equal(layer0['b']['shared'], file['0/b'])
  for factor in ('lora_a', 'lora_b'):
    assert not np.array_equal(layer0['w'][factor], before[0]['w'][factor])
    assert not np.allclose(layer0['w'][factor][0], layer0['w'][factor][1])
  assert not np.array_equal(head['w']['own'], before[1]['w']['own'])
  # SGD's momentum traces: A [4, 40, 4], B [4, 4, 16] and the head; none for W or the bias.
  moments = sorted(leaf.shape for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim > 1)
  assert moments == sorted([(4, 40, 4), (4, 4, 16), (4, 16, 10), (4, 10)])


def test_the_backbone_is_stored_once_whatever_m(tmp_path):
  source, file = _model_file(tmp_path)
  sizes = {m: _bytes_per_device(_parts(_lora_config(source, members=m))) for m in (2, 4)}
  # 2 devices on 'member': 1 then 2 members per device. A member adds its factors and
  # head (params, Adam's mu and nu), Adam's and the schedule's counts, its frozen flag.
  member = (40 * 4 + 4 * 16 + 16 * 10 + 10) * 4
  assert sizes[4] - sizes[2] == 3 * member + 4 + 4 + 1
  # What is left is stored once: the kernel and bias of layer 0, the scale, the step.
  assert sizes[2] - (sizes[4] - sizes[2]) == (40 * 16 + 16) * 4 + 4 + 4


def _train(config, workdir, actions=()):
  config.train.log_every, config.train.eval_every, config.checkpoint.every = 8, 0, 8
  config.mesh.data = 1
  return dist_ens.train(config, str(workdir), devices=jax.devices()[:2], actions=actions)


def test_resume_is_exact_and_members_are_merged(tmp_path):
  source, file = _model_file(tmp_path)
  config = lambda: _lora_config(source, rank=2, alpha=6.0, from_file=False)
  straight = _train(config(), tmp_path / 'a')
  # Resumed from what a kill after step 16's checkpoint leaves (the matrix's own=lora
  # case preempts a run and resumes it).
  resumed = _train(config(), killed_after(tmp_path / 'a', 16, tmp_path / 'b'))
  assert resumed['members'] == straight['members']
  assert resumed['ensemble'] == straight['ensemble']

  saved = read_orbax(tmp_path / 'a' / 'checkpoints' / '24' / 'model')['params'][0]['w']
  np.testing.assert_array_equal(saved['shared'], file['0/w'])
  assert float(saved['lora_scale']) == 3.0  # alpha / rank
  ens = Ensemble.load(tmp_path / 'a', devices=jax.devices()[:1])
  files = ens.export(tmp_path / 'members')
  for m in range(4):  # The merged kernel, in float64 numpy from the checkpoint's factors.
    a, b = saved['lora_a'][m].astype(np.float64), saved['lora_b'][m].astype(np.float64)
    merged = file['0/w'] + 3.0 * a @ b
    np.testing.assert_allclose(load_member(files[m])[0]['w'], merged, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ens.member(m)[0]['w'], load_member(files[m])[0]['w'])
  assert not np.allclose(ens.member(0)[0]['w'], ens.member(1)[0]['w'])
  # Unmerged: the base once and each member's adapter; merged with numpy, the member.
  adapters = export_adapters(tmp_path / 'a', tmp_path / 'adapters')
  with np.load(tmp_path / 'adapters' / 'base.npz') as base:
    assert sorted(base.files) == ['0/b', '0/w']
    np.testing.assert_array_equal(base['0/w'], file['0/w'])
  for m, path in enumerate(adapters):
    with np.load(path) as a:
      assert sorted(a.files) == ['0/w/lora_a', '0/w/lora_b', '0/w/lora_scale', '1/b', '1/w']
      merged = file['0/w'] + a['0/w/lora_scale'] * (a['0/w/lora_a'] @ a['0/w/lora_b'])
      np.testing.assert_allclose(ens.member(m)[0]['w'], merged, rtol=1e-5, atol=1e-6)
      np.testing.assert_array_equal(ens.member(m)[1]['w'], a['1/w'])
  with pytest.raises(FileNotFoundError, match='holds no checkpoint'):
    export_adapters(tmp_path / 'members', tmp_path / 'x')
  # init_from of the workdir's member 2 reads its merged kernel (merged by numpy there).
  np.testing.assert_allclose(load_pretrained(f'{tmp_path / "a"}#2')['params/0/w'],
                             ens.member(2)[0]['w'], rtol=1e-5, atol=1e-6)


def _linen_value(path, shape, r):
  """A linen ResNet variable's value: kernels drawn as fan-in-scaled normals, BatchNorm
  scales and variances ones, biases and means zeros."""
  if path.endswith("['kernel']"):
    return (r.normal(size=shape) / np.sqrt(np.prod(shape[:-1]))).astype(np.float32)
  ones = path.endswith("['scale']") or path.endswith("['var']")
  return (np.ones if ones else np.zeros)(shape, np.float32)


def test_a_conv_kernel_is_adapted_as_a_matrix(tmp_path):
  """The linen ResNet (examples/): lora_targets picks its 3-D conv kernels, each adapted
  as [width * in, out]; BatchNorm scales stay shared and the Dense head owned. One
  residual block (the stem's conv and the block's two: a conv in and out of a block),
  not the example's two, and one step: the compile of the ResNet's step is the cost."""
  from flax import serialization
  from examples.flax_linen_resnet import make_model

  # The file's values drawn by numpy on linen's shapes: linen's own init, jitted or
  # eager, compiles its initializers' draws (XLA:CPU's slowest compile in this test).
  shapes = jax.eval_shape(make_model(channels=8, num_blocks=1).init, jax.random.key(7),
                          np.zeros((1, 40, 1)))
  r = np.random.default_rng(7)
  variables = jax.tree_util.tree_map_with_path(lambda path, s: _linen_value(
      jax.tree_util.keystr(path), s.shape, r), shapes)
  (tmp_path / 'v.msgpack').write_bytes(serialization.to_bytes(variables))
  config = _lora_config(str(tmp_path / 'v.msgpack'), targets='Conv_.*/kernel')
  config.model.factory, config.model.kwargs.channels = 'examples.flax_linen_resnet:make_model', 8
  config.model.kwargs.num_blocks = 1
  _, after, _, parts, _ = _steps(config, 1)
  assert parts.method.lora.targets == {'Conv_0/kernel', 'ResBlock_0/Conv_0/kernel',
                                       'ResBlock_0/Conv_1/kernel'}
  conv = after['Conv_0']['kernel']
  np.testing.assert_array_equal(conv['shared'], variables['params']['Conv_0']['kernel'])
  width = int(np.prod(conv['shared'].shape[:-1]))
  assert conv['lora_a'].shape == (4, width, 4) and np.abs(conv['lora_b']).max() > 0


@pytest.mark.parametrize('fields,match', [
    ({'rank': 0}, r'lora_rank=0 must be an int >= 1'),
    ({'alpha': -1.0}, r'lora_alpha=-1.0 must be a number >= 0'),
    ({'targets': '^nothing$'}, r"lora_targets='\^nothing\$' names no kernel to adapt"),
    ({'targets': '^1/w$'}, r'names no kernel to adapt .*the head'),
    ({'targets': '('}, 'is not a regular expression'),
])
def test_bad_fields_give_one_line_naming_the_field(fields, match):
  with pytest.raises(ConfigError, match=match) as e:
    _parts(_lora_config('', from_file=False, **fields))
  assert 'config.ensemble.lora_' in str(e.value) and '\n' not in str(e.value)


def test_the_member_loop_steps_as_the_vmap(vmapped):
  source, _, (_, stepped, _, _, _) = vmapped  # The fixture's 3 vmapped steps.
  # Two compiled programs (vmap and a loop) may order a sum differently, so they agree to
  # support.float_tolerance, not bit for bit. With SGD, not Adam: Adam divides each update
  # by the gradient's own size, so an element whose gradient is at rounding level takes a
  # step of up to the learning rate either way (1 of 640 elements 1.8e-6 apart on an
  # AVX-512 EPYC, past any float tolerance); SGD passes rounding on as is.
  _, looped, _, _, _ = _steps(_sgd_config(source), 3, form=('map', None))
  # The gradient's largest sum: over the batch's examples.
  support.assert_trees_close(stepped, looped, BATCH)


def test_on_a_model_axis_w_is_split_once_and_the_factors_per_member(tmp_path):
  source, _ = _model_file(tmp_path)
  config = _lora_config(source)
  config.mesh.member, config.mesh.data, config.mesh.model = 2, 1, 2
  config.mesh.rules = (('^params/0/w$', (None, 'model')), ('lora_a$', ('model', None)))
  specs = jax.tree.map(lambda a: a.sharding.spec, _parts(config).abstract_state.params[0]['w'])
  assert specs == {'shared': P(None, 'model'), 'lora_scale': P(),
                   'lora_a': P('member', 'model', None), 'lora_b': P('member')}
