"""Data: sources by name and the batch pipeline that feeds the mesh."""

from dist_ens.data.pipeline import BatchIterator, IteratorState, host_rows, to_global
from dist_ens.data.sources import SOURCES, Dataset, Split
from dist_ens.errors import ConfigError


def load_dataset(name: str) -> Dataset:
  """Loads the dataset that config.data.name names."""
  if name not in SOURCES:
    raise ConfigError(f'config.data.name={name!r} is not a known dataset; use one of {sorted(SOURCES)}.')
  return SOURCES[name]()


__all__ = ['BatchIterator', 'Dataset', 'IteratorState', 'SOURCES', 'Split', 'host_rows',
           'load_dataset', 'to_global']
