"""Stopping cleanly when asked to: SIGTERM (a scheduler's preemption notice) or Ctrl-C (SIGINT)."""

import itertools
import signal
import threading

import jax

# Signals that ask a single-process run to save and stop at the next step boundary.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionWatcher:
  """Turns SIGTERM or SIGINT (Ctrl-C) into a request to save and stop at the next step boundary.

  A second such signal does not wait for the step boundary: it raises
  KeyboardInterrupt at once (the previous handlers are back by then, so a third
  one acts as it would without the watcher).

  On several processes the decision must be the same everywhere, so JAX's
  preemption sync point (the distributed runtime's notice, as on TPU) decides
  there and no handler is installed; a single process uses its own flag.
  """

  # JAX's sync point agrees on a counter value one past the highest any process has
  # reached, so it must grow by one each check: steps, which grow by steps_per_call,
  # would skip it. Shared by every watcher, as the processes run the same sequence of runs.
  _checks = itertools.count(1)

  def __init__(self):
    self._flag = threading.Event()
    self._previous = {}
    self.signal_name = None  # 'SIGTERM' or 'SIGINT' once one has arrived.
    # Several processes: JAX's preemption notifier owns SIGTERM; a Python handler
    # would replace it and the sync point in should_stop would never fire.
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      for signum in STOP_SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)

  def _handle(self, signum, frame) -> None:
    del frame
    if not self._flag.is_set():
      self.signal_name = signal.Signals(signum).name
      self._flag.set()
      return
    self.close()  # Asked twice: stop now, without waiting for the step.
    raise KeyboardInterrupt(f'{signal.Signals(signum).name} received twice')

  def should_stop(self, step: int) -> bool:
    """Whether to save and stop before the call that starts at `step`."""
    del step  # Every check is one call of the step, whatever steps it runs.
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      try:
        return bool(multihost_utils.reached_preemption_sync_point(next(self._checks)))
      except RuntimeError:  # No preemption service in this distributed runtime.
        return False
    return self._flag.is_set()

  def close(self) -> None:
    """Puts back the handlers that were there before; safe to call twice."""
    previous, self._previous = self._previous, {}
    for signum, handler in previous.items():
      signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
