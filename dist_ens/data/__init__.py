"""Data: sources by name (embedded or TFDS) and the batch pipeline that feeds the mesh."""

import ml_collections
import numpy as np

from dist_ens.data.pipeline import (MEMBER_ORDERS, Batches, BatchIterator, IteratorState, Order,
                                    PipelineStats, host_block, host_rows, local_indices,
                                    to_global)
from dist_ens.data.sources import SOURCES, Dataset, Source, Split, Subset
from dist_ens.data.tfds_source import load_tfds, prepare_command, preprocess
from dist_ens.errors import ConfigError


def load_dataset(name: str, data_config: ml_collections.ConfigDict | None = None) -> Dataset:
  """The dataset `name`: an embedded one (see SOURCES) or else a TFDS dataset read from
  data_config.data_dir. Preprocessing (data_config.mean / std) applies to both."""
  data_config = data_config or ml_collections.ConfigDict({'name': name, 'data_dir': ''})
  if name in SOURCES:
    dataset = SOURCES[name]()
    if data_config.get('mean') or data_config.get('std'):
      norm = lambda s: Split(preprocess(s.x, data_config), s.y)
      dataset = dataset._replace(train=norm(dataset.train), test=norm(dataset.test))
    return dataset
  if '/' in name or not name.replace('_', '').replace(':', '').replace('.', '').isalnum():
    raise ConfigError(f'config.data.name={name!r} is not a known dataset; use one of '
                      f'{sorted(SOURCES)} or a TFDS dataset name such as \'mnist\'.')
  return load_tfds(data_config)


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


__all__ = ['Batches', 'BatchIterator', 'Dataset', 'IteratorState', 'MEMBER_ORDERS', 'Order',
           'PipelineStats', 'SOURCES', 'Source', 'Split', 'Subset', 'host_block', 'host_rows',
           'load_dataset', 'local_indices', 'prepare_command', 'preprocess', 'split_validation', 'to_global']
