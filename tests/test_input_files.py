"""Input files that do not read are refused in one line naming the file (and the tensor),
and training refuses them before it claims the workdir (issue 62): a safetensors file cut
short, a header that does not describe its bytes, a tokenizer.json that is not one, an
empty or torn split of text data, and a Hugging Face weight of another shape."""

import json
import os
import shutil
import struct
from pathlib import Path

import jax
import numpy as np
import pytest

import dist_ens
from dist_ens import data
from dist_ens.data import DataSpec
from dist_ens.io.pretrained import leaf_shapes, load_pretrained
from dist_ens.models import from_hf
from dist_ens.models.hf.checkpoint import Tensors
from support import one_line_refusal
from text_fixtures import ROOT, write_jsonl, write_npz

HF = ROOT / 'tests' / 'data' / 'hf'


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtypes=None) -> None:
  """float32 tensors in the safetensors layout; `dtypes` overrides a tensor's header dtype."""
  header, body = {}, b''
  for name, array in tensors.items():
    raw = np.ascontiguousarray(array, np.float32).tobytes()
    header[name] = {'dtype': (dtypes or {}).get(name, 'F32'), 'shape': list(array.shape),
                    'data_offsets': [len(body), len(body) + len(raw)]}
    body += raw
  text = json.dumps(header).encode()
  path.write_bytes(struct.pack('<Q', len(text)) + text + body)


def _copy(name: str, to: Path, edit=None, dtypes=None) -> Path:
  """Fixture `name` copied to `to`, its tensors through edit({name: array}) where given."""
  shutil.copytree(HF / name, to)
  if edit is not None or dtypes is not None:
    tensors = Tensors.open(to)
    tensors = {n: tensors.read(n) for n in tensors}
    _write_safetensors(to / 'model.safetensors', edit(tensors) if edit else tensors, dtypes)
  return to


def _cut(file: Path, keep: int) -> int:
  """Cuts `file` to its first `keep` bytes (a download stopped mid-way); its old size."""
  size = file.stat().st_size
  os.truncate(file, keep)
  return size


def test_a_safetensors_file_cut_mid_tensor_names_the_file_and_the_tensor(tmp_path):
  folder = _copy('gpt2', tmp_path / 'gpt2')
  file = folder / 'model.safetensors'
  size = _cut(file, file.stat().st_size - 5000)
  # The last tensor in the file (the token embedding, [96, 32]) lies past the cut.
  message = one_line_refusal(lambda: from_hf(str(folder)))
  assert str(file) in message and "'transformer.wte.weight'" in message
  assert f'the file holds {size - 5000} bytes' in message and f'byte {size}' in message
  # Training's path (config.model.init_from) reads the header alone, and refuses the same.
  message = one_line_refusal(lambda: leaf_shapes(f'hf:{folder}'))
  assert message.startswith('config.model.init_from=') and "'transformer.wte.weight'" in message
  # Cut inside the header: the file named, nothing parsed.
  _cut(file, 20)
  message = one_line_refusal(lambda: from_hf(str(folder)))
  assert str(file) in message and 'cut short' in message


def test_a_plain_safetensors_file_cut_or_misdescribed_names_the_tensor(tmp_path):
  file = tmp_path / 'w.safetensors'
  _write_safetensors(file, {'head/w': np.ones((4, 3)), 'head/b': np.zeros(3)})
  assert leaf_shapes(str(file))['head/w'].shape == (4, 3)
  _cut(file, file.stat().st_size - 4)
  for read in (load_pretrained, leaf_shapes):
    message = one_line_refusal(lambda: read(str(file)))  # pylint: disable=cell-var-from-loop
    assert str(file) in message and "'head/b'" in message and 'cut short' in message
  # A header whose byte range does not fit the tensor's shape.
  _write_safetensors(file, {'head/w': np.ones((4, 3))})
  raw = file.read_bytes().replace(b'[4, 3]', b'[4, 4]')
  file.write_bytes(raw)
  message = one_line_refusal(lambda: load_pretrained(str(file)))
  assert "'head/w'" in message and 'needs 64 bytes, but the header gives it 48' in message


def test_an_unknown_dtype_of_a_used_weight_is_refused_from_the_header(tmp_path):
  key = 'vit.layernorm.weight'
  folder = _copy('vit', tmp_path / 'vit', dtypes={key: 'F4_UNKNOWN'})
  message = one_line_refusal(lambda: leaf_shapes(f'hf:{folder}'))
  assert str(folder / 'model.safetensors') in message and repr(key) in message
  assert 'dtype F4_UNKNOWN' in message


def _text_folder(folder: Path, train: list[list[int]]) -> Path:
  folder.mkdir(parents=True)
  write_jsonl(folder / 'train.jsonl', train, [0] * len(train))
  write_jsonl(folder / 'test.jsonl', [[1, 2]], [0])
  return folder


def _load(folder: Path, **spec):
  return data.load_dataset(f'text:{folder}', DataSpec(name=f'text:{folder}', **spec))


def test_a_tokenizer_json_that_is_not_json_is_one_line(tmp_path):
  folder = _text_folder(tmp_path / 'text', [[1, 2]])
  (folder / 'test.jsonl').write_text('{"text": "a few words", "label": 0}\n')
  (folder / 'tokenizer.json').write_text('{"version": "1.0", "model": ')  # cut short
  message = one_line_refusal(lambda: _load(folder))
  assert str(folder / 'tokenizer.json') in message and 'is not a tokenizer' in message


@pytest.mark.parametrize('targets', ['label', 'next_token'])
def test_an_empty_split_is_named_not_blamed_on_the_batch(tmp_path, targets):
  folder = _text_folder(tmp_path / 'text', [])
  message = one_line_refusal(lambda: _load(folder, text_targets=targets))
  assert f"{folder / 'train.jsonl'} holds no examples" in message
  assert 'batch_size' not in message


def test_a_torn_npz_split_is_one_line_naming_it(tmp_path):
  folder = _text_folder(tmp_path / 'text', [[1, 2]])
  (folder / 'train.jsonl').unlink()
  write_npz(folder / 'train.npz', [[1, 2, 3]] * 50, [0] * 50)
  _cut(folder / 'train.npz', 200)
  message = one_line_refusal(lambda: _load(folder))
  assert f"{folder / 'train.npz'} cannot be read" in message


def test_a_misshapen_hf_weight_is_refused_before_the_workdir_is_claimed(tmp_path):
  """docs/training.md: invalid input fails before anything is written. The file's
  weights are read when the state is made, after the workdir is locked; their headers
  are checked before."""
  key = 'vit.encoder.layer.1.attention.attention.key.weight'
  folder = _copy('vit', tmp_path / 'vit', edit=lambda t: {**t, key: t[key][:, :16]})
  config = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.mesh.member, config.mesh.data = 2, 2, 1
  config.model.init_from = f'hf:{folder}'
  config.train.steps, config.data.batch_size, config.eval.batch_size = 2, 4, 8
  r = np.random.default_rng(0)
  dataset = data.from_arrays(r.normal(size=(8, 8, 8, 3)), r.integers(0, 10, 8),
                             r.normal(size=(8, 8, 8, 3)), r.integers(0, 10, 8))
  workdir = tmp_path / 'run'
  workdir.mkdir()
  message = one_line_refusal(lambda: dist_ens.train(
      config, str(workdir), devices=jax.devices()[:2], dataset=dataset))
  assert f"'{key}' has shape (32, 16) in the file" in message
  written = sorted(p.name for p in workdir.iterdir())
  assert written == [], f'the refused run wrote {written} (.lock, checkpoints/, config.json?)'
