"""config.data.loader='grain': grain's worker processes read and decode the host batches.

For TFDS datasets read from ArrayRecord files (images decoded with PIL), whose decoding
one thread cannot keep up with. Which examples an item holds stays dist_ens's own: the
stream grain reads is the positions 0, 1, 2, ... from the run's data position on, and
each position is read by pipeline.HostReader (the member order, its pools, this
process's block of the batch), the very function the thread pipeline calls. grain splits
the positions over its worker processes, each reads and decodes whole items, and hands
them back through shared memory in order. So the batches are the thread pipeline's bit
for bit, and the position a checkpoint saves is the pipeline's IteratorState, not grain's
iterator state: resuming starts a new stream at that position.
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


def is_tfds(source: Any) -> bool:
  """Whether `source` reads a TFDS dataset's files (alone or through a Subset: a
  validation split carved from it)."""
  while isinstance(source, Subset):
    source = source.source
  return isinstance(source, TfdsSource)


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


class _ReadAt:
  """Position t of the stream -> the item t items after `start` (in a worker process)."""

  def __init__(self, reader: Any, start: Any):
    self._reader, self._start = reader, start

  def __call__(self, position: int) -> tuple[np.ndarray, ...]:
    reader = self._reader
    return reader(reader.order.skip(self._start, int(position) * reader.steps))


class Reads(Iterator[tuple[np.ndarray, ...]]):
  """The items `reader` (a pipeline.HostReader) gives at `start` and after, in order,
  read and decoded by `workers` grain worker processes (0: default_workers())."""

  def __init__(self, reader: Any, start: Any, workers: int = 0):
    check_source(reader.source)
    grain = _grain()
    _let_grain_read_its_flags()
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
    return tuple(np.asarray(a) for a in next(self._iterator))

  def close(self) -> None:
    """Stops the worker processes."""
    self._iterator.close()
