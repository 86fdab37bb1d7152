"""A pytest plugin: each test's and each file's CPU seconds (this process's threads, and
the child processes it waited for), which a loaded machine leaves steadier than wall
times. `PYTHONPATH=tests pytest -q -n 0 -p cpu_durations tests/test_x.py` prints them
after the run (files, then the 40 costliest tests); CPU_DURATIONS_OUT=path.json writes
them too. docs/testing.md's per-file figures come from it."""

import collections
import json
import os
import resource
import time

import pytest

_SECONDS = collections.defaultdict(float)  # (node id, phase) -> CPU s


def _cpu() -> float:
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return time.process_time() + children.ru_utime + children.ru_stime


def _timed(phase):
  @pytest.hookimpl(hookwrapper=True)
  def hook(item):
    start = _cpu()
    yield
    _SECONDS[item.nodeid, phase] += _cpu() - start
  return hook


pytest_runtest_setup = _timed('setup')
pytest_runtest_call = _timed('call')
pytest_runtest_teardown = _timed('teardown')


def pytest_terminal_summary(terminalreporter):
  tests, files = collections.defaultdict(float), collections.defaultdict(float)
  for (nodeid, _), seconds in _SECONDS.items():
    tests[nodeid] += seconds
    files[nodeid.split('::')[0]] += seconds
  write = terminalreporter.write_line
  write(f'CPU s in tests {sum(files.values()):.1f}; the process in all {_cpu():.1f}')
  for name, seconds in sorted(files.items(), key=lambda kv: -kv[1]):
    write(f'FILE {seconds:8.1f} {name}')
  for name, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[:40]:
    write(f'TEST {seconds:8.1f} {name}')
  if os.environ.get('CPU_DURATIONS_OUT'):
    with open(os.environ['CPU_DURATIONS_OUT'], 'w') as out:
      json.dump({'tests': tests, 'files': files, 'process': _cpu()}, out, indent=1)
