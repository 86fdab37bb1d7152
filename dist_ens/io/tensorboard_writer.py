"""`TensorBoardWriter`: events as TensorBoard scalars and histograms (tensorboardX)."""

import os
import re
import time
from typing import Any

import numpy as np

from dist_ens.io.run_files import is_writer

_INVALID_TAG = re.compile(r'[^-/\w.]')


class TensorBoardWriter:
  """Writes events as TensorBoard scalars and histograms (tensorboardX; no TensorFlow).

  Tags, for an event of split S at step N:
    member_{i}/S/{name}   each member's value of every 'members' metric,
    ensemble/S/{name}     every 'ensemble' metric,
    members/S/{name}      a histogram of the M member values (non-finite ones left out),
    S/{name}              any other top-level number (e.g. member_examples_per_s).

  On resume from step N (keep_through_step=N), TensorBoard is told to drop what
  the interrupted run wrote after N (a purge event, as TensorFlow writes on
  restart), mirroring JsonlWriter; a fresh run (None) drops everything before it.

  Example:
    writer = TensorBoardWriter('/tmp/run/tensorboard')
    writer.write({'step': 10, 'split': 'test', 'members': {'nll': [0.9, 1.1]},
                  'ensemble': {'nll': 0.8}})
    writer.close()  # then: tensorboard --logdir /tmp/run/tensorboard
  """

  def __init__(self, logdir: str | os.PathLike, keep_through_step: int | None = None):
    self._writer = None
    if not is_writer():
      return
    # pylint: disable=g-import-not-at-top
    from tensorboardX import SummaryWriter
    from tensorboardX.proto.summary_pb2 import Summary
    self._summary = Summary
    purge_step = 0 if keep_through_step is None else keep_through_step + 1
    # tensorboardX names files by the second; a resume within the same second would
    # overwrite the previous file without a finer suffix.
    self._writer = SummaryWriter(str(logdir), purge_step=purge_step,
                                 filename_suffix=f'.{time.time_ns()}')

  def write(self, event: dict[str, Any]) -> None:
    if self._writer is None:
      return
    step, split = int(event['step']), event.get('split', 'train')
    # Every scalar of the event in one Summary, one record: add_scalar's record per value
    # took 39 ms for 2 metrics of 256 members (the loop waits for it at each log step).
    scalars: list[tuple[str, Any]] = []
    for name, values in event.get('members', {}).items():
      values = np.asarray(values, np.float64)
      if values.ndim != 1:
        continue
      scalars += [(f'member_{i}/{split}/{name}', value) for i, value in enumerate(values)]
      finite = values[np.isfinite(values)]
      if finite.size:
        self._writer.add_histogram(f'members/{split}/{name}', finite, step)
    scalars += [(f'ensemble/{split}/{name}', value)
                for name, value in event.get('ensemble', {}).items() if _is_number(value)]
    scalars += [(f'{split}/{name}', value) for name, value in event.items()
                if name not in ('step', 'split', 'members', 'ensemble') and _is_number(value)]
    if scalars:
      self._writer.file_writer.add_summary(self._summary(value=[
          self._summary.Value(tag=_tag(tag), simple_value=float(value))
          for tag, value in scalars]), step)
    # Events come every log_every steps; flushing each keeps TensorBoard live.
    self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()


def _tag(name: str) -> str:
  """The tag tensorboardX's add_scalar would write for `name` (its characters outside
  [-/\\w.] become '_', leading slashes go)."""
  return _INVALID_TAG.sub('_', name).lstrip('/')


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
