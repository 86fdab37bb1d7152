"""A crashed xdist worker fails the run instead of hanging it (tests/conftest.py's
DeadWorkerWatch; issue 62 item 7)."""

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import support

# The repository's conftest, for a suite in a temporary folder: its hooks, flags and
# watch, as `pytest -q` in the repository gets them.
_CONFTEST = f"""
import sys
sys.path.insert(0, {str(support.ROOT / 'tests')!r})
exec(compile(open({str(support.ROOT / 'tests' / 'conftest.py')!r}).read(), 'conftest.py', 'exec'))
"""

# A worker that forks a child (which keeps every fd of the worker, its pipe to the
# controller included) and then aborts: before the watch, the controller never saw the
# pipe close and the run hung until the child ended.
_ABORTS = """
import os, time

def test_forks_then_aborts(tmp_path_factory):
  pid = os.fork()
  if pid == 0:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # not the test's captured output: only the worker's pipe
      os.dup2(null, fd)
    time.sleep(3600)
    os._exit(0)
  with open(os.environ['HOLDER_PID_FILE'], 'w') as f:
    f.write(str(pid))
  os.abort()
"""


def _pytest(tmp_path, *args, env=()):
  """A pytest run of the suite in `tmp_path` on two workers, as the repository's runs."""
  env = {**{k: v for k, v in os.environ.items()
            if k not in ('PYTEST_ADDOPTS', 'PYTEST_TIMEOUT', 'XLA_FLAGS')
            and not k.startswith('PYTEST_XDIST')}, **dict(env)}
  command = [sys.executable, '-m', 'pytest', '-q', '-n', '2', '--dist', 'loadfile',
             '--max-worker-restart=0', '-p', 'no:cacheprovider', '-p', 'no:randomly',
             '-W', 'ignore::RuntimeWarning', '--rootdir', str(tmp_path), *args, str(tmp_path)]
  # Each run here ends in seconds; a hang shows as this timeout, not as a slow pass.
  return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=300, check=False)


def test_an_aborted_worker_and_a_stuck_test_each_end_their_worker_and_fail_the_run(tmp_path):
  """One child suite on two workers (each starts JAX through the conftest), a crash on each:

  - a worker that forks a child holding its pipe and then aborts (_ABORTS) is found gone
    by the watch, which kills the holder, and xdist reports the crash;
  - pytest-timeout as the conftest sets it (method 'thread'): a test that never returns,
    here waiting on an event no one sets, is dumped and its worker ended after its limit,
    which xdist reports as that test's crash. ('signal' would raise in Python code only; a
    thread stuck in XLA never runs any.)

  `--dist loadfile` hands the two files to the two workers, one each. Without
  pytest-timeout installed, the stuck test is left out and the other worker passes a test."""
  timeout = importlib.util.find_spec('pytest_timeout') is not None
  (tmp_path / 'conftest.py').write_text(_CONFTEST)
  (tmp_path / 'test_aborts.py').write_text(textwrap.dedent(_ABORTS))
  if timeout:
    (tmp_path / 'test_stuck.py').write_text(
        'import threading\n\ndef test_waits_forever():\n  threading.Event().wait()\n')
  else:
    (tmp_path / 'test_other.py').write_text('def test_passes():\n  pass\n')
  holder = tmp_path / 'holder.pid'
  try:
    # The holder sleeps 1 h; the aborting test takes microseconds before its abort.
    child = _pytest(tmp_path, *(['--timeout=3'] if timeout else []),
                    env={'HOLDER_PID_FILE': str(holder)})
  finally:
    if holder.exists():  # the watch kills it; this is for a failing run only
      try:
        os.kill(int(holder.read_text()), signal.SIGKILL)
      except (OSError, ValueError):
        pass
  out = child.stdout + child.stderr
  assert child.returncode == 1, out[-4000:]
  assert "crashed while running 'test_aborts.py::test_forks_then_aborts'" in out, out[-4000:]
  assert 'killing them so xdist reports the crash' in out, out[-4000:]
  # A crash, not a reported timeout failure: the worker was ended ('signal' would report
  # 'Failed: Timeout' from a worker that lives on).
  stuck = "crashed while running 'test_stuck.py::test_waits_forever'"
  assert not timeout or stuck in out, out[-4000:]
