"""Checkpoints of the stacked train state, the step and the data position; resume; preemption.

Built on orbax-checkpoint's CheckpointManager: saves are asynchronous (the loop
blocks only for the device-to-host copy), atomic (a checkpoint becomes visible
only once fully written, so a kill -9 mid-save leaves the previous one intact),
sharded (each process writes its own shards), and restored straight into the
shardings of the current mesh, whatever mesh wrote them.
"""

import logging as logging_std
import time
from pathlib import Path
from typing import Any, NamedTuple

import orbax.checkpoint as ocp
from absl import logging

from dist_ens.data import IteratorState
from dist_ens.errors import ConfigError

# Fields that may change between a run and its resume without being asked for:
# they change how long or how verbosely a run goes, or the topology (restores
# reshard), not what is being trained.
ALWAYS_COMPATIBLE = ('train.steps', 'train.log_every', 'train.eval_every', 'train.sync_every',
                     'train.steps_per_call', 'checkpoint', 'eval', 'mesh')
# Fields that define what the checkpoint holds: never restorable across a change.
NEVER_COMPATIBLE = ('num_members', 'model', 'data.name')


class Restored(NamedTuple):
  step: int
  state: Any
  data_state: IteratorState


def _matches(field: str, patterns: tuple[str, ...]) -> bool:
  return any(field == p or field.startswith(p + '.') for p in patterns)


def check_compatible(differing: list[str], restore_incompatible: str) -> None:
  """Refuses a resume whose config differs in fields that were not explicitly allowed.

  Args:
    differing: dotted names of the fields in which the saved and new configs differ.
    restore_incompatible: config.checkpoint.restore_incompatible, a comma-separated
      list of fields (or prefixes such as 'optim') the user allows to differ.
  """
  allowed = tuple(p.strip() for p in restore_incompatible.split(',') if p.strip())
  never = [f for f in differing if _matches(f, NEVER_COMPATIBLE)]
  if never:
    raise ConfigError(
        f'the workdir holds a checkpoint of a different ensemble (differing fields: '
        f'{", ".join(never)}); these cannot change on resume; use a new --workdir.')
  refused = [f for f in differing if not _matches(f, ALWAYS_COMPATIBLE + allowed)]
  if refused:
    raise ConfigError(
        f'the workdir holds a run whose config differs in {", ".join(refused)}; to resume '
        f'with the new values anyway pass --config.checkpoint.restore_incompatible='
        f'{",".join(refused)}, or use a new --workdir.')


class Checkpointer:
  """Saves every `every` steps (and when forced), keeps the newest `keep`."""

  def __init__(self, directory: Path, every: int, keep: int):
    self._every = every
    self._manager = ocp.CheckpointManager(
        directory.absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                             create=True))
    self.blocking_seconds = 0.0  # Time the loop spent waiting on saves.

  def latest(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, data_state: IteratorState, force: bool = False) -> bool:
    """Starts an asynchronous save if `step` is due (or `force`); returns whether it did."""
    if not force and step % self._every:
      return False
    if step in self._manager.all_steps():
      return False
    start = time.perf_counter()
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave({'step': step, 'data': data_state._asdict()})), force=True)
    self.blocking_seconds += time.perf_counter() - start
    return True

  def restore(self, abstract_state: Any) -> Restored | None:
    """The newest checkpoint that restores cleanly, into `abstract_state`'s shardings.

    A checkpoint that fails to restore (corrupt or truncated files) is skipped with a
    warning and the one before it is tried.
    """
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except  # Any failure means "unusable".
        logging.warning('checkpoint at step %d cannot be restored (%s: %s); trying the one '
                        'before it.', step, type(e).__name__, str(e).splitlines()[0][:300])
        continue
      return Restored(step, restored.state, IteratorState(**restored.meta['data']))
    return None

  def wait(self) -> None:
    start = time.perf_counter()
    self._manager.wait_until_finished()
    self.blocking_seconds += time.perf_counter() - start

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


class _QuietOrbax(logging_std.Filter):
  """Drops orbax's per-save INFO chatter from absl's log; its warnings still show."""

  def filter(self, record: logging_std.LogRecord) -> bool:
    return record.levelno >= logging_std.WARNING or '/orbax/' not in record.pathname


logging_std.getLogger('absl').addFilter(_QuietOrbax())
