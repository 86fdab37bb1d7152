"""Hugging Face checkpoints (dist_ens.models.hf): each committed tiny checkpoint in
tests/data/hf/ (tools/make_hf_fixtures.py wrote them with transformers) loads by name
and gives transformers' own outputs to 1e-5 in float32; a weight missing or of another
shape is refused in one line naming it; config.model.init_from='hf:PATH' trains, every
member starting from the file."""

import json
import shutil
import struct
from pathlib import Path

import jax
import numpy as np
import pytest

import dist_ens
from dist_ens.run import assemble, initial_state
from dist_ens.config.loading import load_config
from dist_ens.errors import ConfigError
from dist_ens.io.pretrained import flatten, read_orbax
from dist_ens.models import from_hf
from dist_ens.models.hf import load_leaves
from dist_ens.models.hf.checkpoint import Tensors

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / 'tests' / 'data' / 'hf'
FIXTURES = ('gpt2', 'llama', 'llama_tied', 'bert', 'roberta', 'vit')
TOLERANCE = 1e-5


@pytest.mark.parametrize('name', FIXTURES)
def test_outputs_equal_transformers(name):
  model, params = from_hf(str(DATA / name))
  reference = np.load(DATA / name / 'reference.npz')
  logits, _ = jax.jit(lambda p, x: model.apply(p, {}, x, train=False))(params,
                                                                        reference['inputs'])
  assert logits.shape == reference['logits'].shape
  assert np.abs(np.asarray(logits) - reference['logits']).max() <= TOLERANCE
  # The model's own init has the loaded params' tree and shapes (one table makes both).
  fresh = jax.eval_shape(model.init, jax.random.key(0), reference['inputs'])[0]
  assert jax.tree.structure(fresh) == jax.tree.structure(params)
  assert all(a.shape == b.shape for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(params)))


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
  header, body = {}, b''
  for name, array in tensors.items():
    raw = np.ascontiguousarray(array, np.float32).tobytes()
    header[name] = {'dtype': 'F32', 'shape': list(array.shape),
                    'data_offsets': [len(body), len(body) + len(raw)]}
    body += raw
  text = json.dumps(header).encode()
  path.write_bytes(struct.pack('<Q', len(text)) + text + body)


def _edited(tmp_path: Path, name: str, edit) -> Path:
  """A copy of fixture `name` whose tensors are edit({file name: array})."""
  folder = tmp_path / name
  shutil.copytree(DATA / name, folder)
  tensors = Tensors.open(folder)
  _write_safetensors(folder / 'model.safetensors', edit({n: tensors.read(n) for n in tensors}))
  return folder


def _one_line(call) -> str:
  with pytest.raises(ConfigError) as e:
    call()
  message = str(e.value)
  assert '\n' not in message, message
  return message


def test_missing_or_misshapen_weight_refused_in_one_line(tmp_path):
  key = 'bert.encoder.layer.1.attention.self.key.weight'
  missing = _edited(tmp_path / 'a', 'bert', lambda t: {n: v for n, v in t.items() if n != key})
  message = _one_line(lambda: from_hf(str(missing)))
  assert f"lacks weight '{key}' of shape (32, 32)" in message
  assert 'BertForSequenceClassification' in message
  misshapen = _edited(tmp_path / 'b', 'bert', lambda t: {**t, key: t[key][:, :16]})
  message = _one_line(lambda: from_hf(str(misshapen)))
  assert f"'{key}' has shape (32, 16) in the file" in message and 'needs (32, 32)' in message
  # Through the config the message names config.model.init_from.
  config = _config(f'hf:{misshapen}')
  message = _one_line(lambda: initial_state.init_sharded(assemble.build_run(
      config, shapes=((7,), 3, np.int32)).parts))
  assert message.startswith('config.model.init_from=') and key in message


def test_base_model_names_and_unknown_architectures(tmp_path):
  # A file saved from the base model alone ('encoder...', no 'bert.') reads the same.
  stripped = _edited(tmp_path, 'bert',
                     lambda t: {n.removeprefix('bert.'): v for n, v in t.items()})
  for path, value in load_leaves(str(DATA / 'bert')).items():
    np.testing.assert_array_equal(load_leaves(str(stripped))[path], value)
  config = json.loads((stripped / 'config.json').read_text())
  (stripped / 'config.json').write_text(json.dumps({**config, 'architectures': ['T5Model']}))
  assert 'name none that dist_ens builds' in _one_line(lambda: from_hf(str(stripped)))
  assert 'not a folder with config.json' in _one_line(lambda: from_hf(str(tmp_path / 'no')))


def _config(init_from: str, **model):
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.mesh.member, config.mesh.data = 4, 4, 2
  config.model.init_from = init_from
  for key, value in model.items():
    config.model[key] = value
  config.train.steps, config.train.log_every, config.train.eval_every = 2, 1, 0
  config.checkpoint.every = 2
  config.data.batch_size, config.eval.batch_size = 8, 16
  config.writers = ('jsonl',)
  return config


def test_init_from_hf_trains_from_the_file(tmp_path):
  r = np.random.default_rng(0)
  dataset = dist_ens.data.from_arrays(r.normal(size=(32, 8, 8, 3)), r.integers(0, 10, 32),
                                      r.normal(size=(16, 8, 8, 3)), r.integers(0, 10, 16))
  # The ViT of config.json whatever config.model.name says; with its classifier too.
  config = _config(f'hf:{DATA / "vit"}', init_owned_from_file=True)
  run = assemble.build_run(config, dataset=dataset)
  state = flatten(jax.device_get(initial_state.init_sharded(run.parts)).params)
  file = load_leaves(str(DATA / 'vit'))
  assert set(state) == set(file)
  for path, value in file.items():
    np.testing.assert_array_equal(state[path][0], value, err_msg=path)
    np.testing.assert_array_equal(state[path][3], value, err_msg=path)
  # Plain SGD: what is checked is where the members start, and Adam's per-leaf update
  # (decoupled decay on a mask) doubled the compile of this ViT's step at -O0.
  config.optim.update(name='sgd', momentum=0.0, weight_decay=0.0)
  results = dist_ens.train(config, str(tmp_path / 'run'), dataset=dataset)
  assert results['step'] == 2 and np.isfinite(results['members']['nll']).all()
  trained = flatten(read_orbax(tmp_path / 'run' / 'checkpoints' / '2' / 'model')['params'])
  for path in ('blocks/0/attn/q/w', 'head/w'):  # The file's weights moved, in every member.
    assert all(not np.array_equal(trained[path][m], file[path]) for m in range(4)), path


def test_language_model_on_a_classification_task_refused():
  message = _one_line(lambda: assemble.build_run(
      _config(f'hf:{DATA / "gpt2"}'), shapes=((7,), 3, np.int32)))
  assert "config.model.init_from='hf:" in message and '(2, 7, 96)' in message


def test_split_over_model_reads_only_each_devices_slices(monkeypatch):
  from dist_ens.io import init_from  # pylint: disable=import-outside-toplevel
  from dist_ens.models import hf  # pylint: disable=import-outside-toplevel
  from dist_ens.parallel import sharding_rules  # pylint: disable=import-outside-toplevel
  from dist_ens.parallel.layout import Layout  # pylint: disable=import-outside-toplevel

  reads = []
  read = Tensors.read

  def counting(self, name, index=(), convert=None):
    out = read(self, name, index, convert)
    reads.append((name, out.size, int(np.prod(self.shape(name)))))
    return out

  monkeypatch.setattr(Tensors, 'read', counting)
  source = f'hf:{DATA / "llama"}'
  mesh = jax.make_mesh((2, 1, 4), ('member', 'data', 'model'))
  layout = Layout(axes=('member', 'data', 'model'),
                  rule=sharding_rules.fsdp('model', axis_size=4, min_size=1024))
  model = hf.build(source)
  placed = init_from.pretrained_leaves(init_from.InitFrom(source), model, (7,), 96, mesh,
                                       layout, owned=frozenset())
  placing = list(reads)
  whole = {name: np.asarray(leaf) for name, leaf in load_leaves(source).items()}
  split = 0
  for name, leaf in flatten(placed.params).items():
    np.testing.assert_array_equal(leaf, whole[name])
  for leaf in jax.tree.leaves(placed.params):
    split += leaf.addressable_shards[0].data.size * 4 == leaf.size
  assert split >= 10  # every kernel of 1,024+ elements is split 4 ways
  # No split leaf's tensor was read whole while placing (each device: a quarter).
  big = [(name, size, total) for name, size, total in placing if total >= 1024]
  assert big and all(size * 4 == total for _, size, total in big)
