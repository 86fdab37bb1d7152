"""A pytest plugin that counts what makes a test costly, per test: in-process trainings
(calls of `dist_ens.train` or training.trainer.train that were not refused by a
ConfigError; the refused ones are counted apart), XLA programs
compiled and read from the persistent cache, and child processes started. Unlike wall or
CPU seconds these counts do not depend on the machine or its load, so a change to the
suite's cost can be read from one run (issue 64: "end-to-end runs" in docs/testing.md's
table).

  RUN_COUNT_OUT=/tmp/counts pytest -q          # each test process writes its counts there
  python tests/run_count.py /tmp/counts         # a table of files, costliest first

tests/conftest.py loads this plugin where RUN_COUNT_OUT is set (CI's command then counts
too: `RUN_COUNT_OUT=... bash .ci/run`); elsewhere it is not loaded. It also runs alone, in a
checkout whose conftest does not load it: `PYTHONPATH=tests pytest -q -p run_count`.

A compile is counted where XLA compiled a program (a cache miss); a cache read is a
program the persistent cache (tests/conftest.py) held; both are per process, so an xdist
worker's later tests find what its earlier tests (or the other worker) compiled. A child
process is a `subprocess` start of anything (a test's dist-ens command, a second process
of a multi-process run); its own trainings and compiles are not seen here.
"""

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIELDS = ('trainings', 'refusals', 'compiles', 'cache_reads', 'children')
_COUNTS = collections.defaultdict(lambda: dict.fromkeys(FIELDS, 0))
_current = [None]  # the running test's node id (its fixtures' setup included)


def _count(field):
  if _current[0] is not None:  # not collection, nor xdist's controller starting workers
    _COUNTS[_current[0]][field] += 1


def pytest_configure(config):
  del config
  import jax  # pylint: disable=g-import-not-at-top  (conftest set XLA_FLAGS first)
  from jax import monitoring  # pylint: disable=g-import-not-at-top
  from dist_ens.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from dist_ens.training import trainer  # pylint: disable=g-import-not-at-top
  del jax

  def on_duration(event, duration, **kwargs):
    del duration, kwargs
    if event == '/jax/core/compile/backend_compile_duration':
      _count('compiles')

  def on_event(event, **kwargs):
    del kwargs
    if event == '/jax/compilation_cache/cache_hits':
      _count('cache_reads')

  monitoring.register_event_duration_secs_listener(on_duration)
  monitoring.register_event_listener(on_event)
  inner = trainer._train  # pylint: disable=protected-access

  def counted_train(*args, **kwargs):
    try:
      out = inner(*args, **kwargs)
    except ConfigError:
      _count('refusals')
      raise
    except BaseException:  # a run that failed or was stopped in the middle still ran
      _count('trainings')
      raise
    _count('trainings')
    return out

  trainer._train = counted_train  # pylint: disable=protected-access
  start = subprocess.Popen.__init__

  def counted_start(self, *args, **kwargs):
    _count('children')
    start(self, *args, **kwargs)

  subprocess.Popen.__init__ = counted_start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  _current[0] = item.nodeid
  _COUNTS[item.nodeid]  # pylint: disable=pointless-statement  (a test of no counts is a row too)
  yield
  _current[0] = None


def pytest_sessionfinish(session):
  out = os.environ.get('RUN_COUNT_OUT')
  if not out or not _COUNTS:
    return
  worker = getattr(session.config, 'workerinput', {}).get('workerid', 'main')
  Path(out).mkdir(parents=True, exist_ok=True)
  (Path(out) / f'{worker}.json').write_text(json.dumps(_COUNTS, indent=1, sort_keys=True))


def summary(directory: str) -> str:
  """Per file, the costliest first (trainings, then compiles), and the totals."""
  tests = {}
  for path in sorted(Path(directory).glob('*.json')):
    tests.update(json.loads(path.read_text()))
  files = collections.defaultdict(lambda: dict.fromkeys(FIELDS + ('tests',), 0))
  for nodeid, counts in tests.items():
    row = files[nodeid.split('::')[0]]
    row['tests'] += 1
    for field in FIELDS:
      row[field] += counts[field]
  total = {f: sum(r[f] for r in files.values()) for f in FIELDS + ('tests',)}
  lines = ['| file | tests | trainings | refusals | compiles | cache reads | child processes |',
           '|---|---:|---:|---:|---:|---:|---:|']
  order = sorted(files.items(), key=lambda kv: (-kv[1]['trainings'], -kv[1]['compiles']))
  for name, r in [('all', total), *order]:
    lines.append(f"| {name} | {r['tests']} | {r['trainings']} | {r['refusals']} | "
                 f"{r['compiles']} | {r['cache_reads']} | {r['children']} |")
  return '\n'.join(lines)


if __name__ == '__main__':
  print(summary(sys.argv[1]))
