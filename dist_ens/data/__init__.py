"""Data: sources by name and the batch pipeline that feeds the mesh."""

import numpy as np

from dist_ens.data.pipeline import BatchIterator, IteratorState, host_rows, to_global
from dist_ens.data.sources import SOURCES, Dataset, Split
from dist_ens.errors import ConfigError


def load_dataset(name: str) -> Dataset:
  """Loads the dataset that config.data.name names."""
  if name not in SOURCES:
    raise ConfigError(f'config.data.name={name!r} is not a known dataset; use one of {sorted(SOURCES)}.')
  return SOURCES[name]()


def split_validation(split: Split, size: int) -> tuple[Split, Split]:
  """(train, validation): the last `size` examples of a fixed shuffle are validation.

  The shuffle's seed is fixed (not config.seed), so runs with different seeds are
  selected on the same validation examples; the test split is never touched.
  """
  if not 0 < size < len(split.y):
    raise ConfigError(f'config.data.validation_size={size} must be in (0, {len(split.y)}), '
                      'the number of training examples.')
  order = np.random.default_rng(0).permutation(len(split.y))
  train, val = np.sort(order[:-size]), np.sort(order[-size:])
  return Split(split.x[train], split.y[train]), Split(split.x[val], split.y[val])


__all__ = ['BatchIterator', 'Dataset', 'IteratorState', 'SOURCES', 'Split', 'host_rows',
           'load_dataset', 'split_validation', 'to_global']
