"""A Hugging Face checkpoint on disk: where it is, its config.json, and its tensors read
lazily from safetensors files.

  folder = locate('hf:/ckpt/tiny-llama')      # or 'hf:org/name', a hub id
  config = read_config(folder)                # config.json as a dict
  tensors = Tensors.open(folder)              # model.safetensors or a sharded index
  tensors.shape('model.norm.weight'), tensors.read('model.norm.weight')
  tensors.read('lm_head.weight', (slice(0, 64), slice(None)))  # only those rows

Safetensors files are read with numpy through a memory map (no dependency; the same
layout io/pretrained.py reads): a tensor is a view of the mapped file, so a read of a
slice touches only the pages that slice lies on, never the whole tensor, and the pages
are given back after each read (what safetensors' lazy safe_open slices do, without
the package).

A hub id is fetched with huggingface_hub (the optional extra `dist_ens[hf]`) where
the network allows, else taken from its local cache.
"""

import json
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dist_ens.errors import ConfigError
from dist_ens.models.hf.safetensors_file import Entry, numpy_dtype, read_header

PREFIX = 'hf:'
INDEX = 'model.safetensors.index.json'
SINGLE = 'model.safetensors'
# What a hub download needs (tokenizer.json: data.name='text:PATH' tokenises with it); a
# repository's other files (PyTorch .bin copies, other tokenizer data, images) stay there.
HUB_FILES = ['config.json', '*.safetensors', INDEX, 'tokenizer.json']


def is_hf(source: str) -> bool:
  """Whether config.model.init_from names a Hugging Face checkpoint ('hf:PATH')."""
  return isinstance(source, str) and source.startswith(PREFIX)


def locate(source: str | os.PathLike, where: str = 'hf') -> Path:
  """The folder of 'hf:PATH' (or PATH): a local folder with config.json, else a hub id
  downloaded (or found in huggingface_hub's cache).

  Raises:
    ConfigError: (one line, starting with `where`) nothing found by that name.
  """
  name = os.fspath(source)
  name = name[len(PREFIX):] if name.startswith(PREFIX) else name
  path = Path(name).expanduser()
  if path.is_dir():
    if not (path / 'config.json').is_file():
      raise ConfigError(f'{where}: {name} has no config.json; give the folder that '
                        "transformers' save_pretrained wrote.")
    return path
  if path.exists() or name.startswith(('/', '.', '~')) or name.count('/') != 1:
    raise ConfigError(f"{where}: {name} is not a folder with config.json, nor a hub id "
                      "('org/name').")
  return _from_hub(name, where)


def _from_hub(repo_id: str, where: str) -> Path:
  try:
    import huggingface_hub  # pylint: disable=import-outside-toplevel  # optional extra
  except ImportError:
    raise ConfigError(f'{where}: {repo_id!r} is no local folder; a hub id needs '
                      'huggingface_hub (pip install dist_ens[hf]), or give a folder.') from None
  try:
    return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_FILES))
  except Exception:  # pylint: disable=broad-except  # offline, unknown or gated: try the cache
    pass
  try:
    return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_FILES,
                                                  local_files_only=True))
  except Exception as e:  # pylint: disable=broad-except  # one line whatever the cause
    raise ConfigError(f'{where}: hub id {repo_id!r} could not be downloaded and is not in '
                      f'the local cache ({type(e).__name__}); give a local folder.') from None


def read_config(folder: Path, where: str = 'hf') -> dict[str, Any]:
  try:
    return json.loads((folder / 'config.json').read_text())
  except (OSError, ValueError) as e:
    raise ConfigError(f'{where}: {folder / "config.json"} cannot be read: {e}') from None


class Tensors:
  """The tensors of a checkpoint folder (one safetensors file or a sharded index), by
  name; only headers are read until a tensor (or a slice of one) is asked for."""

  def __init__(self, entries: dict[str, Entry], where: str = 'hf'):
    self._entries = entries
    self._maps: dict[Path, tuple[mmap.mmap, np.ndarray]] = {}
    self._where = where

  @classmethod
  def open(cls, folder: Path, where: str = 'hf') -> 'Tensors':
    """model.safetensors.index.json's shards, else model.safetensors, else the folder's
    one .safetensors file.

    Raises:
      ConfigError: no safetensors weights in the folder, or a file that does not read
        or is cut short (naming the file and the tensor: safetensors_file.read_header).
    """
    if (folder / INDEX).is_file():
      try:
        files = sorted(set(json.loads((folder / INDEX).read_text())['weight_map'].values()))
      except Exception as e:  # pylint: disable=broad-except  # a torn or foreign index: one line
        raise ConfigError(f'{where}: {folder / INDEX} cannot be read: {type(e).__name__}: '
                          f'{str(e)[:200]}') from None
      entries = {}
      for file in files:
        entries.update(read_header(folder / file, where))
      return cls(entries, where)
    files = [folder / SINGLE] if (folder / SINGLE).is_file() else sorted(
        folder.glob('*.safetensors'))
    if len(files) != 1:
      raise ConfigError(f'{where}: {folder} has {len(files)} .safetensors files and no '
                        f'{INDEX}; save the model with save_pretrained (safetensors).')
    return cls(read_header(files[0], where), where)

  def __contains__(self, name: str) -> bool:
    return name in self._entries

  def __iter__(self) -> Iterator[str]:
    return iter(self._entries)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._entries[name].shape

  def view(self, name: str) -> np.ndarray:
    """The tensor as a read-only view of the mapped file (nothing read yet)."""
    entry = self._entries[name]
    dtype = numpy_dtype(entry, name, self._where)
    if entry.file not in self._maps:
      with open(entry.file, 'rb') as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
      self._maps[entry.file] = (mapped, np.frombuffer(mapped, np.uint8))
    return self._maps[entry.file][1][entry.begin:entry.end].view(dtype).reshape(entry.shape)

  def read(self, name: str, index: Any = (), convert: Any = None) -> np.ndarray:
    """view(name) (through `convert`, a function of views) [index], copied into memory
    in native byte order; the file's pages are then given back, so a process that reads
    slice after slice holds no more of the file than the slice it is copying."""
    view = self.view(name)
    part = (view if convert is None else convert(view))[index]
    out = np.array(part, dtype=part.dtype.newbyteorder('='))
    self._maps[self._entries[name].file][0].madvise(mmap.MADV_DONTNEED)
    return out
