"""Calibration: which member form is fastest for THIS device and model, measured.

`member_parallelism='auto'` falls back on rules measured on the machines the
project was benchmarked on (parallel/strategy.py). `dist-ens plan --calibrate`
replaces them for one run's shape: it times one train step of every candidate
form (vmap; 'map', one member at a time; 'map' over chunks of 2, 4, ... vmapped
members) side by side on the present device, and caches the fastest under a key
of what the timing depends on: the platform and device kind, the model config,
precision, optimizer, members per device and each device's batch. Every later
'auto' run with the same key uses the cached form; an explicit 'vmap' or 'map'
is never overridden.

The cache is dist_ens/parallel/form_cache.py's.
"""

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from dist_ens.run.member_forms import form_key as run_key, members_per_device
from dist_ens.parallel.form_cache import CACHE_ENV, cache_path, lookup, store
from dist_ens.parallel.mesh import batch_sharding
from dist_ens.parallel.strategy import Form

__all__ = ['CACHE_ENV', 'cache_path', 'calibrate', 'candidates', 'label', 'lookup', 'members_per_device',
           'run_key', 'step_runner', 'time_forms']


def candidates(members_per_device: int) -> list[Form]:
  """vmap, 'map' one at a time, and 'map' over chunks of 2, 4, ... (< members)."""
  forms: list[Form] = [('vmap', None)]
  if members_per_device > 1:
    forms.append(('map', None))
    chunk = 2
    while chunk < members_per_device:
      forms.append(('map', chunk))
      chunk *= 2
  return forms


def label(form: Form) -> str:
  return form[0] if form[1] is None else f'{form[0]} (chunks of {form[1]})'


def time_forms(run_step: Callable[[Form], Callable[[], Any]], forms: list[Form],
               steps: int = 5, rounds: int = 3,
               clock: Callable[[], float] = time.perf_counter) -> dict[Form, float]:
  """Median seconds per step of every form, timed in rotating rounds (side by side).

  `run_step(form)` compiles that form's step and returns a function that runs one
  step and waits for it; the first call of each (compilation) is not timed.
  """
  runners = {form: run_step(form) for form in forms}
  for run in runners.values():
    run()
  times: dict[Form, list[float]] = {form: [] for form in forms}
  for _ in range(rounds):
    for form, run in runners.items():
      start = clock()
      for _ in range(steps):
        run()
      times[form].append((clock() - start) / steps)
  return {form: statistics.median(t) for form, t in times.items()}


def step_runner(parts: Any, batch_size: int, per_member_batches: bool
                ) -> Callable[[Form], Callable[[], Any]]:
  """run_step(form) for time_forms: the run's own step on zero batches."""
  from dist_ens import data  # pylint: disable=g-import-not-at-top
  from dist_ens.run import assemble, initial_state
  mesh, m = parts.mesh, parts.abstract_state.frozen.shape[0]
  lead = (m, batch_size) if per_member_batches else (batch_size,)
  sharding = batch_sharding(mesh, per_member_batches)
  x = data.to_global(np.zeros((*lead, *parts.input_shape), parts.input_dtype), sharding)
  y = data.to_global(np.zeros(lead, np.int32), sharding)
  hparams = parts.device_hparams()

  def run_step(form: Form) -> Callable[[], Any]:
    step = assemble.build_step(parts, per_member_batches=per_member_batches, form=form)
    state = [initial_state.init_sharded(parts)]
    index = (data.to_global(np.zeros(lead, np.int32), sharding),) if step.uses_index else ()

    def run():
      state[0], metrics = step(state[0], hparams, x, y, *index)
      jax.block_until_ready(metrics)

    return run

  return run_step


def calibrate(parts: Any, batch_size: int, per_member: bool = False, model_name: str = '',
              steps: int = 5, rounds: int = 3, clock: Callable[[], float] = time.perf_counter
              ) -> tuple[Form, dict[Form, float]]:
  """Times every candidate form of this run's step (`batch_size` examples per member,
  one batch per member where `per_member`, i.e. a member order other than 'shared') and
  caches the fastest (see the module doc), noted as `model_name`'s. Returns (the fastest
  form, seconds per step of each)."""
  seconds = time_forms(step_runner(parts, batch_size, per_member),
                       candidates(members_per_device(parts)), steps, rounds, clock)
  best = min(seconds, key=seconds.get)
  device = parts.mesh.devices.flat[0]
  store(run_key(parts, batch_size), best, {label(f): s for f, s in seconds.items()},
        about=f'{model_name or "model"} on {device.device_kind}, '
              f'{members_per_device(parts)} members per device')
  return best, seconds
