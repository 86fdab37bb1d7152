"""Where a test run's CPU goes: XLA compiles, tracing, lowering, per program name.

Put this folder on PYTHONPATH; every Python process of the run (pytest's workers and the
processes tests start) then appends one JSON line at exit to $COMPILE_PROFILE_OUT
(default /tmp/compile_profile.jsonl): its CPU seconds and jax.monitoring's durations
(backend compile, jaxpr tracing, MLIR lowering, per program 'F:jit(name)'), and event
counts (persistent-cache hits and misses), and each persistent-cache lookup as
[program, key, hit, compile CPU s] (jax's private compiler module, wrapped: which programs a
process compiled, read back after compiling them itself, or read from another process's
entries). Summarise with
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
_KEYS = []  # [program, persistent-cache key, hit, compile CPU s], in lookup order
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


def _record_cache_lookups(compiler):
  """Wraps jax's persistent-cache read and compile-and-write to record each lookup."""
  read, compile_and_write = compiler._cache_read, compiler._compile_and_write_cache

  def cache_read(module_name, cache_key, *args, **kwargs):
    found = read(module_name, cache_key, *args, **kwargs)
    _KEYS.append([module_name, cache_key, found[0] is not None, 0.0])
    return found

  def compile_write(*args):
    start = time.process_time()
    executable = compile_and_write(*args)
    if _KEYS:
      _KEYS[-1][3] = time.process_time() - start
    return executable

  compiler._cache_read, compiler._compile_and_write_cache = cache_read, compile_write


def _listen(module):
  module.register_event_duration_secs_listener(_on_duration)
  module.register_event_listener(_on_event)


_ON_LOAD = {'jax._src.monitoring': _listen, 'jax._src.compiler': _record_cache_lookups}


class _ListenWhenJaxLoads(importlib.abc.MetaPathFinder):
  """Registers the listeners as jax's monitoring and compiler modules are first imported
  (importing jax here would import it in every Python process, before conftest sets
  XLA_FLAGS)."""

  def find_spec(self, name, path, target=None):
    del path, target
    if name not in _ON_LOAD:
      return None
    on_load = _ON_LOAD.pop(name)
    sys.meta_path.remove(self)  # the real spec, not ours
    spec = importlib.util.find_spec(name)
    if _ON_LOAD:
      sys.meta_path.insert(0, self)
    load = spec.loader.exec_module

    def exec_module(module):
      load(module)
      on_load(module)

    spec.loader.exec_module = exec_module
    return spec


def _write():
  if not _COUNTS:
    return  # a process that never imported jax
  now = os.times()
  record = {'pid': os.getpid(), 'argv': sys.argv[:3], 'wall': time.time() - _START,
            'cpu': now.user + now.system - _CPU.user - _CPU.system,
            'seconds': dict(_SECONDS), 'counts': dict(_COUNTS), 'keys': _KEYS}
  with open(os.environ.get('COMPILE_PROFILE_OUT', '/tmp/compile_profile.jsonl'), 'a') as f:
    f.write(json.dumps(record) + '\n')


sys.meta_path.insert(0, _ListenWhenJaxLoads())
atexit.register(_write)
