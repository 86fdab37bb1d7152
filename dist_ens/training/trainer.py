"""train(config, workdir): assemble the run, restore or init its state, loop with actions,
write the results.

Everything that can be wrong with the input is checked before anything is
compiled or written (dist_ens.run.assemble traces the state abstractly first).
"""

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from dist_ens import data
from dist_ens.run import assemble, initial_state
from dist_ens.config import agreement, checks, loading, specs
from dist_ens.errors import ConfigError
from dist_ens.errors import TrainingError
from dist_ens.tasks import Loss
from dist_ens.io.checkpoint import Checkpointer, Restored, check_compatible
from dist_ens.core import hparams as hparams_lib
from dist_ens.ensembles import methods
from dist_ens.io import console, run_files, tables, writers
from dist_ens.parallel import xla_flags
from dist_ens.evaluators import (distill, evaluator as evaluator_lib, laplace, posthoc,
                                 predictions as predictions_lib, registry)
from dist_ens.training import actions as actions_lib, workdir as workdir_lib
from dist_ens.training import cadence
# Re-exported: tests reach the step's FLOPs estimate here.
from dist_ens.training.loop import Action, Call, Session, run_loop
from dist_ens.training.preemption import PreemptionWatcher
from dist_ens.core.state import member_flags



def _saved_run(workdir: Path) -> tuple[dict[str, Any] | None, int | None]:
  """(the config the workdir's run was started with, the step of its newest checkpoint).

  The config is config.json's or, if that is missing, the one the newest checkpoint
  carries. (None, None) for a workdir without checkpoints: a run that failed before its
  first one left nothing to resume, so it does not bind the next run.
  """
  meta = workdir_lib.newest_meta(workdir / 'checkpoints')
  if meta is None:
    return None, None
  path = workdir / 'config.json'
  if not path.exists():
    return meta.get('config'), meta['step']
  try:
    return json.loads(path.read_text()), meta['step']
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConfigError(
        f'{path} is not valid JSON ({e}); delete it (the run then reads the config saved in '
        'its newest checkpoint), or use a new --workdir.') from None


def _prepare_workdir(workdir: Path, config: ml_collections.ConfigDict) -> None:
  """Refuses a workdir whose run cannot be resumed with this config; saves the config."""
  config_dict = loading.to_dict(config)
  saved, step = _saved_run(workdir)
  if saved is not None:
    differing = loading.differences(loading.upgrade(saved),
                                          loading.upgrade(config_dict))
    if step > config.train.steps:
      raise ConfigError(
          f'config.train.steps={config.train.steps} but the workdir holds a checkpoint at step '
          f'{step}; train.steps cannot go back (use a new --workdir, or train.steps >= {step}).')
    # A schedule's decay, snapshot cycles and SWAG's start all scale with train.steps.
    shaped = (config.optim.schedule != 'constant'
              or methods.from_spec(specs.method_spec(config)).scales_with_steps)
    check_compatible(differing, config.checkpoint.restore_incompatible,
                     steps_shape_schedule=shaped)
  if run_files.is_writer():
    workdir.mkdir(parents=True, exist_ok=True)
    run_files.write_json(workdir / 'config.json', config_dict)


def _restore_or_init(parts: assemble.Parts, checkpointer: Checkpointer) -> Restored:
  restored = checkpointer.restore(parts.abstract_state)
  if restored is not None:
    logging.info('resuming from the checkpoint at step %d', restored.step)
    return restored
  return Restored(0, initial_state.init_sharded(parts), data.IteratorState(), {})


def default_actions(call: Call, checkpointer: Checkpointer,
                    extra: Sequence[Action] = ()) -> list[Action]:
  """The actions every run has: waiting for the device, the train log, the built-in
  evaluators the run asks for (dist_ens.evaluators.registry, in their order) and
  config.eval.evaluators' own, a profile if asked for, then `extra` (a user's) and the
  checkpoint, in the order they run.

  The checkpoint comes last: a checkpoint at step N then exists only once every event
  of step N is written, so a run killed mid-evaluation resumes from the checkpoint
  before and redoes that evaluation, and no resume can skip an event.
  """
  session = call.session
  spec = session.spec
  sync_every = spec.train.sync_every
  mesh = session.parts.mesh
  if not sync_every and mesh.devices.flat[0].platform == 'cpu' and mesh.size > 1:
    sync_every = cadence.CPU_SYNC_EVERY
  k = session.steps_per_call
  checkpoint = actions_lib.Checkpoint(checkpointer, spec.checkpoint_every)
  out: list[Action] = []
  if sync_every:  # In calls of the step: a call of K steps queues one program, not K.
    out.append(actions_lib.Sync(max(1, sync_every // k) * k))
  out.append(actions_lib.TrainLog(call, checkpoint))
  # The clean test and validation splits through every member once after the last step,
  # for every evaluator; the post-hoc steps' and the joint log-loss' outputs likewise.
  predictions = predictions_lib.SplitPredictions()
  run = evaluator_lib.EvalRun(call, predictions, posthoc.SplitOutputs(predictions))
  for build in [*registry.EVALUATORS.values(), *evaluator_lib.load(spec.eval.evaluators)]:
    out += build(run)
  if spec.train.profile_steps:
    out.append(actions_lib.Profile(spec.train.log_every, spec.train.profile_steps))
  return [*out, *extra, checkpoint]


def _check_and_build(config: ml_collections.ConfigDict, workdir: Path | str,
                     devices: Sequence[jax.Device] | None,
                     dataset: data.Dataset | None, optimizer: Any) -> assemble.Run:
  """Everything that can be wrong with the input, found before anything is written."""
  loading.check_known_fields(config)
  checks.validate(config)
  if not str(workdir).strip():
    raise ConfigError("--workdir is empty; name a directory for the run's files "
                      '(e.g. --workdir=/tmp/run).')
  workdir_lib.check_workdir(workdir)
  agreement.check_same_config(loading.to_dict(config))
  run = assemble.build_run(config, devices=devices, dataset=dataset, optimizer=optimizer)
  posthoc.check(run.spec, run.parts.task, run.parts.method)
  evaluator_lib.load(run.spec.eval.evaluators)  # Each loads, before any work.
  # Refusals, of each stack's method (a member group may have its own).
  for stack in run.parts.stacks:
    laplace.laplace_actions(run.spec.eval, stack.task, stack.method)
    distill.distill_actions(stack.stack.distill, stack.task, stack.method)
  if workdir_lib.newest_intact_step(workdir) is None:  # A resume reads no init_from.
    initial_state.check_init_from(run.parts)
  test = run.data.dataset.test
  if test.num_examples == 0:  # Else evaluation fails after the first steps are trained.
    raise ConfigError(
        f'dataset {run.data.dataset.name!r} (config.data.name={config.data.name!r}) has an '
        'empty test split: the run is evaluated on it; give it at least one example.')
  cadence.check_sync_every(run.spec.train.sync_every, run.parts.mesh)
  writers.check_writer_names(config.writers)
  return run


def _start(run: assemble.Run, workdir: Path, loss: Loss | None,
           extra_writers: Sequence[writers.EventWriter],
           actions: Sequence[Action]) -> tuple[Call, Any, Checkpointer]:
  """Claims the workdir, restores or inits the state, and builds the step, the input
  pipeline and the writers: the loop's Session, and its first Call (the restored step)."""
  config, spec, parts, run_data, form = run.config, run.spec, run.parts, run.data, run.form
  mesh, dataset = parts.mesh, run_data.dataset
  _prepare_workdir(workdir, config)
  logging.info('mesh %s over %d of %s, %s; %s on %s', dict(mesh.shape), mesh.size,
               tables.counted(jax.device_count(), f'{mesh.devices.flat[0].platform} device'),
               tables.counted(jax.process_count(), 'process', 'processes'),
               spec.members_text, dataset.name)
  checkpointer = run.checkpointer(workdir)
  restored = _restore_or_init(parts, checkpointer)
  for stack in parts.stacks if not restored.meta else ():
    if stack.stack.warning is not None:
      logging.warning('%s', stack.stack.warning)
  if restored.meta and 'jsonl' in spec.writers and run_files.is_writer():
    workdir_lib.warn_missing_events(workdir, restored.step, spec.train.log_every)
  if spec.reproducible:
    logging.debug('reproducible mode: each device runs its members one at a time')
    if (message := xla_flags.warning(mesh.devices.flat[0].platform)) is not None:
      logging.warning('%s', message)
  else:
    logging.debug('each device runs its members with %s%s', form[0],
                  f' (chunks of {form[1]})' if form[1] else '')
  k = cadence.steps_per_call(spec, parts, run_data, restored.step, actions)
  if k > 1:
    logging.debug('%d steps per call of the compiled step', k)
  train_step = run.step(k, loss)
  batches = run.batches(restored.data_state, k, with_index=train_step.uses_index)
  writer = writers.MultiWriter(
      writers.make_writer(spec.writers, workdir, restored.step if restored.meta else None),
      *extra_writers)
  session = Session(config=config, spec=spec, parts=parts, run_data=run_data, workdir=workdir,
                    start_step=restored.step, total_steps=spec.train.steps,
                    steps_per_call=k, hparams=parts.device_hparams(),
                    evaluator=run.evaluator(), writer=writer, saved_meta=restored.meta,
                    batches=batches)
  return Call(restored.step, restored.state, None, session), train_step, checkpointer


def train(config: ml_collections.ConfigDict, workdir: str, *,
          devices: Sequence[jax.Device] | None = None,
          actions: Sequence[Action] = (),
          extra_writers: Sequence[writers.EventWriter] = (),
          dataset: data.Dataset | None = None,
          optimizer: Any = None,
          loss: Loss | None = None) -> dict[str, Any]:
  """Trains config.num_members members as one program and returns the final metrics.

  The same call on the same workdir resumes from the newest checkpoint; the result
  equals an uninterrupted run's bit for bit on the same topology.

  Example:
    config = dist_ens.load_config('configs/default.py')
    results = dist_ens.train(config, '/tmp/run')
    results['ensemble']['accuracy']

  Args:
    config: a config like configs/default.py's.
    workdir: where config.json, metrics.jsonl, checkpoints/ and final_metrics.json go.
    devices: the devices to build the mesh from (default: all of them).
    actions: more actions for the loop (see dist_ens.training.loop), run after the
      built-in ones at every step.
    extra_writers: event writers (write(event), close()) besides config.writers'.
    dataset: replaces config.data.name's: e.g. dist_ens.data.from_arrays(...). The
      checkpoints still load with Ensemble.load (they carry the input shape);
      `dist-ens report` needs config.data.name to name a loadable dataset.
    optimizer: replaces config.optim's: an optax GradientTransformation (the same for
      every member) or optimizer(member_hparams) -> GradientTransformation.
    loss: replaces config.train.loss: loss(logits, labels, member_hparams) -> mean loss.

  Returns:
    The final_metrics.json content (per-member and ensemble test metrics), or
    {'preempted': True, 'step': N, 'signal': 'SIGTERM' or 'SIGINT'} if a signal stopped
    the run after saving (the command line then exits 128 + the signal's number).

  Raises:
    ConfigError: before anything is compiled or written, for an invalid config,
      a mesh that does not fit the devices, M or the batch, or a workdir that holds
      a run this config cannot resume.
    TrainingError: a member went non-finite and config.train.on_nonfinite='stop'
      (the state is saved first).
  """
  with _info_logs():
    return _train(config, workdir, devices, actions, extra_writers, dataset, optimizer, loss)


@contextlib.contextmanager
def _info_logs() -> Iterator[None]:
  """Our log lines (progress, evaluations) show when train is called from Python too:
  outside absl's app.run, absl's verbosity hides INFO."""
  before = logging.get_verbosity()
  if before < logging.INFO:
    logging.set_verbosity(logging.INFO)
  try:
    with console.plain_lines_unless_configured(), workdir_lib.quiet_orbax_on_full_disk():
      yield  # Lines plain, not 'INFO:absl:' each; a full disk said once, by disk_full.
  finally:
    logging.set_verbosity(before)


def _train(config, workdir, devices, actions, extra_writers, dataset, optimizer, loss):
  run = _check_and_build(config, workdir, devices, dataset, optimizer)
  try:
    with workdir_lib.lock_workdir(workdir):
      return _train_locked(run, Path(workdir), actions, extra_writers, loss)
  except Exception as e:  # pylint: disable=broad-except  # Only a full disk is translated.
    full = workdir_lib.disk_full(e, workdir)
    if full is None:
      raise
    raise full from None


def _train_locked(run, workdir, actions, extra_writers, loss):
  first, train_step, checkpointer = _start(run, workdir, loss, extra_writers, actions)
  session = first.session
  all_actions: list[Action] = []
  watcher = PreemptionWatcher()
  failed = True
  try:
    all_actions = default_actions(first, checkpointer, actions)
    finished, last = run_loop(first, train_step, session.batches, all_actions,
                              watcher.should_stop)
    if not finished:
      result = _stop_early(last, checkpointer, watcher.signal_name)
    else:
      checkpointer.wait()
    failed = False
  finally:
    _close_all([session.batches.close, session.writer.close, watcher.close,
                *(action.close for action in all_actions), checkpointer.close],
               raise_first=not failed)
  if not finished:
    return result
  return _finish(last, train_step.traces, checkpointer.blocking_seconds)


def _close_all(closers: Sequence[Any], raise_first: bool) -> None:
  """Calls every closer. The first error is raised if `raise_first`; otherwise (the run is
  already failing, e.g. on a full disk whose writers fail to flush again) only logged,
  so it does not hide the error that stopped the run."""
  error = None
  for closer in closers:
    try:
      closer()
    except Exception as e:  # pylint: disable=broad-except
      error = error or e
  if error is not None and raise_first:
    raise error
  if error is not None:
    logging.warning('while stopping: %s: %s', type(error).__name__,
                    str(error).splitlines()[0][:300] if str(error) else '')


def _stop_early(call: Call, checkpointer: Checkpointer, signal_name: str) -> dict[str, Any]:
  done = call.step
  checkpointer.save(done, call.state, call.session.batches.state, force=True,
                    meta=call.session.checkpoint_meta())
  checkpointer.wait()
  signal_name = signal_name or 'SIGTERM'
  logging.info('preempted (%s): saved the checkpoint at step %d and stopped; run the same '
               'command again to resume.', signal_name, done)
  # The signal, so the CLI can exit 128 + its number: a stopped run is no finished one.
  return {'preempted': True, 'step': done, 'signal': signal_name}


def _finish(call: Call, traces: int, checkpoint_seconds: float) -> dict[str, Any]:
  """Writes final_metrics.json and members.csv, logs the tables, returns the results."""
  session = call.session
  spec = session.spec
  frozen = np.flatnonzero(member_flags(session.fetch(call.state.frozen))).tolist()
  results = dict(session.results)
  final = {'step': spec.train.steps, 'num_members': spec.num_members,
           'members': results.pop('members'), 'ensemble': results.pop('ensemble'),
           'frozen_members': frozen, 'train_step_traces': traces,
           'train_seconds': session.train_seconds(),
           'checkpoint_blocking_seconds': checkpoint_seconds}
  varying = hparams_lib.varying(session.parts.hparams)
  if varying:
    final['hyperparameters'] = {f: hparams_lib.as_written(session.parts.hparams[f])
                                for f in varying}
  final.update(results)  # ood, validation, selected, and what user actions added.
  metric = spec.select.metric
  rows = tables.member_rows(final, session.parts.hparams, final.get('validation'), metric,
                            session.parts.task.select_metrics[metric])
  run_files.write_json(session.workdir / 'final_metrics.json', final)
  run_files.write_members_csv(session.workdir / 'members.csv', rows)
  logging.info('final test metrics:\n%s', tables.results_table(final), extra=console.RESULT)
  if varying or spec.select.top_k:
    logging.info('members, best first by %s %s:\n%s',
                 'validation' if 'validation' in final else 'test', metric,
                 tables.members_table(rows, varying), extra=console.RESULT)
  if len(frozen) == spec.num_members:  # Nothing left to ensemble: not a success.
    raise TrainingError(
        f'all {spec.num_members} members went non-finite (the log names the step by which '
        f'each did) and the ensemble is undefined; {session.workdir / "final_metrics.json"} holds '
        'what was measured. Lower optim.learning_rate, or check the data for NaN/inf.')
  return final
