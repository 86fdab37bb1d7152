"""run(config, workdir): wires config -> mesh -> model/optimizer -> state -> loop.

Everything that can be wrong with the input is checked before anything is
compiled or written; the loop itself only steps, logs, evaluates and checkpoints.
"""

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from dist_ens import configuration, data, models
from dist_ens.parallel import distributed
from dist_ens.core import hparams
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.eval import ood
from dist_ens.core import optim
from dist_ens.parallel import strategy as parallelism_lib
from dist_ens.io import progress as progress_lib, tables, writers
from dist_ens.checkpoint import Checkpointer, check_compatible
from dist_ens.training.preemption import PreemptionWatcher
from dist_ens.errors import ConfigError, TrainingError
from dist_ens.eval.evaluate import evaluate, evaluate_ood, make_eval_step, member_mask_from_frozen
from dist_ens.core.optim import set_hyperparams
from dist_ens.training.step import TrainState, init_state, make_train_step

# Multi-device CPU collectives deadlock when ~30 steps are queued (seen with XLA's
# CPU backend); waiting every 8 steps keeps well clear of that.
_CPU_SYNC_EVERY = 8


def _prepare_workdir(workdir: Path, config: ml_collections.ConfigDict) -> None:
  """Refuses a workdir whose run cannot be resumed with this config; saves the config."""
  config_dict = configuration.to_dict(config)
  saved = workdir / 'config.json'
  if saved.exists():
    differing = configuration.differences(json.loads(saved.read_text()), config_dict)
    check_compatible(differing, config.checkpoint.restore_incompatible)
  if writers.is_writer():
    workdir.mkdir(parents=True, exist_ok=True)
    writers.write_json(saved, config_dict)


def _log(msg: str, *args: Any) -> None:
  # With several processes, distributed.py's log filter adds '[process i]' to every line.
  logging.info(msg, *args)


def run(config: ml_collections.ConfigDict, workdir: str, *,
        devices: Sequence[jax.Device] | None = None) -> dict[str, Any]:
  """Trains config.num_members members as one program and returns the final metrics.

  The same command on the same workdir resumes from the newest checkpoint; the
  result equals an uninterrupted run's bit for bit on the same topology.

  Args:
    config: a config like configs/default.py's.
    workdir: where config.json, metrics.jsonl, checkpoints/ and final_metrics.json go.
    devices: the devices to build the mesh from (default: all of them).

  Returns:
    The final_metrics.json content (per-member and ensemble test metrics), or
    {'preempted': True, 'step': N} if SIGTERM stopped the run after saving.

  Raises:
    ConfigError: before anything is compiled or written, for an invalid config,
      a mesh that does not fit the devices, M or the batch, or a workdir that holds
      a run this config cannot resume.
    TrainingError: a member went non-finite and config.train.on_nonfinite='stop'
      (the state is saved first).
  """
  configuration.validate(config)
  distributed.check_same_config(configuration.to_dict(config))
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  mesh_lib.check_divisibility(mesh, config.num_members, config.data.batch_size)
  member_hparams = hparams.resolve(config)
  dataset = data.load_dataset(config.data.name, config.data)
  validation = None
  if config.data.validation_size:
    train_source, validation = data.split_validation(dataset.train, config.data.validation_size)
    dataset = dataset._replace(train=train_source)
  if config.data.batch_size > dataset.train.num_examples:
    raise ConfigError(f'config.data.batch_size={config.data.batch_size} exceeds the '
                      f'{dataset.train.num_examples} training examples of {dataset.name}.')
  ood_name = config.eval.get('ood_dataset', '')
  ood_split = ood.load_ood_split(ood_name, dataset, config.data) if ood_name else None
  order = data.Order(config.data.member_order, dataset.train.num_examples,
                     config.data.batch_size, config.seed)
  model = models.get_model(config.model, dataset.num_classes)
  parallelism, map_batch_size = parallelism_lib.resolve(
      config.ensemble, config.model.name, mesh.devices.flat[0].platform,
      members_per_device=config.num_members // mesh.shape[mesh_lib.MEMBER],
      member_activation_bytes=lambda: parallelism_lib.activation_bytes(
          model, dataset.input_shape, config.data.batch_size // mesh.shape[mesh_lib.DATA]))
  tx = optim.make_optimizer(config.optim, config.train.steps)
  init = lambda: init_state(model, tx, config.seed, config.num_members, dataset.input_shape,
                            member_hparams)
  member_sharding = mesh_lib.member_sharding(mesh)
  # Model/data mismatches surface here, before any file is written.
  abstract_state = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=member_sharding),
      jax.eval_shape(init))

  workdir = Path(workdir)
  _prepare_workdir(workdir, config)
  _log('mesh %s over %d %s devices, %d process(es); %d x %s on %s', dict(mesh.shape), mesh.size,
       mesh.devices.flat[0].platform, jax.process_count(), config.num_members,
       config.model.name, dataset.name)

  checkpointer = Checkpointer(workdir / 'checkpoints', config.checkpoint.every,
                              config.checkpoint.keep)
  restored = checkpointer.restore(abstract_state)
  optim_hparams = {f.split('.', 1)[1]: v for f, v in member_hparams.items()
                   if f.startswith('optim.')}
  if restored is not None:
    start_step, state, data_state = restored
    # The config's hyperparameters win over the saved ones: identical on a plain
    # resume, the new values where checkpoint.restore_incompatible allowed a change.
    state = jax.jit(lambda s: s._replace(opt_state=jax.vmap(set_hyperparams)(
        s.opt_state, optim_hparams)), donate_argnums=0)(state)
    _log('resuming from the checkpoint at step %d', start_step)
  else:
    start_step, data_state = 0, data.IteratorState()
    # Born sharded: each device materialises only its own members.
    state = jax.jit(init, out_shardings=member_sharding)()

  _log('each device runs its members with %s%s', parallelism,
       f' (chunks of {map_batch_size})' if map_batch_size else '')
  examples_per_step = config.num_members * config.data.batch_size
  # Examples the input pipeline must deliver per step: one batch, or one per member.
  inputs_per_step = examples_per_step if order.per_member else config.data.batch_size
  input_bytes_per_step = inputs_per_step * int(np.prod(dataset.input_shape)) * 4  # float32
  steps_per_call = parallelism_lib.steps_per_call(
      config, mesh.devices.flat[0].platform, start_step, input_bytes_per_step)
  if start_step % steps_per_call:
    raise ConfigError(
        f'config.train.steps_per_call={steps_per_call} does not divide the checkpoint\'s step '
        f'{start_step}; resume with a steps_per_call that divides it (e.g. 1), or 0 (auto).')
  if steps_per_call > 1:
    _log('%d steps per call of the compiled step', steps_per_call)
  train_step = make_train_step(model, tx, mesh, per_member_batches=order.per_member,
                               member_parallelism=parallelism, map_batch_size=map_batch_size,
                               steps_per_call=steps_per_call)
  label_smoothing = jax.device_put(member_hparams['train.label_smoothing'], member_sharding)
  eval_step = make_eval_step(model, mesh)
  # Gathers small per-member results to every host before they are read. Called on
  # one step's metrics at a time: the same shapes every call, so it compiles once (a
  # whole interval as one pytree compiled a program with an input per array, seconds
  # for a few thousand steps).
  fetch = jax.jit(lambda tree: tree, out_shardings=mesh_lib.replicated(mesh))

  batches = data.Batches(dataset.train, order, mesh, config.num_members, data_state,
                         prefetch=config.data.prefetch, steps_per_call=steps_per_call)
  steps, log_every = config.train.steps, config.train.log_every
  sync_every = config.train.sync_every or (
      _CPU_SYNC_EVERY if mesh.devices.flat[0].platform == 'cpu' and mesh.size > 1 else 0)
  # Calls between waits; a call of K steps queues one program, not K.
  sync_calls = max(1, sync_every // steps_per_call) if sync_every else 0
  keep_through_step = start_step if restored else None
  writer = writers.MultiWriter(
      writers.JsonlWriter(workdir / 'metrics.jsonl', keep_through_step=keep_through_step),
      writers.TensorBoardWriter(workdir / 'tensorboard', keep_through_step=keep_through_step))
  progress = progress_lib.Progress(steps, start_step)
  watcher = PreemptionWatcher()

  def evaluate_test(state, split=dataset.test, member_mask=None):
    if member_mask is None:
      member_mask = member_mask_from_frozen(state.frozen)
    # A small split is evaluated in one batch, not padded up to eval.batch_size.
    batch_size = min(config.eval.batch_size, len(split.y))
    return evaluate(eval_step, state.params, split, batch_size, mesh, member_mask)

  reported_frozen = set(np.flatnonzero(np.asarray(fetch(state.frozen))).tolist())
  interval, interval_start, train_seconds = [], time.perf_counter(), 0.0
  pipeline_mark = batches.stats
  try:
    # `step` is the last step a call ran: calls run steps_per_call steps each.
    for step in range(start_step + steps_per_call, steps + 1, steps_per_call):
      done = step - steps_per_call
      if watcher.should_stop(done):
        checkpointer.save(done, state, batches.state, force=True)
        checkpointer.wait()
        _log('preempted (SIGTERM): saved the checkpoint at step %d and stopped; run the same '
             'command again to resume.', done)
        return {'preempted': True, 'step': done}

      x, y = next(batches)
      state, step_metrics = train_step(state, x, y, label_smoothing)
      interval.append(step_metrics)
      progress.update(step)
      checkpointer.save(step, state, batches.state)
      if sync_calls and (step // steps_per_call) % sync_calls == 0:
        jax.block_until_ready(step_metrics)

      if step % log_every == 0 or step == steps:
        # Every step's metrics since the last log, [steps, M] (a call gives [K, M]).
        fetched = jax.tree.map(
            lambda *calls: np.concatenate([np.reshape(c, (-1, config.num_members))
                                           for c in calls]),
            *[jax.tree.map(np.asarray, fetch(m)) for m in interval])
        elapsed = time.perf_counter() - interval_start
        train_seconds += elapsed
        loss, accuracy = fetched.loss.mean(axis=0), fetched.accuracy.mean(axis=0)
        interval_steps = len(fetched.loss)
        rate = examples_per_step * interval_steps / elapsed
        demand = inputs_per_step * interval_steps / elapsed
        stats = batches.stats
        read, busy = stats.examples - pipeline_mark.examples, stats.busy_seconds - pipeline_mark.busy_seconds
        supply = read / busy if busy > 0 else float('inf')
        pipeline_mark = stats
        eta = train_seconds / (step - start_step) * (steps - step)
        progress.update(step, progress_lib.progress_line(step, steps, loss, accuracy, rate, eta,
                                                    demand, supply))
        writer.write({'step': step, 'split': 'train',
                      'members': {'loss': loss.tolist(), 'accuracy': accuracy.tolist()},
                      'member_examples_per_s': rate, 'input_examples_per_s': demand,
                      'input_pipeline_capacity_per_s': supply})
        newly_bad = sorted(set(np.flatnonzero(np.any(fetched.nonfinite, axis=0)).tolist())
                           - reported_frozen)
        if newly_bad:
          reported_frozen.update(newly_bad)
          logging.warning('members %s hit a non-finite loss or gradient by step %d and are '
                          'frozen at their last finite parameters.', newly_bad, step)
          if config.train.on_nonfinite == 'stop':
            checkpointer.save(step, state, batches.state, force=True)
            checkpointer.wait()
            raise TrainingError(
                f'members {newly_bad} went non-finite by step {step} and '
                "config.train.on_nonfinite='stop'; saved the checkpoint at step "
                f'{step}. Set on_nonfinite=\'freeze\' to train the others on.')
        interval = []
        interval_start = time.perf_counter()

      eval_every = config.train.eval_every
      if eval_every and step % eval_every == 0 and step != steps:
        results = evaluate_test(state)
        writer.write({'step': step, 'split': 'test', **results})
        _log('step %d test: ensemble accuracy %.4f nll %.4f; member mean accuracy %.4f', step,
             results['ensemble']['accuracy'], results['ensemble']['nll'],
             np.mean(results['members']['accuracy']))
        interval_start = time.perf_counter()  # Eval time is not train time.

    checkpointer.save(steps, state, batches.state, force=True)
    results = evaluate_test(state)
    ood_results = None
    if ood_split is not None:
      ood_results = evaluate_ood(eval_step, state.params, dataset.test, ood_split,
                                 config.eval.batch_size, mesh,
                                 member_mask_from_frozen(state.frozen))
    checkpointer.wait()
    if restored is None or start_step < steps:
      writer.write({'step': steps, 'split': 'test', **results})
      if ood_results is not None:
        writer.write({'step': steps, 'split': 'ood', **ood_results})
  finally:
    progress.close()
    batches.close()
    writer.close()
    watcher.close()
    checkpointer.close()

  frozen = np.flatnonzero(np.asarray(fetch(state.frozen))).tolist()
  final = {'step': steps, 'num_members': config.num_members, **results,
           'frozen_members': frozen, 'train_step_traces': train_step.traces,
           'train_seconds': train_seconds,
           'checkpoint_blocking_seconds': checkpointer.blocking_seconds}
  if ood_results is not None:
    final['ood'] = {'dataset': ood_name, **ood_results}
    _log('OOD %s by ensemble entropy: AUROC %.4f AUPR %.4f; by mutual information: AUROC %.4f '
         'AUPR %.4f', ood_name, ood_results['ensemble']['auroc_entropy'],
         ood_results['ensemble']['aupr_entropy'], ood_results['ensemble']['auroc_mi'],
         ood_results['ensemble']['aupr_mi'])
  varying = hparams.varying(member_hparams)
  if varying:
    final['hyperparameters'] = {f: member_hparams[f].tolist() for f in varying}
  val_results = evaluate_test(state, validation) if validation is not None else None
  if val_results is not None:
    final['validation'] = val_results
  metric = config.select.metric
  rows = tables.member_rows(final, member_hparams, val_results, metric,
                            configuration.SELECT_METRICS[metric])
  if config.select.top_k:
    chosen = sorted(r['member'] for r in rows[:config.select.top_k] if not r['frozen'])
    mask = np.zeros(config.num_members, bool)
    mask[chosen] = True
    selected = evaluate_test(state, member_mask=jax.device_put(mask, member_sharding))
    final['selected'] = {'top_k': config.select.top_k, 'by': f'validation {metric}',
                         'members': chosen, 'ensemble': selected['ensemble']}
  writers.write_json(workdir / 'final_metrics.json', final)
  writers.write_members_csv(workdir / 'members.csv', rows)
  _log('final test metrics:\n%s', tables.results_table(final))
  if varying or config.select.top_k:
    _log('members, best first by %s %s:\n%s', 'validation' if validation else 'test', metric,
         tables.members_table(rows, varying))
  if 'selected' in final:
    ens = final['selected']['ensemble']
    _log('ensemble of the %d best members %s by validation %s: test accuracy %.4f nll %.4f '
         'ece %.4f', config.select.top_k, final['selected']['members'], metric,
         ens['accuracy'], ens['nll'], ens['ece'])
  return final
