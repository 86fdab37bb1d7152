"""Any TFDS dataset prepared as ArrayRecord, read with random access and no TensorFlow.

`tfds.data_source` reads ArrayRecord files directly (images are decoded with PIL),
so reading needs tensorflow-datasets but not TensorFlow; only preparing a dataset
once does (see `prepare_command`).
"""

import contextlib
import difflib
import logging as std_logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from dist_ens.data.sources import SOURCES, Dataset, Split
from dist_ens.data.spec import DataSpec
from dist_ens.errors import ConfigError


def prepare_command(name: str, data_dir: str) -> str:
  """The one-off command that prepares `name` for dist_ens (needs TensorFlow, once)."""
  target = f' --data_dir={data_dir}' if data_dir else ''
  return (f'pip install tensorflow tensorflow-datasets && tfds build {name} '
          f'--file_format=array_record{target}')


def is_token_ids(x: np.ndarray) -> bool:
  """Signed integer inputs are token ids, kept as int32 (uint8 is image bytes)."""
  return np.issubdtype(np.asarray(x).dtype, np.signedinteger)


def preprocess(x: np.ndarray, spec: DataSpec) -> np.ndarray:
  """Raw inputs as a dataset stores them -> model inputs.

  Signed integer inputs are token ids: int32, untouched (a float32 id is exact only
  below 2^24, a bfloat16 one below 256). uint8 images are scaled to [0, 1]; then, if
  config.data.mean / std are set, each channel is standardised; inputs without a
  channel axis get one. The same function serves training, evaluation and inference.
  """
  if is_token_ids(x):
    return np.asarray(x).astype(np.int32, copy=False)
  scale = 1.0 / 255.0 if x.dtype == np.uint8 else 1.0
  x = x.astype(np.float32) * np.float32(scale)
  mean, std = tuple(spec.mean), tuple(spec.std)
  if mean or std:
    x = (x - np.asarray(mean or 0.0, np.float32)) / np.asarray(std or 1.0, np.float32)
  return x


def _close_embedded(name: str) -> str | None:
  """The embedded dataset `name` is most likely a misspelling of, if any."""
  close = difflib.get_close_matches(name, sorted(SOURCES), n=1, cutoff=0.75)
  return close[0] if close else None


@contextlib.contextmanager
def _quiet_tfds() -> Iterator[None]:
  """TFDS logs its lookups at INFO through absl (e.g. 'Failed to load dataset ... from
  files' before it tries its registry), which the console shows beside our own lines."""
  logger = std_logging.getLogger('absl')
  before = logger.level
  logger.setLevel(max(before, std_logging.WARNING))
  try:
    yield
  finally:
    logger.setLevel(before)


class TfdsSource:
  """Random access to one split of a prepared TFDS dataset, preprocessed."""

  def __init__(self, data_source: Any, input_key: str, label_key: str,
               spec: DataSpec, add_channel: bool, target: tuple[Any, tuple[int, ...]] = (
                   np.int32, ())):
    """`target`: (dtype, shape) of one label: int32 classes, or float32 regression
    targets of any shape (their feature has no num_classes)."""
    self._source, self._input_key, self._label_key = data_source, input_key, label_key
    self._spec, self._add_channel, self._target = spec, add_channel, target

  @property
  def num_examples(self) -> int:
    return len(self._source)

  def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Sorted reads are sequential in the ArrayRecord files; put the order back after.
    order = np.argsort(indices, kind='stable')
    records = self._source.__getitems__(np.asarray(indices)[order].tolist())
    x = np.empty((len(indices), *np.shape(records[0][self._input_key])),
                 np.asarray(records[0][self._input_key]).dtype)
    y = np.empty((len(indices), *self._target[1]), self._target[0])
    x[order] = np.stack([r[self._input_key] for r in records])
    y[order] = [r[self._label_key] for r in records]
    x = preprocess(x, self._spec)
    return (x[..., None] if self._add_channel else x), y


def load_tfds(spec: DataSpec) -> Dataset:
  """The dataset config.data.name from config.data.data_dir, or a ConfigError saying how
  to prepare it (or, for a misspelt embedded name, which one was meant)."""
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError:
    close = _close_embedded(spec.name)
    if close:
      raise ConfigError(f'config.data.name={spec.name!r} is not an embedded dataset; did you '
                        f"mean {close!r}? (Other names are TFDS datasets, which need "
                        "tensorflow-datasets: pip install 'dist_ens[tfds]'.)") from None
    raise ConfigError(
        f"config.data.name={spec.name!r} is a TFDS dataset, which needs "
        "tensorflow-datasets: pip install 'dist_ens[tfds]'.") from None
  name, data_dir = spec.name, spec.data_dir or None
  searched = data_dir or '~/tensorflow_datasets (TFDS_DATA_DIR)'
  how = (f'prepare it once with: {prepare_command(name, spec.data_dir)}, or pick an '
         "embedded dataset ('mnist1d', 'digits').")
  try:
    with _quiet_tfds():
      builder = tfds.builder(name, data_dir=data_dir)
      prepared = builder.is_prepared()
  except Exception as e:  # pylint: disable=broad-except  # DatasetNotFoundError and kin.
    del e
    prepared = False
  if not prepared:
    close = _close_embedded(name)
    if close and name.split(':')[0].split('/')[0] not in tfds.list_builders(
        with_community_datasets=False):
      raise ConfigError(f'config.data.name={name!r} is neither an embedded dataset nor a TFDS '
                        f'one prepared in data_dir {searched}; did you mean {close!r}?')
    raise ConfigError(f'config.data.name={name!r}: no prepared dataset {name!r} in data_dir '
                      f'{searched}; {how}')
  file_format = str(builder.info.file_format).lower()
  if 'array_record' not in file_format and 'parquet' not in file_format:
    raise ConfigError(f'config.data.name={name!r} in {searched} is prepared as {file_format}, '
                      f'which has no random access; {how}')
  input_key, label_key = builder.info.supervised_keys or ('image', 'label')
  features = builder.info.features
  # A ClassLabel has num_classes; a float Tensor feature is a regression target.
  num_classes = getattr(features[label_key], 'num_classes', None) or 0
  target = (np.int32, ()) if num_classes else (np.float32, tuple(features[label_key].shape))
  shape = tuple(features[input_key].shape)
  add_channel = len(shape) in (1, 2) and spec.add_channel
  input_shape = shape + (1,) if add_channel else shape

  def source(split):
    if split not in builder.info.splits:
      raise ConfigError(f'config.data: {name!r} has no split {split!r}; it has '
                        f'{sorted(builder.info.splits)}.')
    with _quiet_tfds():
      reader = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    return TfdsSource(reader, input_key, label_key, spec, add_channel, target)

  train = source(spec.train_split)
  test_source = source(spec.test_split)
  test = Split(*test_source.read(np.arange(test_source.num_examples)))
  return Dataset(name, train, test, num_classes, input_shape)
