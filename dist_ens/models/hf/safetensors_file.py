"""A safetensors file's header, read and checked against the file without reading a tensor.

  entries = read_header(Path('model.safetensors'), where)   # {name: Entry}

The layout: an 8-byte little-endian header size, a JSON header of
{name: {dtype, shape, data_offsets}} (offsets relative to the data after the header),
then the raw little-endian bytes. A file cut short (a download stopped mid-way) or a
header that does not describe its bytes is refused here, in one line naming the file
and the tensor, before any reader reshapes bytes that are not there (which numpy
reports as a bare `cannot reshape array of size 0`). Both readers use it: io/pretrained.py
(a .safetensors file for config.model.init_from) and models/hf/checkpoint.py (a Hugging
Face folder's weights, mapped lazily).
"""

import json
import math
import struct
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np

from dist_ens.errors import ConfigError

DTYPES = {
    'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16,
    'F8_E4M3': ml_dtypes.float8_e4m3fn, 'F8_E5M2': ml_dtypes.float8_e5m2,
    'I64': np.int64, 'I32': np.int32, 'I16': np.int16, 'I8': np.int8,
    'U64': np.uint64, 'U32': np.uint32, 'U16': np.uint16, 'U8': np.uint8, 'BOOL': np.bool_}
_AGAIN = 'download or save it again'


class Entry(NamedTuple):
  """One tensor of one file: its dtype name, shape and byte range (from the file's start)."""
  file: Path
  dtype: str
  shape: tuple[int, ...]
  begin: int
  end: int


def numpy_dtype(entry: Entry, name: str, where: str) -> np.dtype:
  """The tensor's dtype, little-endian as stored; a dtype not in DTYPES refused."""
  if entry.dtype not in DTYPES:
    raise ConfigError(f'{where}: {entry.file}: tensor {name!r} has dtype {entry.dtype}, which '
                      f'dist_ens does not read ({", ".join(DTYPES)}).')
  return np.dtype(DTYPES[entry.dtype]).newbyteorder('<')


def read_header(file: Path, where: str) -> dict[str, Entry]:
  """Every tensor's Entry, each checked to lie within the file and to span its shape's
  bytes (where its dtype is known: a tensor of another dtype is refused when read).

  Raises:
    ConfigError: (one line, starting with `where`, naming the file and, where one is at
      fault, the tensor) a file that cannot be opened, is cut short, or whose header is
      not safetensors'.
  """
  try:
    size = file.stat().st_size
    with open(file, 'rb') as f:
      head = f.read(8)
      if len(head) < 8:
        raise ConfigError(f'{where}: {file} holds {size} bytes, too few for a safetensors '
                          f'header; {_AGAIN}.')
      (length,) = struct.unpack('<Q', head)
      if 8 + length > size:
        raise ConfigError(f'{where}: {file} is cut short: it holds {size} bytes, but its '
                          f'header alone needs {8 + length}; {_AGAIN}.')
      raw = f.read(length)
  except OSError as e:
    raise ConfigError(f'{where}: {file} cannot be read: {e.strerror or e}.') from None
  try:
    header = json.loads(raw)
  except ValueError as e:
    raise ConfigError(f'{where}: {file} is not a safetensors file (its header is not JSON: '
                      f'{e}).') from None
  if not isinstance(header, dict):
    raise ConfigError(f'{where}: {file} is not a safetensors file (its header is not a JSON '
                      'object).')
  start = 8 + length
  return {name: _entry(file, name, fields, start, size, where)
          for name, fields in header.items() if name != '__metadata__'}


def _entry(file: Path, name: str, fields: object, start: int, size: int, where: str) -> Entry:
  try:
    dtype, shape, (begin, end) = fields['dtype'], tuple(fields['shape']), fields['data_offsets']
    valid = (isinstance(dtype, str) and all(isinstance(n, int) and n >= 0 for n in shape)
             and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end)
  except (TypeError, KeyError, ValueError):
    valid = False
  if not valid:
    raise ConfigError(f'{where}: {file}: tensor {name!r} has a header entry {fields!r:.120} '
                      'that is not {dtype, shape, data_offsets: [begin, end]}.')
  if start + end > size:
    raise ConfigError(f'{where}: {file} is cut short: tensor {name!r} ({dtype} {list(shape)}) '
                      f'ends at byte {start + end} by the header, but the file holds {size} '
                      f'bytes; {_AGAIN}.')
  if dtype in DTYPES:
    needed = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
    if end - begin != needed:
      raise ConfigError(f'{where}: {file}: tensor {name!r} ({dtype} {list(shape)}) needs '
                        f'{needed} bytes, but the header gives it {end - begin}; {_AGAIN}.')
  return Entry(file, dtype, shape, start + begin, start + end)
