"""Where a test run's CPU goes: XLA compiles, tracing, lowering, per program name.

Put this folder on PYTHONPATH; every Python process of the run (pytest's workers and the
processes tests start) then appends one JSON line at exit to $COMPILE_PROFILE_OUT
(default /tmp/compile_profile.jsonl): its CPU seconds and jax.monitoring's durations
(backend compile, jaxpr tracing, MLIR lowering, per program 'F:jit(name)'), and event
counts (persistent-cache hits and misses). Summarise with
`python tools/compile_profile/summary.py [file]`. docs/testing.md says what it found.

  PYTHONPATH=tools/compile_profile pytest -q tests/test_groups.py
"""

import atexit
import collections
import importlib.abc
import importlib.util
import json
import os
import sys
import time

_START, _CPU = time.time(), os.times()
_SECONDS, _COUNTS = collections.Counter(), collections.Counter()
_COMPILE = '/jax/core/compile/backend_compile_duration'


def _on_duration(event, duration, **kwargs):
  _SECONDS[event] += duration
  _COUNTS[event] += 1
  if event == _COMPILE and 'fun_name' in kwargs:
    _SECONDS['F:' + kwargs['fun_name']] += duration
    _COUNTS['F:' + kwargs['fun_name']] += 1


def _on_event(event, **kwargs):
  del kwargs
  _COUNTS[event] += 1


class _ListenWhenJaxLoads(importlib.abc.MetaPathFinder):
  """Registers the listeners as jax's monitoring module is first imported (importing jax
  here would import it in every Python process, before conftest sets XLA_FLAGS)."""

  def find_spec(self, name, path, target=None):
    del path, target
    if name != 'jax._src.monitoring':
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    load = spec.loader.exec_module

    def exec_module(module):
      load(module)
      module.register_event_duration_secs_listener(_on_duration)
      module.register_event_listener(_on_event)

    spec.loader.exec_module = exec_module
    return spec


def _write():
  if not _COUNTS:
    return  # a process that never imported jax
  now = os.times()
  record = {'pid': os.getpid(), 'argv': sys.argv[:3], 'wall': time.time() - _START,
            'cpu': now.user + now.system - _CPU.user - _CPU.system,
            'seconds': dict(_SECONDS), 'counts': dict(_COUNTS)}
  with open(os.environ.get('COMPILE_PROFILE_OUT', '/tmp/compile_profile.jsonl'), 'a') as f:
    f.write(json.dumps(record) + '\n')


sys.meta_path.insert(0, _ListenWhenJaxLoads())
atexit.register(_write)
