"""The built-in actions the loop calls (see dist_ens.training.loop for the interface).

  Sync           waits for the device every N calls (multi-device CPU collectives
                 deadlock when ~30 steps are queued)
  Checkpoint     saves every checkpoint.every steps and after the last; runs after
                 every other action, so a checkpoint never precedes its step's events
  TrainLog       train metrics every log_every steps: event, log line, progress bar,
                 and non-finite members (freeze or stop)
  Evaluate       test metrics every eval_every steps and after the last
  ScoreOod       OOD AUROC/AUPR after the last step
  Validate       validation metrics after the last step
  SelectTopK     the ensemble of the k best members by a validation metric
  Profile        a jax.profiler trace of a few steps
"""

import time
from typing import Any

import jax
import numpy as np
from absl import logging

from dist_ens.checkpoint import Checkpointer
from dist_ens.errors import TrainingError
from dist_ens.io import progress as progress_lib, tables
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.training.loop import Context, PeriodicAction
from dist_ens.training.predictions import SplitPredictions
from dist_ens.core.groups import metrics_in_id_order
from dist_ens.core.state import member_flags


class Sync(PeriodicAction):
  """Blocks until the step's results exist every `every` steps."""

  def run(self, ctx: Context) -> None:
    jax.block_until_ready(ctx.metrics)

  def on_end(self, ctx: Context) -> None:
    pass


class Checkpoint(PeriodicAction):
  """Saves the state, the data position and the training time so far.

  Runs after every other action (see trainer.default_actions), so a checkpoint at a
  step exists only once all of that step's events are written. An action that must
  stop the run after this step's save calls `stop_after_save(error)`.
  """

  def __init__(self, checkpointer: Checkpointer, every: int):
    super().__init__(every, at_end=True)
    self.checkpointer = checkpointer
    self._stop: Exception | None = None

  def save(self, ctx: Context, force: bool = True) -> None:
    self.checkpointer.save(ctx.step, ctx.state, ctx.batches.state, force=force,
                           meta=ctx.checkpoint_meta())

  def stop_after_save(self, error: Exception) -> None:
    self._stop = error

  def on_step(self, ctx: Context) -> None:
    if self._stop is not None:
      self.save(ctx)
      self.checkpointer.wait()
      raise self._stop
    super().on_step(ctx)

  def run(self, ctx: Context) -> None:
    self.save(ctx)


class TrainLog(PeriodicAction):
  """Every `every` steps (and at the last): the interval's train metrics as an event and
  a log line, and members newly non-finite reported (and, with on_nonfinite='stop',
  the run saved and stopped)."""

  def __init__(self, ctx: Context, checkpoint: Checkpoint):
    super().__init__(ctx.config.train.log_every)
    self._checkpoint = checkpoint
    self._interval: list[Any] = []
    self._mark = ctx.train_clock()
    self._progress = progress_lib.Progress(ctx.total_steps, ctx.start_step)
    self._reported = set(np.flatnonzero(member_flags(ctx.fetch(ctx.state.frozen))).tolist())
    if self._reported and ctx.config.train.on_nonfinite == 'stop':
      # A resumed run whose members froze before: 'stop' holds every time, not only once.
      raise TrainingError(
          f'members {sorted(self._reported)} went non-finite before step {ctx.step} and '
          "config.train.on_nonfinite='stop'; set on_nonfinite='freeze' to train the others on.")
    self._pipeline_mark = ctx.batches.stats

  def on_step(self, ctx: Context) -> None:
    self._interval.append(ctx.metrics)
    self._progress.update(ctx.step)
    if self.due(ctx.step) or ctx.step == ctx.total_steps:
      self._flush(ctx)

  def on_end(self, ctx: Context) -> None:
    pass

  def _flush(self, ctx: Context) -> None:
    m = ctx.config.num_members
    # Every step's metrics since the last log, [steps, M] (a call gives [K, M]).
    fetched = jax.tree.map(lambda *calls: np.concatenate([c.reshape(-1, m) for c in calls]),
                           *[metrics_in_id_order(ctx.fetch(metrics_))
                             for metrics_ in self._interval])
    now = ctx.train_clock()
    elapsed, self._mark, self._interval = now - self._mark, now, []
    steps = len(fetched.loss)
    loss = fetched.loss.mean(axis=0)
    batch_metrics = {k: v.mean(axis=0) for k, v in fetched.metrics.items()}
    rate = m * ctx.config.data.batch_size * steps / elapsed
    # Examples the input pipeline delivered per step (one batch, or one per member) and
    # could deliver (per second of its busy time; none when its thread made no batch in
    # the interval, having run ahead: an infinite figure is noise in every writer).
    demand = (m if ctx.run_data.order.per_member else 1) * ctx.config.data.batch_size * steps / elapsed
    stats, mark = ctx.batches.stats, self._pipeline_mark
    busy = stats.busy_seconds - mark.busy_seconds
    supply = (stats.examples - mark.examples) / busy if busy > 0 else None
    self._pipeline_mark = stats
    eta = (ctx.train_seconds() - ctx.saved_meta.get('train_seconds', 0.0)) / max(
        ctx.step - ctx.start_step, 1) * (ctx.total_steps - ctx.step)
    ctx.write({'step': ctx.step, 'split': 'train', 'steps_averaged': steps,
               'members': {'loss': loss.tolist(), **{k: v.tolist() for k, v in batch_metrics.items()}},
               'member_examples_per_s': rate, 'input_examples_per_s': demand,
               **({} if supply is None else {'input_pipeline_capacity_per_s': supply})})
    self._progress.update(
        ctx.step, progress_lib.progress_line(ctx.step, ctx.total_steps, loss, batch_metrics,
                                             rate, eta, demand, supply),
        postfix=f'loss {loss.mean():.4f} {progress_lib.metrics_text(batch_metrics)} '
                f'{rate:,.0f} member-ex/s')
    self._check_nonfinite(ctx, fetched.nonfinite)

  def _check_nonfinite(self, ctx: Context, nonfinite: np.ndarray) -> None:
    newly_bad = sorted(set(np.flatnonzero(np.any(nonfinite, axis=0)).tolist()) - self._reported)
    if not newly_bad:
      return
    self._reported.update(newly_bad)
    logging.warning('members %s hit a non-finite loss or gradient by step %d and are frozen at '
                    'their last finite parameters.', newly_bad, ctx.step)
    if ctx.config.train.on_nonfinite == 'stop':  # Once this step's events are written.
      self._checkpoint.stop_after_save(TrainingError(
          f'members {newly_bad} went non-finite by step {ctx.step} and '
          "config.train.on_nonfinite='stop'; saved the checkpoint at step "
          f"{ctx.step}. Set on_nonfinite='freeze' to train the others on."))

  def close(self) -> None:
    self._progress.close()


class Evaluate(PeriodicAction):
  """Test metrics every `every` steps (an event and a log line) and after the last step
  (also the run's results: 'members' and 'ensemble')."""

  def __init__(self, every: int, predictions: SplitPredictions | None = None):
    """`predictions`: the last step's test metrics come from it (shared with the
    decisions after the last step: one pass, one program); None: the evaluator's."""
    super().__init__(every, at_end=True)
    self._predictions = predictions

  def run(self, ctx: Context) -> None:
    final = ctx.step == ctx.total_steps
    test = ctx.run_data.dataset.test
    with ctx.off_clock():
      if final and self._predictions is not None:
        results = self._predictions.predict(ctx, test).metrics
      else:
        results = ctx.evaluator.evaluate(ctx.state, test)
    if final:
      ctx.results.update(results)
    if not final or ctx.writes_final_events:
      ctx.write({'step': ctx.step, 'split': 'test', **results})
    if not final:
      # The task's headline metrics: accuracy for classification, RMSE for regression.
      ens, members = results['ensemble'], results['members']
      keys = [k for k in ('accuracy', 'rmse', 'nll') if k in ens]
      logging.info('step %d test: ensemble %s; member mean %s', ctx.step,
                   ' '.join(f'{k} {ens[k]:.4f}' for k in keys),
                   ' '.join(f'{k} {np.mean(members[k]):.4f}' for k in keys if k in members))


class ScoreOod(PeriodicAction):
  """After the last step: how well the ensemble's uncertainty flags config.eval.ood_dataset."""

  def __init__(self):
    super().__init__(0, at_end=True)

  def run(self, ctx: Context) -> None:
    results = ctx.evaluator.ood(ctx.state, ctx.run_data.dataset.test, ctx.run_data.ood)
    if ctx.writes_final_events:
      ctx.write({'step': ctx.step, 'split': 'ood', **results})
    name = ctx.config.eval.ood_dataset
    ctx.results['ood'] = {'dataset': name, **results}
    ens = results['ensemble']
    logging.info('OOD %s by ensemble entropy: AUROC %.4f AUPR %.4f; by mutual information: '
                 'AUROC %.4f AUPR %.4f', name, ens['auroc_entropy'], ens['aupr_entropy'],
                 ens['auroc_mi'], ens['aupr_mi'])


class Validate(PeriodicAction):
  """After the last step: every member's and the ensemble's validation metrics."""

  def __init__(self, predictions: SplitPredictions | None = None):
    """`predictions`: shared as for Evaluate (conformal sets calibrate on the same pass)."""
    super().__init__(0, at_end=True)
    self._predictions = predictions

  def run(self, ctx: Context) -> None:
    split = ctx.run_data.validation
    ctx.results['validation'] = (ctx.evaluator.evaluate(ctx.state, split)
                                 if self._predictions is None else
                                 self._predictions.predict(ctx, split).metrics)


class SelectTopK(PeriodicAction):
  """After the last step: the test metrics of the ensemble of the k best members, ranked
  by config.select.metric on validation (needs Validate to run first)."""

  def __init__(self):
    super().__init__(0, at_end=True)

  def run(self, ctx: Context) -> None:
    k, metric = ctx.config.select.top_k, ctx.config.select.metric
    frozen = set(np.flatnonzero(member_flags(ctx.fetch(ctx.state.frozen))).tolist())
    rows = tables.member_rows({**ctx.results, 'frozen_members': sorted(frozen),
                               'num_members': ctx.config.num_members}, ctx.parts.hparams,
                              ctx.results.get('validation'), metric,
                              ctx.parts.task.select_metrics[metric])
    chosen = sorted(r['member'] for r in rows[:k] if not r['frozen'])
    mask = np.zeros(ctx.config.num_members, bool)
    mask[chosen] = True
    selected = ctx.evaluator.evaluate(
        ctx.state, ctx.run_data.dataset.test,
        member_mask=jax.device_put(mask, mesh_lib.member_sharding(ctx.parts.mesh)))
    ctx.results['selected'] = {'top_k': k, 'by': f'validation {metric}', 'members': chosen,
                               'ensemble': selected['ensemble']}
    ens = selected['ensemble']
    shown = ' '.join(f'{name} {ens[name]:.4f}' for name in ctx.parts.task.select_metrics
                     if name in ens)  # the task's own: accuracy for classes, rmse for values
    logging.info('ensemble of the %d best members %s by validation %s: test %s', k, chosen,
                 metric, shown)


class Profile(PeriodicAction):
  """A jax.profiler trace (TensorBoard's profile plugin) of `steps` steps after `start`,
  written to workdir/profile."""

  def __init__(self, start: int, steps: int):
    super().__init__(0)
    self._start, self._stop, self._active = start, start + steps, False

  def on_step(self, ctx: Context) -> None:
    if not self._active and self._start <= ctx.step < self._stop:
      jax.block_until_ready(ctx.metrics)
      jax.profiler.start_trace(str(ctx.workdir / 'profile'))
      self._active, self._began = True, time.perf_counter()
    elif self._active and ctx.step >= self._stop:
      self._end(ctx)

  def on_end(self, ctx: Context) -> None:
    if self._active:
      self._end(ctx)

  def _end(self, ctx: Context) -> None:
    jax.block_until_ready(ctx.metrics)
    jax.profiler.stop_trace()
    self._active = False
    logging.info('profiled steps up to %d in %.1f s: %s', ctx.step,
                 time.perf_counter() - self._began, ctx.workdir / 'profile')

  def close(self) -> None:
    if self._active:
      jax.profiler.stop_trace()
      self._active = False
