"""Any TFDS dataset prepared as ArrayRecord, read with random access and no TensorFlow.

`tfds.data_source` reads ArrayRecord files directly (images are decoded with PIL),
so reading needs tensorflow-datasets but not TensorFlow; only preparing a dataset
once does (see `prepare_command`).

For the common image set (a PNG Image feature and a ClassLabel, as TFDS prepares
MNIST, CIFAR and most others) this module also owns a shorter decode of the same
records (`_PngRecords`): the same serialized examples, the same PIL decoder on the
same compressed bytes, without TFDS's per-example Python around it. Any record it
does not recognise as a plain 8-bit PNG goes through TFDS's own decoding, so the
arrays are TFDS's bit for bit either way.
"""

import contextlib
import copy
import difflib
import logging as std_logging
import math
import struct
import zlib
from collections.abc import Iterator, Sequence
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
  x = x.astype(np.float32)  # A copy: scaled in place.
  x *= np.float32(scale)
  mean, std = tuple(spec.mean), tuple(spec.std)
  if mean or std:
    x = _standardize(x, np.asarray(mean or 0.0, np.float32), np.asarray(std or 1.0, np.float32))
  return x


def _standardize(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
  """(x - mean) / std for a float32 x of our own, in place where the statistics broadcast
  over each example: spread over an example's elements, numpy's loops run over thousands
  of them instead of the channel axis's 3 (a fifth of the time on CIFAR's images), each
  element getting the same two float32 operations, so the same bits."""
  try:
    whole = (x.ndim >= 2 and x.flags.c_contiguous
             and np.broadcast_shapes(mean.shape, std.shape, x.shape[1:]) == x.shape[1:])
  except ValueError:  # Statistics that do not broadcast: numpy says so below.
    whole = False
  if not whole:
    return (x - mean) / std
  rows = x.reshape(x.shape[0], math.prod(x.shape[1:]))  # A view of x.
  np.subtract(rows, np.broadcast_to(mean, x.shape[1:]).ravel(), out=rows)
  np.divide(rows, np.broadcast_to(std, x.shape[1:]).ravel(), out=rows)
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


_PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'
# 8-bit PNG colour types -> the PIL mode PIL opens them in (its rawmode too): greyscale,
# truecolour, truecolour with alpha. Others (palettes, 16-bit, grey with alpha) are
# left to TFDS.
_PNG_MODES = {0: 'L', 2: 'RGB', 6: 'RGBA'}


def _plain_png(png: bytes) -> tuple[int, int, str, bytes] | None:
  """(width, height, PIL mode, compressed pixel data) of a plain PNG, else None.

  Plain: the signature, an IHDR (8 bits a sample, a mode in _PNG_MODES, compression
  and filter method 0, not interlaced), one run of IDAT chunks, IEND, and no other
  chunk; every chunk's CRC correct. These are the PNGs TFDS and PIL write for an
  image array. Any other chunk (a palette, transparency, text PIL would parse) may
  change what PIL gives or raises, so those are not plain.
  """
  if not png.startswith(_PNG_SIGNATURE):
    return None
  unpack, size = struct.unpack_from, len(png)
  pos, header, data = 8, None, []
  while pos + 12 <= size:
    length, kind = unpack('>I4s', png, pos)
    end = pos + 8 + length
    if end + 4 > size or zlib.crc32(png[pos + 4:end]) != unpack('>I', png, end)[0]:
      return None
    if header is None:
      if kind != b'IHDR' or length != 13:
        return None
      width, height, depth, colour, compression, filtering, interlace = unpack(
          '>IIBBBBB', png, pos + 8)
      if depth != 8 or colour not in _PNG_MODES or compression or filtering or interlace:
        return None
      header = (width, height, _PNG_MODES[colour])
    elif kind == b'IDAT':
      data.append(png[pos + 8:end])
    elif kind == b'IEND':
      return (*header, b''.join(data)) if data else None
    else:
      return None
    pos = end + 4
  return None


def _png_pixels(png: bytes, channels: int) -> np.ndarray | None:
  """The array TFDS's Image feature decodes from `png` with PIL (uint8, [H, W, C]), for
  a plain PNG (see _plain_png); None for any other, or one PIL cannot decode whole.

  PIL's PNG plugin hands the IDAT data to its 'zip' decoder with the IHDR's mode as
  rawmode; Image.frombytes runs that decoder on the same bytes, and np.asarray (what
  TFDS calls) reads the image through tobytes(), as here. Greyscale gets `channels`
  copies on a last axis, as TFDS's _reshape_grayscale_image gives it.
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top  # tfds's own dependency.
  plain = _plain_png(png)
  if plain is None:
    return None
  width, height, mode, data = plain
  limit = Image.MAX_IMAGE_PIXELS  # Image.open warns or refuses above it: TFDS's path.
  if not width or not height or (limit is not None and width * height > limit):
    return None
  try:
    image = Image.frombytes(mode, (width, height), data, 'zip', mode)
  except (ValueError, OSError):  # Truncated or corrupt data: TFDS's path says what.
    return None
  if mode == 'L':
    pixels = np.frombuffer(image.tobytes(), np.uint8).reshape(height, width)
    return np.repeat(pixels[..., None], channels, axis=-1)
  return np.frombuffer(image.tobytes(), np.uint8).reshape(height, width, len(mode))


def _field(features: Any, key: str, kind: str) -> Any:
  """The value of tf.train.Example feature `key` if it holds exactly one, of `kind`
  ('bytes_list', 'int64_list'); else None."""
  if key not in features:
    return None
  feature = features[key]
  if feature.WhichOneof('kind') != kind:
    return None
  values = getattr(feature, kind).value
  return values[0] if len(values) == 1 else None


class _PngRecords:
  """(inputs, labels) of records whose input feature is a TFDS Image holding PNGs and
  whose label is a ClassLabel, decoded as TFDS decodes them but with less Python an
  example: the serialized tf.train.Example is parsed once, the label taken from it and
  the PNG decoded by PIL (_png_pixels); a record that is not a plain PNG and one label
  goes through TFDS's own deserialize_example_np, as `__getitems__` would.

  Features other than the input and label are neither decoded nor checked.
  """

  def __init__(self, data_source: Any, input_key: str, label_key: str, channels: int):
    self._source, self._input_key, self._label_key = data_source, input_key, label_key
    self._channels = channels

  @classmethod
  def for_source(cls, data_source: Any, input_key: str, label_key: str) -> '_PngRecords | None':
    """A decoder for `data_source` (a tfds.data_source), or None where TFDS would decode
    otherwise than this does: another file format or decoders, an input that is not a
    uint8 Image, a label that is not a ClassLabel, or TFDS decoding images with OpenCV
    (it does whenever cv2 is installed); and for an Image feature of JPEGs."""
    try:
      import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
      from tensorflow_datasets.core import decode  # pylint: disable=g-import-not-at-top
      from tensorflow_datasets.core.data_sources import array_record  # pylint: disable=g-import-not-at-top
      from tensorflow_datasets.core.features import image_feature  # pylint: disable=g-import-not-at-top
      from tensorflow_datasets.proto import tf_example_pb2  # pylint: disable=g-import-not-at-top,unused-import
      if not (isinstance(data_source, array_record.ArrayRecordDataSource)
              and data_source.decoders is None
              and data_source.deserialize_method
              == decode.DeserializeMethod.DESERIALIZE_AND_DECODE
              and image_feature.cv2 is None and image_feature.PIL_Image is not None):
        return None
      features = data_source.dataset_info.features
      image, label = features[input_key], features[label_key]
      if not (isinstance(features, tfds.features.FeaturesDict)
              and type(image) is tfds.features.Image  # pylint: disable=unidiomatic-typecheck
              and image.np_dtype == np.uint8 and len(image.shape) == 3
              and image.encoding_format != 'jpeg'  # Each record would go the long way.
              and isinstance(image.shape[-1], int)
              and type(label) is tfds.features.ClassLabel):  # pylint: disable=unidiomatic-typecheck
        return None
    except (ImportError, AttributeError, KeyError, TypeError):  # Another TFDS than 4.9's.
      return None
    return cls(data_source, input_key, label_key, image.shape[-1])

  def __call__(self, keys: Sequence[int]) -> tuple[list[np.ndarray], list[int]]:
    from tensorflow_datasets.proto import tf_example_pb2  # pylint: disable=g-import-not-at-top
    if not keys:
      return [], []
    records = self._source.data_source.__getitems__(keys)
    if len(records) != len(keys):  # What tfds's __getitems__ checks.
      raise IndexError(f'Requested {len(keys)} records but got {len(records)} records.')
    parse = tf_example_pb2.Example.FromString
    inputs, labels = [], []
    for record in records:
      features = parse(record).features.feature
      png = _field(features, self._input_key, 'bytes_list')
      label = _field(features, self._label_key, 'int64_list')
      pixels = None if png is None or label is None else _png_pixels(png, self._channels)
      if pixels is None:
        decoded = self._source.dataset_info.features.deserialize_example_np(record)
        pixels, label = decoded[self._input_key], decoded[self._label_key]
      inputs.append(pixels)
      labels.append(label)
    return inputs, labels


class TfdsSource:
  """Random access to one split of a prepared TFDS dataset, preprocessed."""

  def __init__(self, data_source: Any, input_key: str, label_key: str,
               spec: DataSpec, add_channel: bool, target: tuple[Any, tuple[int, ...]] = (
                   np.int32, ())):
    """`target`: (dtype, shape) of one label: int32 classes, or float32 regression
    targets of any shape (their feature has no num_classes)."""
    self._source, self._input_key, self._label_key = data_source, input_key, label_key
    self._spec, self._add_channel, self._target = spec, add_channel, target
    self._png = _PngRecords.for_source(data_source, input_key, label_key)

  @property
  def num_examples(self) -> int:
    return len(self._source)

  def tfds_decoding(self) -> 'TfdsSource':
    """This split with every record decoded by TFDS's own path: the same arrays at TFDS's
    cost, for comparisons (benchmarks/grain_pipeline.py, tests)."""
    clone = copy.copy(self)
    clone._png = None  # pylint: disable=protected-access
    return clone

  def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Sorted reads are sequential in the ArrayRecord files; put the order back after.
    order = np.argsort(indices, kind='stable')
    keys = np.asarray(indices)[order].tolist()
    if self._png is not None:
      inputs, labels = self._png(keys)
    else:
      records = self._source.__getitems__(keys)
      inputs = [r[self._input_key] for r in records]
      labels = [r[self._label_key] for r in records]
    x = np.empty((len(indices), *np.shape(inputs[0])), np.asarray(inputs[0]).dtype)
    y = np.empty((len(indices), *self._target[1]), self._target[0])
    x[order] = np.stack(inputs)
    y[order] = labels
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
