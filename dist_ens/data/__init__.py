"""Data: sources by name (embedded or TFDS) and the batch pipeline that feeds the mesh."""

import dataclasses

import numpy as np

from dist_ens.data.pipeline import (MEMBER_ORDERS, Batches, BatchIterator, IteratorState, Order,
                                    host_block, host_rows, local_indices, to_global)
from dist_ens.data.member_split import MemberSplits, make_member_splits
from dist_ens.data.sources import SOURCES, Dataset, Source, Split, Subset
from dist_ens.data.spec import TEXT_FIELDS, DataSpec
from dist_ens.data import uci
from dist_ens.data.text import is_text, load_text
from dist_ens.data.tfds_source import is_token_ids, load_tfds, preprocess
from dist_ens import importing
from dist_ens.errors import ConfigError


def from_arrays(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
                y_test: np.ndarray, *, name: str = 'arrays',
                num_classes: int | None = None, pad_id: int | None = None) -> Dataset:
  """A Dataset held in memory, e.g. for `dist_ens.train(..., dataset=...)` or returned by
  the function config.data.name names ('my_pkg.data:load').

  Inputs keep their shape [N, ...] (add a trailing channel axis yourself for the
  built-in CNNs); signed integer inputs are token ids and stay int32, others become
  float32; integer labels are classes in [0, num_classes); float targets
  (regression, config.task='regression') stay float32, never cast to integers, and
  the dataset then has num_classes=0. Integer targets may have more axes than one
  ([N, T]: config.task='token_classification'); with `pad_id`, targets equal to it
  are padding, exempt from the class check (that task's padding id is -1).

  Example:
    >>> ds = from_arrays(np.zeros((8, 3)), np.arange(8) % 2, np.zeros((4, 3)), np.arange(4) % 2)
    >>> ds.num_classes, ds.input_shape
    (2, (3,))

  Raises:
    ConfigError: for shapes that do not match or labels outside [0, num_classes).
  """
  as_inputs = lambda x: np.asarray(x, np.int32 if is_token_ids(x) else np.float32)
  x_train, x_test = as_inputs(x_train), as_inputs(x_test)
  y_train, y_test = np.asarray(y_train), np.asarray(y_test)
  _check_fit(name, x_train, y_train, x_test, y_test)
  if np.issubdtype(y_train.dtype, np.floating) or np.issubdtype(y_test.dtype, np.floating):
    return Dataset(name, Split(x_train, y_train.astype(np.float32)),
                   Split(x_test, y_test.astype(np.float32)), 0, tuple(x_train.shape[1:]))
  if num_classes is None:
    num_classes = int(max(y_train.max(initial=0), y_test.max(initial=0))) + 1
  train, test = Split(x_train, y_train.astype(np.int32)), Split(x_test, y_test.astype(np.int32))
  for split_name, split in (('train', train), ('test', test)):
    y = split.y if pad_id is None else split.y[split.y != pad_id]
    check_label_values(y, num_classes, f'dataset {name!r} ({split_name})')
  return Dataset(name, train, test, num_classes, tuple(x_train.shape[1:]))


def _check_fit(name, x_train, y_train, x_test, y_test) -> None:
  if x_train.shape[1:] != x_test.shape[1:] or len(x_train) != len(y_train) or len(
      x_test) != len(y_test):
    raise ConfigError(f'dataset {name!r}: x_train {x_train.shape}, y_train {y_train.shape}, '
                      f'x_test {x_test.shape}, y_test {y_test.shape} do not fit together '
                      '(same input shape, one label per example).')


def check_label_values(y: np.ndarray, num_classes: int, what: str) -> None:
  """Raises ConfigError if a label in `y` is not an integer in [0, num_classes)."""
  y = np.asarray(y)
  if not np.issubdtype(y.dtype, np.integer):
    raise ConfigError(f'{what}: labels must be integer classes, got dtype {y.dtype}.')
  bad = (y < 0) | (y >= num_classes)
  if bad.any():
    raise ConfigError(f'{what}: {int(bad.sum())} labels lie outside [0, {num_classes}) '
                      f'(e.g. {int(y[bad][0])}); labels must be class indices 0..{num_classes - 1}.')


def check_finite_inputs(x: np.ndarray, what: str) -> None:
  """Raises ConfigError naming the first row of `x` that holds a NaN or an infinity (a
  float input that would train to the end and only then report every member non-finite)."""
  x = np.asarray(x)
  if not np.issubdtype(x.dtype, np.floating) or not len(x):
    return
  rows = x.reshape(len(x), -1)
  bad = np.concatenate([~np.isfinite(rows[i:i + 4096]).all(axis=1)  # Chunks: a bool per row.
                        for i in range(0, len(rows), 4096)])
  if bad.any():
    first = int(np.flatnonzero(bad)[0])
    raise ConfigError(f'{what}: input row {first} holds NaN or Inf ({int(bad.sum())} of '
                      f'{len(x)} rows do); remove or replace them, the members cannot train on '
                      'them.')


def _load_user_dataset(name: str, spec: DataSpec) -> Dataset:
  """The dataset the function at import path `name` returns, called with the DataSpec
  (or without arguments): a Dataset, or the four arrays (x_train, y_train, x_test, y_test)."""
  load = importing.load_object(name, 'config.data.name')
  try:
    out = load(spec)
  except TypeError:
    out = load()
  if isinstance(out, Dataset):
    return out
  if isinstance(out, (tuple, list)) and len(out) == 4:
    return from_arrays(*out, name=name)
  raise ConfigError(f'config.data.name={name!r} returned a {type(out).__name__}; return a '
                    'dist_ens.data.Dataset or (x_train, y_train, x_test, y_test).')


def load_dataset(name: str, spec: DataSpec | None = None) -> Dataset:
  """The dataset `name`: an embedded one (see SOURCES), a UCI regression set
  ('uci:energy' for a shipped one, 'uci:PATH' for a file in that format; split 0 of
  dist_ens.data.uci, in original units), tokenised text ('text:PATH', dist_ens.data.text),
  your own by import path ('my_pkg.data:load',
  see from_arrays), or else a TFDS dataset read from spec.data_dir. Preprocessing
  (spec.mean / std) applies to embedded and your own; `spec` defaults to DataSpec(name)."""
  spec = dataclasses.replace(spec, name=name) if spec is not None else DataSpec(name)
  if is_text(name):
    return load_text(name, spec)
  if name.startswith('uci:'):  # Original units; the regression task standardises.
    train, test = uci.load_uci(name)
    return Dataset(name, train, test, 0, tuple(train.x.shape[1:]))
  if name in SOURCES or importing.is_import_path(name):
    dataset = SOURCES[name]() if name in SOURCES else _load_user_dataset(name, spec)
    if spec.mean or spec.std:
      norm = lambda s: Split(preprocess(s.x, spec), s.y)
      dataset = dataset._replace(train=norm(dataset.train), test=norm(dataset.test))
    return dataset
  if '/' in name or not name.replace('_', '').replace(':', '').replace('.', '').isalnum():
    raise ConfigError(f'config.data.name={name!r} is not a known dataset; use one of '
                      f'{sorted(SOURCES)} or a TFDS dataset name such as \'mnist\'.')
  return load_tfds(spec)


def split_validation(source: Source, size: int) -> tuple[Source, Split]:
  """(train, validation): the last `size` examples of a fixed shuffle are validation.

  The shuffle's seed is fixed (not config.seed), so runs with different seeds are
  selected on the same validation examples; the test split is never touched. The
  validation examples are read into memory; train stays a (lazy) source.
  """
  n = source.num_examples
  if not 0 < size < n:
    raise ConfigError(f'config.data.validation_size={size} must be in (0, {n}), the number '
                      'of training examples.')
  order = np.random.default_rng(0).permutation(n)
  train, val = np.sort(order[:-size]), np.sort(order[-size:])
  return Subset(source, train), Split(*source.read(val))


__all__ = ['is_token_ids', 'MemberSplits', 'make_member_splits', 'Batches', 'BatchIterator', 'DataSpec', 'Dataset', 'check_finite_inputs', 'from_arrays', 'IteratorState', 'MEMBER_ORDERS', 'Order',
           'SOURCES', 'TEXT_FIELDS', 'is_text', 'load_text', 'Source', 'Split', 'Subset', 'host_block', 'host_rows',
           'load_dataset', 'local_indices', 'preprocess', 'split_validation', 'to_global']
