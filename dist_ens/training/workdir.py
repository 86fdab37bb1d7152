"""The workdir's safety: a workdir that cannot be written refused in one line before
anything runs, one run at a time (a lock that a second run finds), a full disk
reported in one line, and a resume that finds events missing says so.

workdir/.lock is held with flock(2) for as long as the run lives, and holds who
holds it ({"host", "pid", "started"}) for the message a second run prints. The
kernel drops an flock when its process ends, however it ends (kill -9 included),
so a lock is stale exactly when nobody holds the flock: a pid check could not
tell a dead process from a new one that reused its pid, nor see processes on
other hosts of a shared filesystem (NFSv4 and Lustre with -o flock pass flocks
between hosts). A stale lock is taken over with a warning naming who left it.
On release the file is emptied, not deleted: deleting would let a run that opened
the old file before the deletion lock it while another locks the new one.

In a multi-process run process 0 alone takes the lock, for the whole run (all
processes write into the one workdir, so the run is the unit that must be alone).
"""

import contextlib
import datetime
import errno
import fcntl
import json
import logging as std_logging
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
from absl import logging

from dist_ens.io.checkpoint import FULL_DISK_TEXTS
from dist_ens.errors import ConfigError, TrainingError

LOCK_NAME = '.lock'


# The longest file name (one path component) Linux, macOS and Windows filesystems take.
_NAME_MAX = 255


def check_workdir(workdir: str | os.PathLike) -> None:
  """Refuses a workdir that cannot be created or written, before anything is compiled:
  otherwise the first mkdir or lock fails deep in start-up with a long traceback.

  Raises:
    ConfigError: a component of its path is longer than a file name may be, it is a
      file, a file stands where a parent directory should be, or
      the nearest existing directory is not writable (a read-only filesystem, or
      permissions).
  """
  path = Path(workdir).absolute()
  for part in path.parts:  # Else the first stat of the path raises a 30-line OSError.
    if len(os.fsencode(part)) > _NAME_MAX:
      raise ConfigError(f'--workdir={workdir}: its component {part[:40]}... is '
                        f'{len(os.fsencode(part))} bytes, over the {_NAME_MAX} a file name '
                        'may have; use a shorter name.')
  try:
    path.exists()
  except OSError as e:  # The whole path too long, a loop of links, ...
    raise ConfigError(f'--workdir={workdir} cannot be used: {e.strerror}.') from None
  if path.exists() and not path.is_dir():
    raise ConfigError(f'--workdir={workdir} is a file, not a directory; name a directory '
                      '(new or holding a run to resume).')
  existing = path
  while not existing.exists() and existing != existing.parent:
    existing = existing.parent
  if not existing.is_dir():
    raise ConfigError(f'--workdir={workdir} cannot be created: {existing} is a file, not a '
                      'directory; name a directory elsewhere.')
  if not os.access(existing, os.W_OK | os.X_OK):
    what = 'the workdir' if existing == path else f'{existing}, where it would be created,'
    raise ConfigError(f'--workdir={workdir}: {what} is not writable (a read-only '
                      'filesystem, or permissions); name a directory this user can write.')


class WorkdirInUse(ConfigError):
  """Another live run holds the workdir's lock."""


def _read_holder(fd: int) -> dict[str, Any] | None:
  text = os.pread(fd, 4096, 0).decode('utf-8', errors='replace')
  if not text.strip():
    return None
  try:
    holder = json.loads(text)
  except json.JSONDecodeError:
    return {'host': '?', 'pid': '?', 'started': '?'}
  return holder if isinstance(holder, dict) else None


def _describe(holder: dict[str, Any] | None) -> str:
  if holder is None:
    return 'pid unknown'
  return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
          f"{holder.get('started', '?')}")


class WorkdirLock:
  """workdir/.lock, held while the run lives. Use as a context manager, or
  acquire() / release() (release is safe to call twice, and without acquire)."""

  def __init__(self, workdir: str | os.PathLike):
    self.workdir = Path(workdir)
    self.path = self.workdir / LOCK_NAME
    self._fd: int | None = None

  def acquire(self) -> None:
    """Takes the lock, creating the workdir if needed.

    Raises:
      WorkdirInUse: another live run holds it (nothing is written then).
    """
    try:
      self.workdir.mkdir(parents=True, exist_ok=True)
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # The umask decides the mode.
    except OSError as e:  # What check_workdir could not foresee (e.g. a .lock not ours).
      if e.errno in _FULL_ERRNOS:
        raise  # disk_full says it in one line.
      raise ConfigError(f'cannot open {self.path}: {e.strerror}; name a --workdir this user '
                        'can write.') from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read_holder(fd)
      os.close(fd)
      raise WorkdirInUse(
          f'{self.workdir} is in use by another run ({_describe(holder)}); wait for it to end '
          'or stop it, or use a new --workdir.') from None
    except OSError as e:  # A filesystem without flocks (e.g. NFS mounted with -o nolock).
      os.close(fd)
      logging.warning('cannot lock %s (%s); nothing stops a second run on this workdir.',
                      self.path, e)
      return
    stale = _read_holder(fd)
    if stale is not None:
      logging.warning('taking over the lock of %s left by %s: that run is no longer running.',
                      self.workdir, _describe(stale))
    me = {'host': socket.gethostname(), 'pid': os.getpid(),
          'started': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + '\n').encode(), 0)
    self._fd = fd

  def release(self) -> None:
    fd, self._fd = self._fd, None
    if fd is None:
      return
    try:
      os.ftruncate(fd, 0)  # Empty: nobody holds it, and no run is reported as stale.
    except OSError:  # A full disk cannot stop a truncate, but be safe: the flock still goes.
      pass
    os.close(fd)  # Drops the flock.

  def __enter__(self) -> 'WorkdirLock':
    self.acquire()
    return self

  def __exit__(self, *exc: Any) -> None:
    self.release()


@contextlib.contextmanager
def lock_workdir(workdir: str | os.PathLike) -> Iterator[None]:
  """Holds the workdir's lock inside the block: process 0 takes it for the whole run
  (see the module doc); it is released however the block ends.

  No collective shares the outcome: one gathered at start-up made two-process runs hang
  when later stopped by SIGTERM (JAX's preemption sync). A refused process 0 fails like
  any failing process of a run, which stops the others (main.py exits without barrier).

  Raises:
    WorkdirInUse: on process 0, if another run holds it.
  """
  lock = WorkdirLock(workdir)
  if jax.process_index() == 0:
    lock.acquire()
  try:
    yield
  finally:
    lock.release()


class DiskFull(TrainingError):
  """A write into the workdir failed for lack of space (disk, quota or file-size limit)."""


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _out_of_space(error: BaseException) -> str | None:
  """The line that says a write ran out of space, from `error` or what it came from."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
      return os.strerror(error.errno)
    text = str(error)
    for full in FULL_DISK_TEXTS:
      if full in text:
        return full
    error = error.__cause__ or error.__context__
  return None


class _OrbaxFullDisk(std_logging.Filter):
  """Drops orbax's own error lines (with their tracebacks) about a write that ran out of
  space: the run ends with disk_full's one line, which says what they say and what to do."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    # The record's exc_info stays empty on this path (absl); the filter runs inside the
    # logging call, in the handler of the error it reports.
    error = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
    return not ('orbax' in record.pathname and error is not None
                and _out_of_space(error) is not None)


@contextlib.contextmanager
def quiet_orbax_on_full_disk() -> Iterator[None]:
  """While open, orbax's error lines about a full disk are not printed (absl's logger,
  which orbax logs to)."""
  quiet, absl_logger = _OrbaxFullDisk(), std_logging.getLogger('absl')
  absl_logger.addFilter(quiet)
  try:
    yield
  finally:
    absl_logger.removeFilter(quiet)


def newest_meta(directory: Path) -> dict[str, Any] | None:
  """The meta item of the newest intact committed checkpoint in `directory`, read as
  a plain file (orbax commits a checkpoint by renaming it to its step number).

  No orbax manager here: opening one is a collective across processes, and whether
  the directory exists yet depends on which process got here first.
  """
  steps = sorted((int(d.name) for d in directory.glob('*') if d.name.isdigit()), reverse=True)
  for step in steps:
    try:
      meta = json.loads((directory / str(step) / 'meta' / 'metadata').read_text())
    except (OSError, ValueError):  # Unreadable, not UTF-8 or not JSON: damaged, skip it.
      continue
    if isinstance(meta, dict) and isinstance(meta.get('step'), int):  # Else damaged too.
      return meta
  return None


def newest_intact_step(workdir: str | os.PathLike) -> int | None:
  """The step of the newest checkpoint in the workdir that a rerun resumes from."""
  meta = newest_meta(Path(workdir) / 'checkpoints')
  return None if meta is None else meta['step']


def disk_full(error: BaseException, workdir: str | os.PathLike) -> DiskFull | None:
  """A one-line DiskFull for `error` if it (or what it came from) is a lack of space,
  naming the checkpoint a rerun resumes from; None for any other error."""
  reason = _out_of_space(error)
  if reason is None:
    return None
  workdir = Path(workdir)
  step = newest_intact_step(workdir)
  kept = (f'the checkpoint at step {step} is intact' if step is not None else
          'no checkpoint was saved yet')
  return DiskFull(f'writing into {workdir} failed: {reason} (the disk, a quota or a file-size '
                  f'limit is full); {kept}: free some space and run the same command again to '
                  f'{"resume" if step is not None else "start"}.')


def warn_missing_events(workdir: str | os.PathLike, step: int, log_every: int) -> None:
  """Warns once when a run resuming from its checkpoint at `step` finds metrics.jsonl
  without the train events up to it (deleted, truncated or replaced since): the
  checkpoint is saved after every event of its step, so they were written, and the
  resumed run appends after the gap without filling it."""
  due = step - step % log_every if log_every else 0  # The last train event before `step`.
  if due <= 0:
    return
  path = Path(workdir) / 'metrics.jsonl'
  last = _last_train_step(path, step)
  if last is None:
    logging.warning('%s is missing: the events of steps 1-%d are lost; the run resumes from '
                    'its checkpoint at step %d and writes the events from there on.', path,
                    step, step)
  elif last < due:
    logging.warning('%s ends at step %d but the run resumes from its checkpoint at step %d: '
                    'the events of steps %d-%d are lost (the file was truncated or replaced).',
                    path, last, step, last + 1, step)


def _last_train_step(path: Path, through: int) -> int | None:
  """The newest step up to `through` with a train event in the JSONL file at `path`
  (0 for none; None if there is no file)."""
  try:
    text = path.read_text(encoding='utf-8', errors='replace')
  except FileNotFoundError:
    return None
  last = 0
  for line in text.splitlines():
    try:
      event = json.loads(line)
    except json.JSONDecodeError:
      continue  # A line torn by a crash.
    if not isinstance(event, dict) or event.get('split') != 'train':
      continue
    step = event.get('step')
    if isinstance(step, int) and step <= through:
      last = max(last, step)
  return last
