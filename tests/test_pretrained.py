"""config.model.init_from: members start from a file's leaves (every format), their heads
fresh per member; bad files give one line naming the leaf."""

import json
import struct
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

import dist_ens
from dist_ens.run import assemble, initial_state
from dist_ens.config.loading import load_config
from dist_ens.core import rng
from dist_ens.errors import ConfigError
from dist_ens import Ensemble
from dist_ens.io.pretrained import load_pretrained
from dist_ens.models.heads import head_paths

ROOT = Path(__file__).resolve().parents[1]
M, SHAPES = 4, ((40, 1), 10)  # mnist1d: 40 values, 10 classes


def _config(**model):
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.mesh.member, config.mesh.data = M, 4, 2
  config.model.widths = (16,)
  for key, value in model.items():
    config.model[key] = value
  return config


def _init(config):
  parts = assemble.build_run(config, shapes=SHAPES).parts
  return parts, jax.device_get(initial_state.init_sharded(parts))


def _mlp_file(seed=0):
  """An MLP 40-16-10's leaves under the model's names, drawn independently of its init."""
  r = np.random.default_rng(seed)
  return {'0/w': r.normal(size=(40, 16)).astype(np.float32),
          '0/b': r.normal(size=(16,)).astype(np.float32),
          '1/w': r.normal(size=(16, 10)).astype(np.float32),
          '1/b': r.normal(size=(10,)).astype(np.float32)}


def _fresh_mlp():
  """The MLP's own per-member init: model.init vmapped over the member keys."""
  parts = assemble.build_run(_config(), shapes=SHAPES).parts
  keys = rng.member_keys(0, np.arange(M, dtype=np.uint32))
  return jax.device_get(jax.vmap(lambda k: parts.model.init(k, np.zeros((1, 40, 1)))[0])(keys))


def _write_safetensors(path, tensors):
  """The format by hand: 8-byte little-endian header size, JSON header, raw bytes."""
  names = {np.dtype(np.float32): 'F32', np.dtype(np.float16): 'F16',
           np.dtype(ml_dtypes.bfloat16): 'BF16', np.dtype(np.int32): 'I32'}
  header, body = {'__metadata__': {'format': 'np'}}, b''
  for name, array in tensors.items():
    raw = np.ascontiguousarray(array).tobytes()
    header[name] = {'dtype': names[array.dtype], 'shape': list(array.shape),
                    'data_offsets': [len(body), len(body) + len(raw)]}
    body += raw
  text = json.dumps(header).encode()
  Path(path).write_bytes(struct.pack('<Q', len(text)) + text + body)


def test_members_start_from_the_file_and_own_fresh_heads(tmp_path):
  file = _mlp_file()
  np.savez(tmp_path / 'w.npz', **file)
  _, state = _init(_config(init_from=str(tmp_path / 'w.npz')))
  body, head = state.params
  for name in ('w', 'b'):  # Every member's body is the file's, exactly.
    np.testing.assert_array_equal(body[name], np.broadcast_to(file[f'0/{name}'], (M,) +
                                                              file[f'0/{name}'].shape))
  # The head starts fresh per member, distinct, and not as a run without init_from (a
  # pretraining run with the same seed) started its own: member 0's would be the
  # pretrained head's init otherwise.
  _, plain = _init(_config())
  assert all(not np.allclose(head['w'][m], plain.params[1]['w'][m]) for m in range(M))
  assert all(not np.allclose(head['w'][0], head['w'][m]) for m in range(1, M))
  model = assemble.build_run(_config(), shapes=SHAPES).parts.model
  keys = rng.fresh_keys(rng.member_keys(0, np.arange(M, dtype=np.uint32)))
  want = jax.vmap(lambda k: model.init(k, np.zeros((1, 40, 1)))[0][1]['w'])(keys)
  np.testing.assert_allclose(head['w'], want, rtol=1e-6)  # (the sharded init's rounding)
  # Adam's moments start at zero for the loaded leaves too (fresh optimizer state).
  assert all(not np.any(leaf) for leaf in jax.tree.leaves(state.opt_state)
             if np.ndim(leaf) > 1)

  _, owned = _init(_config(init_from=str(tmp_path / 'w.npz'), init_owned_from_file=True))
  np.testing.assert_array_equal(owned.params[1]['w'], np.broadcast_to(file['1/w'], (M, 16, 10)))


def test_each_format_round_trips(tmp_path):
  import orbax.checkpoint as ocp
  from flax import serialization

  r = np.random.default_rng(1)
  tree = {'enc': {'dense': {'kernel': r.normal(size=(3, 4)).astype(np.float32)},
                  'layers': [r.normal(size=(2,)).astype(np.float32)]},
          'step': np.arange(3, dtype=np.int32)}
  flat = {'enc/dense/kernel': tree['enc']['dense']['kernel'],
          'enc/layers/0': tree['enc']['layers'][0], 'step': tree['step']}
  np.savez(tmp_path / 'a.npz', **flat)
  (tmp_path / 'a.msgpack').write_bytes(serialization.msgpack_serialize(
      {'enc': {'dense': tree['enc']['dense'], 'layers': {'0': tree['enc']['layers'][0]}},
       'step': tree['step']}))
  _write_safetensors(tmp_path / 'a.safetensors', flat)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save((tmp_path / 'orbax').absolute(), tree)
  for name in ('a.npz', 'a.msgpack', 'a.safetensors', 'orbax'):
    loaded = load_pretrained(tmp_path / name)
    assert sorted(loaded) == sorted(flat), name
    for key, value in flat.items():
      np.testing.assert_array_equal(loaded[key], value, err_msg=f'{name}: {key}')
      assert loaded[key].dtype == value.dtype, (name, key)
  # Half-precision safetensors come back bit for bit, in their own dtypes.
  half = {'h': np.array([1.5, -2.25], np.float16), 'b': np.array([3.0, 0.1], ml_dtypes.bfloat16)}
  _write_safetensors(tmp_path / 'h.safetensors', half)
  loaded = load_pretrained(tmp_path / 'h.safetensors')
  assert loaded['b'].dtype == ml_dtypes.bfloat16 and loaded['h'].dtype == np.float16
  np.testing.assert_array_equal(loaded['b'].view(np.uint16), half['b'].view(np.uint16))


def test_safetensors_with_dotted_names_through_init_map(tmp_path):
  file = _mlp_file(2)
  torch_like = {f'layers.{k.replace("/", ".")}': v for k, v in file.items()}
  _write_safetensors(tmp_path / 'w.safetensors', torch_like)
  _, state = _init(_config(init_from=str(tmp_path / 'w.safetensors'),
                           init_map=((r'^layers\.', ''), (r'\.', '/'))))
  np.testing.assert_array_equal(state.params[0]['w'][2], file['0/w'])


def test_a_flax_msgpack_starts_params_and_batchnorm_statistics(tmp_path):
  """The linen ResNet with BatchNorm (examples/): its variables from flax itself, shifted
  so no leaf equals its init; its last Dense is the head."""
  from flax import serialization
  from examples.flax_linen_resnet import make_model

  variables = make_model(channels=8).init(jax.random.key(7), np.zeros((1, 40, 1)))
  shifted = jax.tree.map(lambda v: np.asarray(v) + 0.5, variables)
  (tmp_path / 'v.msgpack').write_bytes(serialization.to_bytes(shifted))
  config = _config(factory='examples.flax_linen_resnet:make_model', init_from=str(
      tmp_path / 'v.msgpack'))
  config.model.kwargs.channels = 8
  _, state = _init(config)
  conv = shifted['params']['Conv_0']['kernel']
  np.testing.assert_array_equal(state.params['Conv_0']['kernel'], np.broadcast_to(
      conv, (M,) + conv.shape))
  mean = shifted['batch_stats']['BatchNorm_0']['mean']
  np.testing.assert_array_equal(state.model_state['batch_stats']['BatchNorm_0']['mean'],
                                np.broadcast_to(mean, (M,) + mean.shape))
  head = state.params['Dense_0']['kernel']
  assert not np.allclose(head[0], head[1])
  assert not np.allclose(head[0], shifted['params']['Dense_0']['kernel'])


@pytest.fixture(scope='module')
def trained(tiny_run):
  """A dist_ens workdir to start from: the session's shared finished run (tests/runs.py),
  4 members of a (16,) MLP, read, not written."""
  return tiny_run[0]


def test_a_workdir_member_is_a_source(trained, tmp_path):
  ensemble = Ensemble.load(trained)
  for source, member in ((str(trained), 0), (f'{trained}#1', 1)):
    loaded = load_pretrained(source)
    expected = ensemble.member(member)
    assert sorted(loaded) == ['params/0/b', 'params/0/w', 'params/1/b', 'params/1/w']
    for i in range(2):
      for name in ('w', 'b'):
        np.testing.assert_array_equal(loaded[f'params/{i}/{name}'], expected[i][name])

  # Fine-tune from member 1, the whole run through dist_ens.train: with a ~0 learning
  # rate every member ends as it started, i.e. as member 1's body.
  config = _config(init_from=f'{trained}#1')
  config.optim.learning_rate = 1e-30  # (must be > 0): updates far below a float32 ulp
  config.train.steps, config.train.log_every, config.train.eval_every = 2, 2, 0
  dist_ens.train(config, str(tmp_path / 'tuned'))
  tuned = Ensemble.load(tmp_path / 'tuned')
  for m in range(M):
    np.testing.assert_array_equal(tuned.member(m)[0]['w'], ensemble.member(1)[0]['w'])
  assert not np.allclose(tuned.member(0)[1]['w'], ensemble.member(1)[1]['w'])


def test_a_batchensemble_member_is_formed_from_w_and_its_factors(tmp_path):
  config = _config()
  config.num_members, config.mesh.member, config.mesh.data = 2, 2, 4
  config.ensemble.method = 'batchensemble'
  config.train.steps, config.train.log_every, config.train.eval_every = 2, 2, 0
  dist_ens.train(config, str(tmp_path / 'be'))
  expected = Ensemble.load(tmp_path / 'be').member(1)  # formed by the evaluator's path
  loaded = load_pretrained(f'{tmp_path / "be"}#1')
  for i in range(2):
    for name in ('w', 'b'):
      np.testing.assert_allclose(loaded[f'params/{i}/{name}'], expected[i][name], rtol=1e-6)


def _error(config) -> str:
  with pytest.raises(ConfigError) as e:
    _init(config)
  message = str(e.value)
  assert '\n' not in message and 'config.model.init' in message, message
  return message


def test_bad_files_give_one_line_naming_the_leaf(tmp_path, trained):
  assert 'no such file' in _error(_config(init_from=str(tmp_path / 'nope.npz')))
  (tmp_path / 'w.pt').write_bytes(b'x')
  assert "unknown format '.pt'" in _error(_config(init_from=str(tmp_path / 'w.pt')))
  assert 'members 0..3' in _error(_config(init_from=f'{trained}#5'))
  (tmp_path / 'torn.npz').write_bytes(b'PK\x03\x04 not a zip')
  assert 'cannot be read' in _error(_config(init_from=str(tmp_path / 'torn.npz')))

  file = _mlp_file()
  np.savez(tmp_path / 'shape.npz', **{**file, '0/w': file['0/w'][:, :8]})
  message = _error(_config(init_from=str(tmp_path / 'shape.npz')))
  assert 'params/0/w' in message and '(40, 16)' in message and '(40, 8)' in message
  np.savez(tmp_path / 'missing.npz', **{k: v for k, v in file.items() if k != '0/b'})
  assert "params '0/b'" in _error(_config(init_from=str(tmp_path / 'missing.npz')))
  np.savez(tmp_path / 'extra.npz', **file, **{'encoder/w': file['0/w']})
  assert "'encoder/w' names no leaf" in _error(_config(init_from=str(tmp_path / 'extra.npz')))
  # Dropped by init_map, the extra leaf is fine; a head of another class count too.
  np.savez(tmp_path / 'head100.npz', **{**file, '1/w': np.zeros((16, 100), np.float32),
                                        '1/b': np.zeros(100, np.float32)})
  _, state = _init(_config(init_from=str(tmp_path / 'head100.npz')))
  np.testing.assert_array_equal(state.params[0]['w'][3], file['0/w'])
  _init(_config(init_from=str(tmp_path / 'extra.npz'), init_map=(('^encoder/.*', ''),)))
  message = _error(_config(init_from=str(tmp_path / 'head100.npz'), init_owned_from_file=True))
  assert 'params/1/b' in message and '(10,)' in message and '(100,)' in message


def test_msgpack_without_flax_says_what_to_install(tmp_path, monkeypatch):
  (tmp_path / 'w.msgpack').write_bytes(b'')
  monkeypatch.setitem(sys.modules, 'flax', None)  # import flax now raises ImportError
  with pytest.raises(ConfigError, match=r'needs flax \(pip install flax\)'):
    load_pretrained(tmp_path / 'w.msgpack')


def test_without_init_from_members_start_as_before():
  """Member m from its own key, as model.init makes it (eager here: rounding differs)."""
  _, state = _init(_config())
  fresh = _fresh_mlp()
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(fresh)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_head_paths():
  shape = lambda *s: jax.ShapeDtypeStruct(s, np.float32)
  mlp = [{'w': shape(4, 10), 'b': shape(10)}, {'w': shape(10, 10), 'b': shape(10)}]
  assert head_paths(mlp, 10) == {'1/w', '1/b'}
  linen = {f'Dense_{i}': {'kernel': shape(8, 3 if i in (2, 10) else 8)} for i in range(11)}
  assert head_paths(linen, 3) == {'Dense_10/kernel'}
  named = {'blocks': {'0': {'w': shape(8, 8)}}, 'head': {'w': shape(8, 5), 'b': shape(5)}}
  assert head_paths(named, 5) == {'head/w', 'head/b'}
  assert head_paths({'w': shape(8, 8)}, 3) == frozenset()


def test_on_a_model_axis_loaded_leaves_are_born_split(tmp_path):
  """mesh.model=2 with FSDP: the loaded kernel is split over 'model' like a fresh one."""
  file = _mlp_file(3)
  np.savez(tmp_path / 'w.npz', **file)
  config = _config(init_from=str(tmp_path / 'w.npz'))
  config.mesh.member, config.mesh.data, config.mesh.model = 4, 1, 2
  config.mesh.fsdp_min_size = 64
  parts = assemble.build_run(config, shapes=SHAPES).parts
  state = initial_state.init_sharded(parts)
  kernel = state.params[0]['w']
  assert 'model' in kernel.sharding.spec and kernel.sharding == parts.state_shardings.params[0]['w']
  np.testing.assert_array_equal(np.asarray(kernel), np.broadcast_to(file['0/w'], (M, 40, 16)))
