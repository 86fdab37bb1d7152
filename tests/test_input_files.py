"""Input files that do not read are refused in one line naming the file (issue 62): a
tokenizer.json that is not one, an empty or torn split of text data."""

import os
from pathlib import Path

import pytest

from dist_ens import data
from dist_ens.data import DataSpec
from support import one_line_refusal
from text_fixtures import write_jsonl, write_npz


def _cut(file: Path, keep: int) -> int:
  """Cuts `file` to its first `keep` bytes (a download stopped mid-way); its old size."""
  size = file.stat().st_size
  os.truncate(file, keep)
  return size


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
