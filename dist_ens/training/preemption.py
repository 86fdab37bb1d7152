"""Stopping cleanly when asked to: SIGTERM (a scheduler's preemption notice) or Ctrl-C (SIGINT).

The first signal asks the loop to save and stop before its next call of the compiled
step (the loop keeps the device at most one call ahead of Python, so that is the next
call or the one after). The second stops at once without saving. The CLI then exits
128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM), as a shell expects.
"""

import itertools
import logging as std_logging
import os
import signal
import socket
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

# Signals that ask a run to save and stop before its next call of the step.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How long a second signal waits for Python's own handler (which raises StopRequested)
# before the process exits: the main thread may be blocked in XLA for minutes
# (a long step, a compilation, a checkpoint write), where no Python handler can run.
_SECOND_SIGNAL_GRACE_S = 1.0


class StopRequested(KeyboardInterrupt):
  """A second stop signal: the run stops at once, without saving. `signum` tells the CLI
  which exit status to use (a KeyboardInterrupt alone would read as Ctrl-C's 130)."""

  def __init__(self, signum: int):
    super().__init__(f'{signal.Signals(signum).name} received twice')
    self.signum = signum


class PreemptionWatcher:
  """Turns SIGTERM or SIGINT into a request to save and stop before the next call.

  A second such signal raises StopRequested at once (the previous handlers are
  back by then, so a third acts as it would without the watcher); if the main thread
  is stuck in native code and cannot raise it within a second, the process prints one
  line and exits 128 + the signal.

  On several processes every one must stop at the same step, whichever got the signal
  (a scheduler signals them at slightly different times): should_stop all-reduces the
  processes' requests, see _StopVote.
  """

  # JAX's preemption sync point (still read, for notices that are no SIGTERM, e.g. a
  # TPU's maintenance event) agrees on a counter one past the highest any process has
  # reached, so it must grow by one each check. Shared: every process runs the same runs.
  _checks = itertools.count(1)

  def __init__(self):
    self._flag = threading.Event()
    self._acted = threading.Event()  # Python's handler ran for a second signal.
    self._previous = {}
    self._wakeup = None  # (the socket the C-level handler writes to, the previous wakeup fd)
    self.signal_name = None  # 'SIGTERM' or 'SIGINT' once one has arrived (on any process).
    self._vote = _StopVote() if jax.process_count() > 1 else None
    if threading.current_thread() is threading.main_thread():
      # On several processes this replaces JAX's preemption notifier for SIGTERM: its
      # sync point is agreed in the background and missed by a process already past it.
      for signum in STOP_SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
      self._watch_native()
      _install_unraisable_hook()

  def _handle(self, signum, frame) -> None:
    del frame
    if not self._flag.is_set():
      self.signal_name = signal.Signals(signum).name
      self._flag.set()
      return
    self._acted.set()
    self.close()  # Asked twice: stop now, without waiting for the step.
    raise StopRequested(signum)

  def _watch_native(self) -> None:
    """Counts the signals in a thread, from the wakeup fd that CPython's C-level handler
    writes each signal number to even while the main thread is blocked in XLA."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
      previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # Not allowed here (e.g. a subinterpreter): Python's handler only.
      reader.close()
      writer.close()
      return
    self._wakeup = (writer, previous)
    threading.Thread(target=self._count_signals, args=(reader,), daemon=True,
                     name='dist_ens-second-signal').start()

  def _count_signals(self, reader: socket.socket) -> None:
    seen = 0
    with reader:
      while data := reader.recv(64):  # b'' once close() shuts the writer.
        for signum in data:
          seen += signum in STOP_SIGNALS
          if seen >= 2 and not self._acted.wait(_SECOND_SIGNAL_GRACE_S) and self._wakeup:
            _exit_now(signum)

  def should_stop(self, step: int) -> bool:
    """Whether to save and stop before the call that starts at `step`."""
    del step  # Every check is one call of the step, whatever steps it runs.
    if self._vote is None:
      return self._flag.is_set()
    # Every check, on every process: the sync point needs the counters in step.
    notice = _jax_preemption_notice(next(self._checks))
    local = signal.Signals[self.signal_name] if self._flag.is_set() else 0
    if notice and not local:
      local = signal.SIGTERM
    agreed = self._vote(int(local))
    if agreed and self.signal_name is None:  # Another process was signalled.
      self.signal_name = signal.Signals(agreed).name
    return bool(agreed)

  def close(self) -> None:
    """Puts back the handlers that were there before; safe to call twice."""
    previous, self._previous = self._previous, {}
    for signum, handler in previous.items():
      signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    wakeup, self._wakeup = self._wakeup, None
    if wakeup is not None:
      writer, previous_fd = wakeup
      signal.set_wakeup_fd(previous_fd)
      writer.close()  # The counting thread reads EOF and ends.


class _StopVote:
  """The largest stop request (a signal number, 0 for none) over all processes.

  A max all-reduce over one device per process, once per call of the step. Each call
  returns the previous check's result, so the reduction runs behind the step already
  queued instead of stalling the device; every process reads the same check, so all
  stop at the same step, one call later than a single process would.
  """

  def __init__(self):
    devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
               for p in range(jax.process_count())]
    mesh = jax.sharding.Mesh(np.array(devices), ('process',))
    self._sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('process'))
    self._reduce = jax.jit(jnp.max, out_shardings=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))
    self._pending = None

  def __call__(self, local: int) -> int:
    mine = jax.make_array_from_process_local_data(self._sharding, np.array([local], np.int32))
    pending, self._pending = self._pending, self._reduce(mine)
    return 0 if pending is None else int(np.asarray(pending.addressable_data(0)))


def _install_unraisable_hook() -> None:
  """Makes a StopRequested that Python cannot raise still stop the process at once.

  A signal handler runs between any two bytecodes, also inside a garbage-collector
  callback or a `__del__` (JAX registers one that runs at every collection); an exception
  raised there is printed as "Exception ignored in ..." and the run goes on. Installed
  once and kept: it acts only on StopRequested, which nothing but the watcher raises, and
  such an exception may be swallowed after the watcher has closed.
  """
  previous = sys.unraisablehook
  if getattr(previous, '_dist_ens_stop', False):
    return

  def hook(unraisable) -> None:
    if isinstance(unraisable.exc_value, StopRequested):
      _exit_now(unraisable.exc_value.signum)
    previous(unraisable)

  hook._dist_ens_stop = True  # pylint: disable=protected-access
  sys.unraisablehook = hook


def _jax_preemption_notice(check: int) -> bool:
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  try:
    return bool(multihost_utils.reached_preemption_sync_point(check))
  except RuntimeError:  # No preemption service in this distributed runtime.
    return False


def _exit_now(signum: int) -> None:
  """One line and 128 + the signal, from the counting thread. os._exit: the main thread
  is blocked, and a normal exit would wait for it; the last complete checkpoint stays."""
  name = signal.Signals(signum).name
  print(f'dist-ens: stopped ({name} received twice) without saving; rerunning the same '
        'command resumes from the last checkpoint, if any.', file=sys.stderr)
  for handler in std_logging.getLogger().handlers:
    handler.flush()
  sys.stderr.flush()
  os._exit(128 + signum)  # pylint: disable=protected-access
