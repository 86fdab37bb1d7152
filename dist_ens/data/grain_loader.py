"""config.data.loader='grain': grain's worker processes read and decode the host batches.

For TFDS datasets read from ArrayRecord files (images decoded with PIL), whose decoding
one thread cannot keep up with. Which examples an item holds stays dist_ens's own: the
stream grain reads is the positions 0, 1, 2, ... from the run's data position on, and
each position is read by pipeline.HostReader (the member order, its pools, this
process's block of the batch), the very function the thread pipeline calls. grain splits
the positions over its worker processes, each reads and decodes whole items, and hands
them back through shared memory in order; for a set of uint8 images they hand back the
decoded pixels and the main process scales them to float32 (_Pixels: the same arithmetic
on the same pixels, a quarter of the bytes through shared memory). So the batches are the
thread pipeline's bit for bit, and the position a checkpoint saves is the pipeline's
IteratorState, not grain's iterator state: resuming starts a new stream at that position.
"""

import functools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from absl import flags

from dist_ens.data.sources import SOURCES, Subset
from dist_ens.data.tfds_source import TfdsSource
from dist_ens.errors import ConfigError

LOADERS = ('threads', 'grain')
FIELD = 'config.data.loader'
# The positions grain may read: more items than any run takes.
_ENDLESS = 2 ** 40
_INSTALL = "pip install 'dist_ens[grain]'"


def _grain() -> Any:
  """The grain module, or a ConfigError saying how to install it."""
  try:
    import grain  # pylint: disable=g-import-not-at-top  # An optional dependency.
  except ImportError:
    raise ConfigError(f"{FIELD}='grain' needs grain, which is not installed: {_INSTALL} "
                      "(or use data.loader='threads').") from None
  return grain


def _tfds_of(source: Any) -> Any:
  """The source under `source`'s Subsets (itself if none)."""
  while isinstance(source, Subset):
    source = source.source
  return source


def is_tfds(source: Any) -> bool:
  """Whether `source` reads a TFDS dataset's files (alone or through a Subset: a
  validation split carved from it)."""
  return isinstance(_tfds_of(source), TfdsSource)


def _with_tfds(source: Any, tfds: Any) -> Any:
  """`source` with the TfdsSource under its Subsets replaced by `tfds`."""
  if isinstance(source, Subset):
    return source._replace(source=_with_tfds(source.source, tfds))
  return tfds


def check_config(loader: str, name: str, resident: Any) -> None:
  """What config.data.loader='grain' needs of the rest of config.data, before anything
  runs: grain installed, a data set that is read from files, the host pipeline.

  Raises:
    ConfigError: naming the field and what would work.
  """
  if loader != 'grain':
    return
  _grain()
  if name in SOURCES or name.startswith(('uci:', 'text:')):
    raise ConfigError(f"{FIELD}='grain' reads TFDS datasets (ArrayRecord files) in worker "
                      f'processes; config.data.name={name!r} is held in memory: use '
                      "data.loader='threads'.")
  if resident is True:
    raise ConfigError(f"{FIELD}='grain' reads every batch on the host; config.data.resident="
                      "True reads none (the split is on the devices): use data.resident="
                      "'auto' or False with it, or data.loader='threads'.")


def check_source(source: Any) -> None:
  """Raises ConfigError unless grain can read `source` (a TFDS one)."""
  if not is_tfds(source):
    raise ConfigError(f"{FIELD}='grain' reads TFDS datasets (ArrayRecord files) in worker "
                      f'processes; this training split is a {type(source).__name__} (held '
                      "in memory or read by your own code): use data.loader='threads'.")


def default_workers() -> int:
  """One worker per CPU core this process may run on."""
  return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1


def _let_grain_read_its_flags() -> None:
  """grain reads its absl flags (--grain_*) when an iterator starts; in a program that is
  not an absl app (a notebook, a test, dist_ens.train from Python) they are unparsed and
  that read raises UnparsedFlagAccessError: there they take their defaults."""
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def _exit_with(parent: int, worker: int, workers: int) -> None:
  """In each worker: exit when the process that started it is gone. grain stops its
  workers when the iterator is closed, but a parent killed outright (kill -9, the
  out-of-memory killer) closes nothing, and its workers would wait on forever."""
  del worker, workers

  def watch():
    while os.getppid() == parent:
      time.sleep(1.0)
    os._exit(1)  # pylint: disable=protected-access

  threading.Thread(target=watch, daemon=True).start()


class _Pixels:
  """A TfdsSource of uint8 images as grain's workers read it: `read` gives the decoded
  pixels (TfdsSource.read_stored), a quarter of float32's bytes through shared memory,
  and the main process `finish`es each item's inputs to what TfdsSource.read gives: the
  same float32 arithmetic (tfds_source.preprocess) on the same pixels, bit for bit."""

  def __init__(self, source: TfdsSource):
    self.source = source

  @property
  def num_examples(self) -> int:
    return self.source.num_examples

  def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return self.source.read_stored(indices)

  def finish(self, item: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    return (self.source.finish(item[0]), *item[1:])

  @classmethod
  def for_reader(cls, reader: Any) -> '_Pixels | None':
    """The pixels of `reader`'s TfdsSource if it stores uint8 images and nothing is done
    to them after TfdsSource.read (no member_scale); else None: workers give the float32
    batches."""
    tfds = _tfds_of(reader.source)
    if reader.member_scale is not None or tfds.read_stored(np.arange(1))[0].dtype != np.uint8:
      return None
    return cls(tfds)


class _ReadAt:
  """Position t of the stream -> the item t items after `start` (in a worker process)."""

  def __init__(self, reader: Any, start: Any):
    self._reader, self._start = reader, start

  def __call__(self, position: int) -> tuple[np.ndarray, ...]:
    reader = self._reader
    return reader(reader.order.skip(self._start, int(position) * reader.steps))


class Reads(Iterator[tuple[np.ndarray, ...]]):
  """The items `reader` (a pipeline.HostReader) gives at `start` and after, in order,
  read and decoded by `workers` grain worker processes (0: default_workers()).

  `pixels`: for uint8 images, the workers give the pixels and this process scales them
  (_Pixels); False: the workers give the float32 inputs (as before; for comparisons).
  """

  def __init__(self, reader: Any, start: Any, workers: int = 0, pixels: bool = True):
    check_source(reader.source)
    grain = _grain()
    _let_grain_read_its_flags()
    self._pixels = _Pixels.for_reader(reader) if pixels else None
    if self._pixels is not None:
      reader = reader._replace(source=_with_tfds(reader.source, self._pixels))
    # num_threads=0: each worker reads its items one at a time, its process is the unit
    # of parallelism; per_worker_buffer_size=1: an item can be large (M members' batches).
    dataset = (grain.MapDataset.range(_ENDLESS).map(_ReadAt(reader, start))
               .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
               .mp_prefetch(grain.MultiprocessingOptions(
                   num_workers=workers or default_workers(), per_worker_buffer_size=1),
                            worker_init_fn=functools.partial(_exit_with, os.getpid())))
    self._iterator = iter(dataset)

  def __next__(self) -> tuple[np.ndarray, ...]:
    # Views of grain's shared-memory arrays, which they keep alive.
    item = tuple(np.asarray(a) for a in next(self._iterator))
    return item if self._pixels is None else self._pixels.finish(item)

  def close(self) -> None:
    """Stops the worker processes."""
    self._iterator.close()
