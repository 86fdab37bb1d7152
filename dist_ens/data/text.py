"""Tokenised text as a data set: config.data.name='text:PATH'.

PATH is a folder with a train and a test split, one file each, in either format:
  train.jsonl, test.jsonl  one JSON object a line: 'input_ids' (a list of token ids) or
                           'text' (a string, tokenised by a Hugging Face `tokenizers`
                           tokenizer.json), and 'label' (an int) for labelled targets;
  train.npz, test.npz      'input_ids' [N, T] ints, 'lengths' [N] (row i's sequence is
                           its first lengths[i] ids; absent: all T), 'label' [N].
The names are the ones Hugging Face datasets use, so `dataset.to_json('train.jsonl')`
writes a split this reads.

Every sequence is cut or padded to config.data.text_length ids (0: the longest training
sequence) with the input padding id config.data.pad_id (-1: the checkpoint's
pad_token_id, config.model.init_from='hf:PATH', else the tokenizer's padding id, else
0); an encoder built from a checkpoint masks that id out of attention (models/hf/bert.py).
config.data.text_targets says what the members learn:
  'label'       y [N] ints, each sequence's 'label' (sequence classification);
  'next_token'  y [N, L], position i's target the id at i + 1, and token_classification's
                padding id (-1) where there is none, so padding is never scored.
The tokenizer: config.data.tokenizer (a tokenizer.json or a folder holding one), else
the one beside the checkpoint, else PATH/tokenizer.json; read only for 'text' lines.
For next-token prediction the classes are the checkpoint's vocab_size, else the
tokenizer's, else the largest id + 1.
"""

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from dist_ens.data.sources import Dataset, Split
from dist_ens.data.spec import DataSpec
from dist_ens.errors import ConfigError

PREFIX = 'text:'
TARGETS = ('label', 'next_token')
FORMATS = ('.jsonl', '.npz')
TOKENIZER = 'tokenizer.json'
NEXT_TOKEN_PAD = -1  # tasks/token_classification.PAD_ID: targets never scored


def _hf() -> Any:
  """dist_ens.models.hf.checkpoint, imported when a text set names a checkpoint: importing
  it runs dist_ens.models' __init__ (every model), which a process that only reads data,
  a grain worker unpickling this package's HostReader, has no use for."""
  from dist_ens.models.hf import checkpoint  # pylint: disable=g-import-not-at-top
  return checkpoint


class Sequences(NamedTuple):
  """One split as read: each sequence's ids (ragged) and labels (None: the file has none)."""
  ids: list[np.ndarray]
  labels: np.ndarray | None


def is_text(name: str) -> bool:
  return isinstance(name, str) and name.startswith(PREFIX)


def split_file(folder: Path, split: str, where: str) -> Path:
  """The one file of `split` in `folder` (FORMATS), or a one-line refusal."""
  found = [folder / f'{split}{s}' for s in FORMATS if (folder / f'{split}{s}').exists()]
  if len(found) != 1:
    names = ' or '.join(f'{split}{suffix}' for suffix in FORMATS)
    what = 'holds both' if found else 'has neither'
    raise ConfigError(f'{where}: {folder} {what} {names}; it needs exactly one (docs/data.md).')
  return found[0]


def _input_ids(value: Any, where: str) -> np.ndarray:
  ids = np.asarray(value)
  if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
    raise ConfigError(f"{where}: 'input_ids' must be a list of integer token ids, got "
                      f"{value!r:.60}.")
  if (ids < 0).any():
    raise ConfigError(f"{where}: 'input_ids' holds a negative token id ({int(ids.min())}).")
  return ids.astype(np.int64)


def read_jsonl(path: Path, tokenizer) -> Sequences:
  """A .jsonl split's sequences; 'text' lines go through `tokenizer()` (read once asked)."""
  ids, labels, texts = [], [], {}
  for n, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    where = f'{path}, line {n}'
    try:
      row = json.loads(line)
    except ValueError:
      row = None
    if not isinstance(row, dict):
      raise ConfigError(f"{where}: not a JSON object; each line is one, e.g. "
                        '{"input_ids": [2, 14, 7], "label": 1}.')
    if 'input_ids' in row:
      ids.append(_input_ids(row['input_ids'], where))
    elif isinstance(row.get('text'), str):
      texts[len(ids)] = row['text']
      ids.append(None)
    else:
      raise ConfigError(f"{where}: has neither 'input_ids' (a list of token ids) nor 'text' "
                        '(a string); one of them is needed.')
    labels.append(row.get('label'))
  if texts:
    for i, encoded in zip(texts, tokenizer(path).encode_batch(list(texts.values()))):
      ids[i] = np.asarray(encoded.ids, np.int64)
  return Sequences(ids, _labels(labels, path))


def _labels(labels: list[Any], path: Path) -> np.ndarray | None:
  if all(label is None for label in labels):
    return None
  for n, label in enumerate(labels):
    if not isinstance(label, int) or isinstance(label, bool) or label < 0:
      raise ConfigError(f"{path}: sequence {n}'s 'label' is {label!r}; every sequence needs "
                        'an integer label >= 0 (its class).')
  return np.asarray(labels, np.int32)


def read_npz(path: Path) -> Sequences:
  """A .npz split's sequences: 'input_ids' [N, T], optional 'lengths' [N] and 'label' [N]."""
  with np.load(path) as f:
    arrays = {k: f[k] for k in f.files}
  if 'input_ids' not in arrays or arrays['input_ids'].ndim != 2:
    raise ConfigError(f"{path}: needs 'input_ids', token ids [N, T]; it holds "
                      f'{ {k: v.shape for k, v in arrays.items()} }.')
  table = arrays['input_ids']
  lengths = arrays.get('lengths', np.full(len(table), table.shape[1]))
  if lengths.shape != (len(table),) or (lengths < 0).any() or (lengths > table.shape[1]).any():
    raise ConfigError(f"{path}: 'lengths' must be [N] ints in [0, {table.shape[1]}] (N = "
                      f"{len(table)}, one per row of 'input_ids'), got shape {lengths.shape}.")
  ids = [_input_ids(row[:k], f'{path}, row {i}')
         for i, (row, k) in enumerate(zip(table, lengths))]
  label = arrays.get('label')
  return Sequences(ids, None if label is None else _labels(label.tolist(), path))


def pad(sequences: list[np.ndarray], length: int, pad_id: int,
        targets: str) -> tuple[np.ndarray, np.ndarray | None]:
  """(x [N, length] int32 padded with pad_id; for 'next_token' y [N, length], the next id
  at each position and NEXT_TOKEN_PAD past the sequence's end)."""
  x = np.full((len(sequences), length), pad_id, np.int32)
  y = (np.full((len(sequences), length), NEXT_TOKEN_PAD, np.int32)
       if targets == 'next_token' else None)
  for i, ids in enumerate(sequences):
    x[i, :min(len(ids), length)] = ids[:length]
    if y is not None:
      following = ids[1:length + 1]
      y[i, :len(following)] = following
  return x, y


class _Sources:
  """The checkpoint's config.json and the tokenizer, each read the first time it is asked for."""

  def __init__(self, spec: DataSpec, folder: Path, where: str):
    self.spec, self.folder, self.where = spec, folder, where
    self._checkpoint: dict[str, Any] | None = None
    self.tokenizer_padding: int | None = None
    self._tokenizer = None

  def checkpoint(self) -> dict[str, Any]:
    """config.json of config.model.init_from='hf:PATH' ({} without one)."""
    if self._checkpoint is None:
      where = f'config.model.init_from={self.spec.checkpoint!r}'
      hf = _hf()
      self._checkpoint = (hf.read_config(hf.locate(self.spec.checkpoint, where), where)
                          if self.spec.checkpoint else {})
    return self._checkpoint

  def _tokenizer_paths(self) -> list[Path]:
    if self.spec.tokenizer:
      given = Path(self.spec.tokenizer).expanduser()
      return [given / TOKENIZER if given.is_dir() else given]
    where = f'config.model.init_from={self.spec.checkpoint!r}'
    beside = ([_hf().locate(self.spec.checkpoint, where) / TOKENIZER]
              if self.spec.checkpoint else [])
    return beside + [self.folder / TOKENIZER]

  def tokenizer(self, asking: Path):
    """The tokenizer for `asking`'s 'text' lines, without its own padding or truncation."""
    if self._tokenizer is None:
      paths = self._tokenizer_paths()
      found = next((p for p in paths if p.is_file()), None)
      if found is None:
        raise ConfigError(f"{asking} has 'text' lines and there is no tokenizer at "
                          f"{' or '.join(map(str, paths))}; set config.data.tokenizer to a "
                          "tokenizer.json, or write 'input_ids' instead.")
      try:
        from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
      except ImportError:
        raise ConfigError(f"{asking} has 'text' lines, which need the tokenizers package: "
                          "pip install 'dist_ens[text]'.") from None
      try:
        self._tokenizer = Tokenizer.from_file(str(found))
      except Exception as e:  # pylint: disable=broad-except  # the Rust library's: one line
        detail = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ConfigError(f"{found} is not a tokenizer the tokenizers package reads ({detail}); "
                          'replace it with one that tokenizer.save() or save_pretrained() '
                          'wrote, or set config.data.tokenizer to one.') from None
      self.tokenizer_padding = (self._tokenizer.padding or {}).get('pad_id')
      self._tokenizer.no_padding()  # cut and padded here, to one length for all splits
      self._tokenizer.no_truncation()
    return self._tokenizer

  def pad_id(self) -> int:
    """config.data.pad_id, or (-1) the checkpoint's, the tokenizer's padding id, or 0."""
    if self.spec.pad_id >= 0:
      return self.spec.pad_id
    found = self.checkpoint().get('pad_token_id')
    found = self.tokenizer_padding if found is None else found
    return 0 if found is None else int(found)

  def vocab(self, splits: dict[str, Sequences]) -> int:
    """The classes of next-token prediction (the module doc)."""
    if 'vocab_size' in self.checkpoint():
      return int(self.checkpoint()['vocab_size'])
    if self._tokenizer is not None:
      return self._tokenizer.get_vocab_size()
    return 1 + max((int(ids.max()) for s in splits.values() for ids in s.ids if ids.size),
                   default=0)


def _check_spec(spec: DataSpec, where: str) -> None:
  length, targets, pad_id = spec.text_length, spec.text_targets, spec.pad_id
  if not isinstance(length, int) or isinstance(length, bool) or length < 0:
    raise ConfigError(f'config.data.text_length={length!r} must be an int >= 0 (0: the longest '
                      f'training sequence) for {where}.')
  if targets not in TARGETS:
    raise ConfigError(f'config.data.text_targets={targets!r} is not known; use one of {TARGETS} '
                      f'for {where}.')
  if not isinstance(pad_id, int) or isinstance(pad_id, bool) or pad_id < -1:
    raise ConfigError(f"config.data.pad_id={pad_id!r} must be a token id >= 0, or -1 (the "
                      f"checkpoint's or tokenizer's) for {where}.")


def _read(folder: Path, split: str, sources: _Sources, where: str) -> Sequences:
  """A split's sequences, refused in one line naming its file where that file does not
  read or holds none (else an empty train split surfaces as a batch too large for it)."""
  path = split_file(folder, split, where)
  try:
    read = read_jsonl(path, sources.tokenizer) if path.suffix == '.jsonl' else read_npz(path)
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # a torn .npz, bytes not UTF-8: one line
    detail = str(e).splitlines()[0][:200] if str(e) else ''
    raise ConfigError(f'{where}: {path} cannot be read: {type(e).__name__}: {detail}') from None
  if not read.ids:
    raise ConfigError(f'{where}: {path} holds no examples; the {split} split needs at '
                      'least one sequence.')
  return read


def _targets(splits: dict[str, Sequences], folder: Path) -> tuple[dict[str, np.ndarray], int]:
  """Each split's labels, and the classes: the largest label + 1."""
  for name, split in splits.items():
    if split.labels is None:
      raise ConfigError(f"config.data.text_targets='label': {folder}'s {name} split has no "
                        "'label'; add one per sequence, or set text_targets='next_token'.")
  labels = {name: split.labels for name, split in splits.items()}
  return labels, 1 + max(int(y.max(initial=0)) for y in labels.values())


def _check_vocab(splits: dict[str, Sequences], vocab: int | None, where: str) -> None:
  if vocab is None:
    return
  for name, split in splits.items():
    top = max((int(ids.max()) for ids in split.ids if ids.size), default=-1)
    if top >= vocab:
      raise ConfigError(f"{where}: the {name} split holds token id {top}, outside the "
                        f"checkpoint's vocab_size {vocab}; tokenise with the checkpoint's "
                        'tokenizer.')


def load_text(name: str, spec: DataSpec) -> Dataset:
  """The Dataset of config.data.name='text:PATH' (the module doc)."""
  where = f'config.data.name={name!r}'
  folder = Path(name[len(PREFIX):]).expanduser()
  if not folder.is_dir():
    raise ConfigError(f'{where}: {folder} is not a folder; it needs a train and a test split, '
                      f"train.jsonl or train.npz and test.jsonl or test.npz.")
  _check_spec(spec, where)
  sources = _Sources(spec, folder, where)
  splits = {split: _read(folder, split, sources, where) for split in ('train', 'test')}
  _check_vocab(splits, sources.checkpoint().get('vocab_size'), where)
  length = spec.text_length or max((len(ids) for ids in splits['train'].ids), default=1)
  pad_id = sources.pad_id()
  padded = {s: pad(seqs.ids, length, pad_id, spec.text_targets) for s, seqs in splits.items()}
  if spec.text_targets == 'label':
    labels, classes = _targets(splits, folder)
    made = {s: Split(padded[s][0], labels[s]) for s in padded}
  else:
    classes = sources.vocab(splits)
    made = {s: Split(*padded[s]) for s in padded}
  return Dataset(name, made['train'], made['test'], classes, (length,))
