"""run(config, workdir): wires config -> mesh -> model/optimizer -> state -> loop.

Everything that can be wrong with the input is checked before anything is
compiled or written; the loop itself only steps, logs and evaluates.
"""

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from dist_ens import configuration, data, distributed, mesh as mesh_lib, models, optim, report
from dist_ens.errors import ConfigError
from dist_ens.evaluate import evaluate, make_eval_step, member_mask_from_frozen
from dist_ens.step import TrainState, init_state, make_train_step

# Multi-device CPU collectives deadlock when ~30 steps are queued (seen with XLA's
# CPU backend); waiting every 8 steps keeps well clear of that.
_CPU_SYNC_EVERY = 8


def _prepare_workdir(workdir: Path, config_dict: dict[str, Any]) -> None:
  """Refuses a workdir that holds a different run; then creates it and saves the config."""
  saved = workdir / 'config.json'
  if saved.exists():
    import json  # pylint: disable=g-import-not-at-top
    diff = configuration.differences(json.loads(saved.read_text()), config_dict)
    if diff:
      raise ConfigError(
          f'workdir {workdir} holds a run with a different config (differing fields: '
          f'{", ".join(diff)}); use a new --workdir.')
  if report.is_writer():
    workdir.mkdir(parents=True, exist_ok=True)
    report.write_json(saved, config_dict)


def _log(msg: str) -> None:
  prefix = f'[process {jax.process_index()}] ' if jax.process_count() > 1 else ''
  logging.info('%s%s', prefix, msg)


def run(config: ml_collections.ConfigDict, workdir: str, *,
        devices: Sequence[jax.Device] | None = None) -> dict[str, Any]:
  """Trains config.num_members members as one program and returns the final metrics.

  Args:
    config: a config like configs/default.py's.
    workdir: where config.json, metrics.jsonl and final_metrics.json go.
    devices: the devices to build the mesh from (default: all of them).

  Returns:
    The final_metrics.json content: per-member and ensemble test metrics.

  Raises:
    ConfigError: before anything is compiled or written, for an invalid config,
      a mesh that does not fit the devices, M or the batch, or a workdir that holds
      a different run.
  """
  configuration.validate(config)
  distributed.check_same_config(configuration.to_dict(config))
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  mesh_lib.check_divisibility(mesh, config.num_members, config.data.batch_size)
  dataset = data.load_dataset(config.data.name)
  if config.data.batch_size > len(dataset.train.y):
    raise ConfigError(f'config.data.batch_size={config.data.batch_size} exceeds the '
                      f'{len(dataset.train.y)} training examples of {dataset.name}.')
  model = models.get_model(config.model, dataset.num_classes)
  tx = optim.make_optimizer(config.optim, config.train.steps)
  init = lambda: init_state(model, tx, config.seed, config.num_members, dataset.input_shape)
  jax.eval_shape(init)  # Model/data mismatches surface here, before any file is written.

  workdir = Path(workdir)
  _prepare_workdir(workdir, configuration.to_dict(config))
  _log(f'mesh {dict(mesh.shape)} over {mesh.size} {mesh.devices.flat[0].platform} devices, '
       f'{jax.process_count()} process(es); {config.num_members} x {config.model.name} on '
       f'{dataset.name}')

  # Born sharded: each device materialises only its own members.
  state: TrainState = jax.jit(init, out_shardings=mesh_lib.member_sharding(mesh))()
  train_step = make_train_step(model, tx, mesh, config.train.label_smoothing)
  eval_step = make_eval_step(model, mesh)
  # Gathers small per-member results to every host before they are read.
  fetch = jax.jit(lambda tree: tree, out_shardings=mesh_lib.replicated(mesh))

  batches = data.BatchIterator(dataset.train, config.data.batch_size, config.seed)
  batch_sharding = mesh_lib.batch_sharding(mesh)
  steps, log_every = config.train.steps, config.train.log_every
  sync_every = config.train.sync_every or (
      _CPU_SYNC_EVERY if mesh.devices.flat[0].platform == 'cpu' and mesh.size > 1 else 0)
  examples_per_step = config.num_members * config.data.batch_size
  writer = report.JsonlWriter(workdir / 'metrics.jsonl')

  def evaluate_test(state):
    return evaluate(eval_step, state.params, dataset.test, config.eval.batch_size, mesh,
                    member_mask_from_frozen(state.frozen))

  interval, interval_start, train_seconds, reported_frozen = [], time.perf_counter(), 0.0, set()
  for step in range(1, steps + 1):
    x, y = next(batches)
    state, step_metrics = train_step(
        state, data.to_global(x, batch_sharding), data.to_global(y, batch_sharding))
    interval.append(step_metrics)
    if sync_every and step % sync_every == 0:
      jax.block_until_ready(step_metrics)

    if step % log_every == 0 or step == steps:
      fetched = jax.tree.map(np.asarray, fetch(interval))
      elapsed = time.perf_counter() - interval_start
      train_seconds += elapsed
      loss = np.mean([m.loss for m in fetched], axis=0)
      accuracy = np.mean([m.accuracy for m in fetched], axis=0)
      rate = examples_per_step * len(interval) / elapsed
      eta = train_seconds / step * (steps - step)
      _log(report.progress_line(step, steps, loss, accuracy, rate, eta))
      writer.write({'step': step, 'split': 'train',
                    'members': {'loss': loss.tolist(), 'accuracy': accuracy.tolist()},
                    'member_examples_per_s': rate})
      for i in np.flatnonzero(np.any([m.nonfinite for m in fetched], axis=0)):
        if i not in reported_frozen:
          reported_frozen.add(int(i))
          logging.warning('member %d hit a non-finite loss or gradient by step %d and is '
                          'frozen; the other members train on.', i, step)
      interval = []
      interval_start = time.perf_counter()

    eval_every = config.train.eval_every
    if eval_every and step % eval_every == 0 and step != steps:
      results = evaluate_test(state)
      writer.write({'step': step, 'split': 'test', **results})
      _log(f'step {step} test: ensemble accuracy {results["ensemble"]["accuracy"]:.4f} '
           f'nll {results["ensemble"]["nll"]:.4f}; member mean accuracy '
           f'{np.mean(results["members"]["accuracy"]):.4f}')
      interval_start = time.perf_counter()  # Eval time is not train time.

  results = evaluate_test(state)
  writer.write({'step': steps, 'split': 'test', **results})
  writer.close()
  frozen = np.flatnonzero(np.asarray(fetch(state.frozen))).tolist()
  final = {'step': steps, 'num_members': config.num_members, **results,
           'frozen_members': frozen, 'train_step_traces': train_step.traces,
           'train_seconds': train_seconds}
  report.write_json(workdir / 'final_metrics.json', final)
  _log('final test metrics:\n' + report.results_table(final))
  return final
