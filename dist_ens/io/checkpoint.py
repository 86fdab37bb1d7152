"""Checkpoints of the stacked train state, the step and the data position; resume; preemption.

Built on orbax-checkpoint's CheckpointManager: saves are asynchronous (the loop
blocks only for the device-to-host copy), atomic (a checkpoint becomes visible
only once fully written, so a kill -9 mid-save leaves the previous one intact),
sharded (each process writes its own shards), and restored straight into the
shardings of the current mesh, whatever mesh wrote them.
"""

import copy
import logging as logging_std
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from orbax.checkpoint._src.metadata import array_metadata_store

from dist_ens.data import IteratorState
from dist_ens.errors import ConfigError
from dist_ens.io.checksums import checksums

# Fields that may change between a run and its resume without being asked for:
# they change how long or how verbosely a run goes, the topology (restores
# reshard) or how the same batches reach the devices, not what is being trained.
ALWAYS_COMPATIBLE = ('train.steps', 'train.epochs', 'train.log_every', 'train.eval_every', 'train.sync_every',
                     'train.steps_per_call', 'train.profile_steps', 'checkpoint', 'eval', 'mesh',
                     'distill', 'writers', 'data.loader', 'data.grain_workers', 'data.prefetch',
                     'data.resident', 'data.resident_budget_mb')
# Fields that define what the checkpoint holds: never restorable across a change.
NEVER_COMPATIBLE = ('num_members', 'model', 'data.name', 'ensemble.method', 'ensemble.own',
                    'ensemble.lora_rank', 'ensemble.lora_alpha', 'ensemble.lora_targets',
                    'ensemble.train_shared',
                    'ensemble.snapshot.cycles', 'ensemble.swag.rank', 'ensemble.mimo.heads',
                    'ensemble.prior.widths')


# Version of what a checkpoint holds. 2: TrainState(params, model_state, opt_state,
# frozen, step) with per-member hyperparameters outside the optimizer state.
# Checkpoints without a version (dist_ens 0.1) hold the old layout.
FORMAT = 2


class Restored(NamedTuple):
  step: int
  state: Any
  data_state: IteratorState
  meta: dict[str, Any]  # What save() was given as `meta`, plus 'step', 'data', 'format'.


def _matches(field: str, patterns: tuple[str, ...]) -> bool:
  return any(field == p or field.startswith(p + '.') for p in patterns)


def check_compatible(differing: list[str], restore_incompatible: str,
                     steps_shape_schedule: bool = False) -> None:
  """Refuses a resume whose config differs in fields that were not explicitly allowed.

  Args:
    differing: dotted names of the fields in which the saved and new configs differ.
    restore_incompatible: config.checkpoint.restore_incompatible, a comma-separated
      list of fields (or prefixes such as 'optim') the user allows to differ.
    steps_shape_schedule: the learning-rate schedule depends on train.steps (decay or
      warmup): changing it would rewrite the decay of the steps already taken, so it
      must be allowed explicitly.
  """
  allowed = tuple(p.strip() for p in restore_incompatible.split(',') if p.strip())
  always = tuple(f for f in ALWAYS_COMPATIBLE if not (steps_shape_schedule and f in ('train.steps', 'train.epochs')))
  never = [f for f in differing if _matches(f, NEVER_COMPATIBLE)]
  if never:
    raise ConfigError(
        f'the workdir holds a checkpoint of a different ensemble (differing fields: '
        f'{", ".join(never)}); these cannot change on resume; use a new --workdir.')
  refused = [f for f in differing if not _matches(f, always + allowed)]
  if refused:
    why = (' (train.steps shapes the learning-rate schedule: the steps already taken would '
           'have decayed differently)' if 'train.steps' in refused else '')
    raise ConfigError(
        f'the workdir holds a run whose config differs in {", ".join(refused)}{why}; to resume '
        f'with the new values anyway pass --config.checkpoint.restore_incompatible='
        f'{",".join(refused)}, or use a new --workdir.')


def _split(state: Any) -> tuple[dict[str, Any], Any]:
  """(what a model needs, the optimizer state): saved as two items, so that loading an
  ensemble for inference never needs to rebuild the optimizer."""
  model = {'params': state.params, 'model_state': state.model_state, 'frozen': state.frozen,
           'step': state.step}
  if jax.tree.leaves(state.method_state):  # Snapshots, SWAG moments: members predict from them.
    model['method_state'] = state.method_state
  return model, state.opt_state


class CorruptCheckpoint(Exception):
  """A checkpoint restored, but not to the values that were saved."""


class Checkpointer:
  """Saves every `every` steps (and when forced), keeps the newest `keep`."""

  def __init__(self, directory: Path, every: int, keep: int):
    self._every = every
    self._directory = directory
    _quiet_closed_loop_callbacks()
    self._manager = ocp.CheckpointManager(
        directory.absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                             create=True),
        handler_registry=_handlers())
    self._unreadable: set[int] = set()  # Steps restore() found corrupt: save() replaces them.
    self.blocking_seconds = 0.0  # Time the loop spent waiting on saves.
    self._prune(keep)

  def _prune(self, keep: int) -> None:
    """Deletes all but the newest `keep` checkpoints. Orbax prunes after each save, so a
    run killed between a save and that pruning (its last save, for a finished run) leaves
    one more than `keep`, which no later save of a finished run would remove."""
    steps = sorted(self._manager.all_steps())
    for step in steps[:max(len(steps) - keep, 0)]:
      logging.info('deleting the checkpoint at step %d: checkpoint.keep=%d', step, keep)
      self._manager.delete(step)

  def save(self, step: int, state: Any, data_state: IteratorState, force: bool = False,
           meta: dict[str, Any] | None = None) -> bool:
    """Starts an asynchronous save if `step` is due (or `force`); returns whether it did.

    `meta` (JSON-able, e.g. the training time so far) is saved beside the state, as it
    is now: the save writes it later, in the background, and a caller's live list (PBT's
    rounds) may grow by then.
    """
    if not force and step % self._every:
      return False
    if step in self._unreadable:
      self._manager.delete(step)
      self._unreadable.discard(step)
    elif step in self._manager.all_steps():
      return False
    start = time.perf_counter()
    model, opt_state = _split(state)
    meta = {**copy.deepcopy(meta or {}), 'step': step, 'data': data_state._asdict(),
            'format': FORMAT,
            'checksums': {'model': checksums(model), 'optimizer': checksums(opt_state)}}
    items = {'model': ocp.args.PyTreeSave(model), 'meta': ocp.args.JsonSave(meta)}
    if jax.tree.leaves(opt_state):  # Plain SGD keeps no state: nothing to write.
      items['optimizer'] = ocp.args.PyTreeSave(opt_state)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    self.blocking_seconds += time.perf_counter() - start
    return True

  def restore(self, abstract_state: Any, with_optimizer: bool = True) -> Restored | None:
    """The newest checkpoint that restores cleanly, into `abstract_state`'s shardings.

    A checkpoint that fails to restore (corrupt or truncated files) is skipped with a
    warning and the one before it is tried; a later save of its step replaces it.
    Without the optimizer (inference), the state's opt_state is None.

    Raises:
      ConfigError: the newest checkpoint is of another FORMAT (an older dist_ens), or
        there are checkpoints but none can be restored (nothing is deleted).
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    for step in steps:
      self._check_format(step)
      model, opt_state = _split(abstract_state)
      items = {'model': _restore_args(model), 'meta': ocp.args.JsonRestore()}
      with_optimizer_item = with_optimizer and bool(jax.tree.leaves(opt_state))
      if with_optimizer_item:
        items['optimizer'] = _restore_args(opt_state)
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        _verify(restored, with_optimizer_item)
      except Exception as e:  # pylint: disable=broad-except  # Any failure means "unusable".
        logging.warning('checkpoint at step %d cannot be restored (%s: %s); trying the one '
                        'before it.', step, type(e).__name__, str(e).splitlines()[0][:300])
        self._unreadable.add(step)
        continue
      opt_state = restored.optimizer if with_optimizer_item else (
          opt_state if with_optimizer else None)  # An empty state is its own value.
      state = abstract_state._replace(**restored.model, opt_state=opt_state)
      return Restored(step, state, IteratorState(**restored.meta['data']), dict(restored.meta))
    if steps:
      raise ConfigError(
          f'none of the checkpoints {sorted(steps)} in {self._directory} can be restored (see '
          'the warnings above); move them away to start over, or fix what changed (e.g. the '
          "model's code).")
    return None

  def newest_meta(self) -> dict[str, Any] | None:
    """What the newest readable checkpoint saved beside the state (no arrays read)."""
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        return dict(self._manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())).meta)
      except Exception:  # pylint: disable=broad-except  # Unreadable: try the one before.
        continue
    return None

  def _check_format(self, step: int) -> None:
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      found = meta.meta.get('format', 1)
    except Exception:  # pylint: disable=broad-except  # Unreadable: restore() decides.
      return
    if found != FORMAT:
      raise ConfigError(
          f'the checkpoint at step {step} in {self._directory} is of format {found}, written by '
          f'an older dist_ens; this version reads format {FORMAT}. Use a new --workdir (or '
          'retrain); docs/migration.md explains what changed.')

  def wait(self) -> None:
    start = time.perf_counter()
    self._manager.wait_until_finished()
    self.blocking_seconds += time.perf_counter() - start

  def close(self) -> None:
    try:
      self._manager.wait_until_finished()  # Raises what a background save ran into.
    finally:
      self._manager.close()


# A replicated array smaller than this is written by one of its replicas. Orbax splits
# every replicated array among its replicas to write in parallel by default, slicing
# each on the device: one compiled program per leaf shape, dozens for a state that is
# replicated over 'data', for writes of a few kilobytes each. Larger arrays keep the
# parallel write.
MIN_SLICE_BYTES = 1 << 20


def _handlers() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """The manager's handlers: the state's items are pytrees of arrays whose replicated
  leaves are split among their replicas only from MIN_SLICE_BYTES on; meta is JSON."""
  arrays = ocp.type_handlers.ArrayHandler(
      min_slice_bytes_for_replica_parallel=MIN_SLICE_BYTES,
      array_metadata_store=array_metadata_store.Store())  # As orbax's default handler.
  types = ocp.type_handlers.create_type_handler_registry(
      (jax.Array, arrays), (np.ndarray, ocp.type_handlers.NumpyHandler()),
      (np.number, ocp.type_handlers.ScalarHandler()), (int, ocp.type_handlers.ScalarHandler()),
      (float, ocp.type_handlers.ScalarHandler()))
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for item in ('model', 'optimizer'):
    pytrees = ocp.PyTreeCheckpointHandler(type_handler_registry=types)
    registry.add(item, ocp.args.PyTreeSave, pytrees)
    registry.add(item, ocp.args.PyTreeRestore, pytrees)
  registry.add('meta', ocp.args.JsonSave)
  registry.add('meta', ocp.args.JsonRestore)
  return registry


def _restore_args(abstract: Any) -> ocp.args.PyTreeRestore:
  """Restores a pytree into `abstract`'s structure, shapes, dtypes and shardings."""
  return ocp.args.PyTreeRestore(
      abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))


def _verify(restored: Any, with_optimizer: bool) -> None:
  """Raises CorruptCheckpoint if the restored arrays are not the ones saved (checkpoints
  written before checksums were saved are taken as they are)."""
  saved = restored.meta.get('checksums')
  if saved is None:
    return
  items = [('model', restored.model)] + ([('optimizer', restored.optimizer)]
                                         if with_optimizer else [])
  for name, tree in items:
    if checksums(tree) != saved[name]:
      raise CorruptCheckpoint(f'its {name} arrays do not match the checksums saved with them')


# How a full disk reads in errors that are not OSErrors (tensorstore's, under orbax).
FULL_DISK_TEXTS = ('No space left on device', 'Disk quota exceeded', 'File too large')
# An orbax thread that outlived its manager's close (a failed save ends the run, and the
# close shuts the executors down while a commit's metadata thread still schedules): the
# error that stopped the run is reported; this one only says the close came first.
_AFTER_CLOSE = 'cannot schedule new futures after shutdown'


class _QuietOrbax(logging_std.Filter):
  """Drops orbax's per-save INFO chatter from absl's log; its warnings still show.

  Its errors come from background save threads, and the same error reaches the loop
  (the next save or wait raises it), which reports it: they show as one line without
  the traceback, and not at all for a full disk, which the run reports in one line
  (it gave 45 tracebacks before), or for a thread that outlived the manager's close.
  """

  def filter(self, record: logging_std.LogRecord) -> bool:
    if '/orbax/' not in record.pathname:
      return True
    if record.levelno >= logging_std.ERROR:
      message = record.getMessage()
      if any(text in message for text in (*FULL_DISK_TEXTS, _AFTER_CLOSE)):
        return False
      record.msg, record.args = message.splitlines()[0][:400], ()
      record.exc_info = record.exc_text = None
    return record.levelno >= logging_std.WARNING


logging_std.getLogger('absl').addFilter(_QuietOrbax())


class _QuietOrbaxTasks(logging_std.Filter):
  """Drops asyncio's 'Task (or Future) exception was never retrieved' for orbax's writes
  that failed on a full disk: the save's own error reaches the loop, which reports it in
  one line (the tasks' tracebacks went to stderr, one per array, through asyncio's
  logger; a failed write's bare Future, collected at exit, printed its traceback after
  that line, with no 'orbax' in its message)."""

  def filter(self, record: logging_std.LogRecord) -> bool:
    message = record.getMessage()
    full = any(text in message for text in FULL_DISK_TEXTS)
    unretrieved = 'exception was never retrieved' in message
    return not (full and ('orbax' in message or unretrieved))


logging_std.getLogger('asyncio').addFilter(_QuietOrbaxTasks())


def _closed_loop_callback(unraisable: Any) -> bool:
  """A tensorstore write finishing after orbax closed the asyncio loop that awaited it
  (it does when another write of the save failed): its completion callback finds the
  loop closed. The failure itself is the save's error."""
  error, tb = unraisable.exc_value, unraisable.exc_traceback
  while tb is not None and tb.tb_next is not None:
    tb = tb.tb_next
  return (isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'
          and tb is not None and tb.tb_frame.f_code.co_filename.endswith(
              os.path.join('asyncio', 'base_events.py')))


def _quiet_closed_loop_callbacks() -> None:
  """Keeps those callbacks' 'Event loop is closed' tracebacks off stderr (any other
  unraisable error goes to the hook that was there before)."""
  previous = sys.unraisablehook
  if getattr(previous, 'dist_ens_closed_loops', False):
    return

  def hook(unraisable: Any) -> None:
    if not _closed_loop_callback(unraisable):
      previous(unraisable)

  hook.dist_ens_closed_loops = True
  sys.unraisablehook = hook
