"""Stopping cleanly when the run is asked to: SIGTERM (a scheduler's preemption notice)."""

import signal
import threading

import jax


class PreemptionWatcher:
  """Turns SIGTERM into a request to save and stop at the next step boundary.

  On several processes the decision must be the same everywhere, so JAX's
  preemption sync point (the distributed runtime's notice, as on TPU) decides
  there; a single process uses its own SIGTERM flag.
  """

  def __init__(self):
    self._flag = threading.Event()
    self._previous = None
    # Several processes: JAX's preemption notifier owns SIGTERM; a Python handler
    # would replace it and the sync point in should_stop would never fire.
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, lambda *_: self._flag.set())

  def should_stop(self, step: int) -> bool:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
      except RuntimeError:  # No preemption service in this distributed runtime.
        return False
    return self._flag.is_set()

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
