"""The loop's own actions (see dist_ens.training.loop for the interface); the evaluations
are evaluators (dist_ens/evaluators/).

  Sync           waits for the device every N calls (multi-device CPU collectives
                 deadlock when ~30 steps are queued)
  Checkpoint     saves every checkpoint.every steps and after the last; runs after
                 every other action, so a checkpoint never precedes its step's events
  TrainLog       train metrics every log_every steps: event, log line, progress bar,
                 and non-finite members (freeze or stop)
  Profile        a jax.profiler trace of a few steps
"""

import time
from typing import Any

import jax
import numpy as np
from absl import logging

from dist_ens.io.checkpoint import Checkpointer
from dist_ens.errors import TrainingError
from dist_ens.io import progress as progress_lib
from dist_ens.training.loop import Call, PeriodicAction
from dist_ens.core.stacks import metrics_in_id_order
from dist_ens.core.state import member_flags
from dist_ens.core.step import StepMetrics

# A checkpoint's entry for the train metrics of the steps since the last log step.
INTERVAL_META = 'train_interval'


class Sync(PeriodicAction):
  """Blocks until the step's results exist every `every` steps."""

  def run(self, call: Call) -> None:
    jax.block_until_ready(call.metrics)

  def on_end(self, call: Call) -> None:
    pass


class Checkpoint(PeriodicAction):
  """Saves the state, the data position and the training time so far.

  Runs after every other action (see trainer.default_actions), so a checkpoint at a
  step exists only once all of that step's events are written. An action that must
  stop the run after this step's save calls `stop_after_save(error)`.
  """

  def __init__(self, checkpointer: Checkpointer, every: int):
    super().__init__(every, at_end=True)
    self.checkpointer = checkpointer
    self._stop: Exception | None = None

  def save(self, call: Call, force: bool = True) -> None:
    self.checkpointer.save(call.step, call.state, call.session.batches.state, force=force,
                           meta=call.session.checkpoint_meta())

  def stop_after_save(self, error: Exception) -> None:
    self._stop = error

  def on_step(self, call: Call) -> None:
    if self._stop is not None:
      self.save(call)
      self.checkpointer.wait()
      raise self._stop
    super().on_step(call)

  def run(self, call: Call) -> None:
    self.save(call)


class TrainLog(PeriodicAction):
  """Every `every` steps (and at the last): the interval's train metrics as an event and
  a log line, and members newly non-finite reported (and, with on_nonfinite='stop',
  the run saved and stopped)."""

  def __init__(self, call: Call, checkpoint: Checkpoint):
    session = call.session
    super().__init__(session.spec.train.log_every)
    self._checkpoint = checkpoint
    self._session = session
    self._interval: list[Any] = []  # This interval's step metrics, on the device.
    # Its earlier steps as numpy: those a checkpoint saved between two log steps (a
    # resumed run's first record averages them too, as an uninterrupted run's would),
    # then whatever a save had to fetch.
    self._fetched = _interval_from_meta(session.saved_meta.get(INTERVAL_META))
    self._steps_here = 0  # Steps this session ran in the interval (its speed's count).
    session.meta_extras[INTERVAL_META] = self._interval_meta
    self._mark = session.train_clock()
    self._progress = progress_lib.Progress(session.total_steps, session.start_step)
    self._reported = set(np.flatnonzero(member_flags(session.fetch(call.state.frozen))).tolist())
    if self._reported and session.spec.train.on_nonfinite == 'stop':
      # A resumed run whose members froze before: 'stop' holds every time, not only once.
      raise TrainingError(
          f'members {sorted(self._reported)} went non-finite before step {call.step} and '
          "config.train.on_nonfinite='stop'; set on_nonfinite='freeze' to train the others on.")
    self._pipeline_mark = session.batches.stats
    self._due: Call | None = None  # A log step whose record waits for the next call.

  def on_step(self, call: Call) -> None:
    # In one process a log step's record waits for the call after it to be queued
    # (self._due): reading a call's metrics waits for that call, and the device would sit
    # idle while the host writes. Not at the last step, nor where a checkpoint or a stop
    # must follow the record within its own call, nor across processes, where the read is
    # a program of collectives that XLA:CPU may run interleaved with the queued call's.
    self._record_due()
    self._interval.append(call.metrics)
    _copy_to_host_async(call.metrics)
    self._steps_here += call.session.steps_per_call
    self._progress.update(call.step)
    if self.due(call.step) or call.step == call.session.total_steps:
      if (call.step == call.session.total_steps or self._checkpoint.due(call.step)
          or call.session.spec.train.on_nonfinite == 'stop' or jax.process_count() > 1):
        self._flush(call)
      else:
        self._due = call

  def _record_due(self) -> None:
    if self._due is not None:
      due, self._due = self._due, None
      self._flush(due)

  def on_end(self, call: Call) -> None:
    pass

  def _flush(self, call: Call) -> None:
    session = call.session
    m = session.spec.num_members
    fetched, self._fetched = self._drain(), None
    now = session.train_clock()
    elapsed, self._mark = now - self._mark, now
    steps, steps_here, self._steps_here = len(fetched.loss), self._steps_here, 0
    loss = fetched.loss.mean(axis=0)
    batch_metrics = {k: v.mean(axis=0) for k, v in fetched.metrics.items()}
    rate = m * session.spec.batch_size * steps_here / elapsed
    # Examples the input pipeline delivered per step (one batch, or one per member) and
    # could deliver (per second of its busy time; none when its thread made no batch in
    # the interval, having run ahead: an infinite figure is noise in every writer).
    per_step = (m if session.run_data.order.per_member else 1) * session.spec.batch_size
    demand = per_step * steps_here / elapsed
    stats, mark = session.batches.stats, self._pipeline_mark
    busy = stats.busy_seconds - mark.busy_seconds
    supply = (stats.examples - mark.examples) / busy if busy > 0 else None
    self._pipeline_mark = stats
    eta = (session.train_seconds() - session.saved_meta.get('train_seconds', 0.0)) / max(
        call.step - session.start_step, 1) * (session.total_steps - call.step)
    session.write({'step': call.step, 'split': 'train', 'steps_averaged': steps,
                   'members': {'loss': loss.tolist(),
                               **{k: v.tolist() for k, v in batch_metrics.items()}},
                   'member_examples_per_s': rate, 'input_examples_per_s': demand,
                   **({} if supply is None else {'input_pipeline_capacity_per_s': supply})})
    self._progress.update(
        call.step, progress_lib.progress_line(call.step, session.total_steps, loss, batch_metrics,
                                              rate, eta, demand, supply),
        postfix=f'loss {loss.mean():.4f} {progress_lib.metrics_text(batch_metrics)} '
                f'{rate:,.0f} member-ex/s')
    self._check_nonfinite(call, fetched.nonfinite)

  def _drain(self) -> StepMetrics:
    """Every step's metrics since the last log as numpy, [steps, M] each (a call gives
    [K, M]), in member id order."""
    m = self._session.spec.num_members
    fetched = [metrics_in_id_order(self._session.fetch(metrics_)) for metrics_ in self._interval]
    earlier = [] if self._fetched is None else [self._fetched]
    self._interval = []
    self._fetched = jax.tree.map(
        lambda *parts: np.concatenate([p.reshape(-1, m) for p in parts]), *earlier, *fetched)
    return self._fetched

  def _interval_meta(self) -> dict[str, Any] | None:
    """What a checkpoint saves of the interval so far (None at a log step): the exact
    float32 values, which JSON's doubles hold without rounding."""
    self._record_due()  # A save (a stop, preemption) comes after the log step's record.
    if not self._interval and self._fetched is None:
      return None
    fetched = self._drain()
    return {'loss': fetched.loss.tolist(), 'nonfinite': fetched.nonfinite.tolist(),
            'metrics': {k: v.tolist() for k, v in fetched.metrics.items()}}

  def _check_nonfinite(self, call: Call, nonfinite: np.ndarray) -> None:
    newly_bad = sorted(set(np.flatnonzero(np.any(nonfinite, axis=0)).tolist()) - self._reported)
    if not newly_bad:
      return
    self._reported.update(newly_bad)
    logging.warning('members %s hit a non-finite loss or gradient by step %d and are frozen at '
                    'their last finite parameters.', newly_bad, call.step)
    if call.session.spec.train.on_nonfinite == 'stop':  # Once this step's events are written.
      self._checkpoint.stop_after_save(TrainingError(
          f'members {newly_bad} went non-finite by step {call.step} and '
          "config.train.on_nonfinite='stop'; saved the checkpoint at step "
          f"{call.step}. Set on_nonfinite='freeze' to train the others on."))

  def close(self) -> None:
    self._progress.close()


def _copy_to_host_async(tree: Any) -> None:
  """Starts each array's copy to host memory, so a log step's read finds it there (one
  process; across processes the read gathers them first)."""
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and leaf.is_fully_addressable:
      leaf.copy_to_host_async()


def _interval_from_meta(saved: dict[str, Any] | None) -> StepMetrics | None:
  if not saved:
    return None
  return StepMetrics(np.asarray(saved['loss'], np.float32),
                     {k: np.asarray(v, np.float32) for k, v in saved['metrics'].items()},
                     np.asarray(saved['nonfinite'], bool))


class Profile(PeriodicAction):
  """A jax.profiler trace (TensorBoard's profile plugin) of `steps` steps after `start`,
  written to workdir/profile."""

  def __init__(self, start: int, steps: int):
    super().__init__(0)
    self._start, self._stop, self._active = start, start + steps, False

  def on_step(self, call: Call) -> None:
    if not self._active and self._start <= call.step < self._stop:
      jax.block_until_ready(call.metrics)
      jax.profiler.start_trace(str(call.session.workdir / 'profile'))
      self._active, self._began = True, time.perf_counter()
    elif self._active and call.step >= self._stop:
      self._end(call)

  def on_end(self, call: Call) -> None:
    if self._active:
      self._end(call)

  def _end(self, call: Call) -> None:
    jax.block_until_ready(call.metrics)
    jax.profiler.stop_trace()
    self._active = False
    logging.info('profiled steps up to %d in %.1f s: %s', call.step,
                 time.perf_counter() - self._began, call.session.workdir / 'profile')

  def close(self) -> None:
    if self._active:
      jax.profiler.stop_trace()
      self._active = False
