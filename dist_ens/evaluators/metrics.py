"""The test split's metrics every train.eval_every steps and after the last (Evaluate),
OOD detection after the last (ScoreOod, config.eval.ood_dataset) and the validation
split's metrics (Validate, data.validation_size), every member's and the ensemble's."""

import numpy as np
from absl import logging

from dist_ens.evaluators.evaluator import EvalRun
from dist_ens.evaluators.predictions import SplitPredictions
from dist_ens.training.loop import Call, PeriodicAction


class Evaluate(PeriodicAction):
  """Test metrics every `every` steps (an event and a log line) and after the last step
  (also the run's results: 'members' and 'ensemble')."""

  def __init__(self, every: int, predictions: SplitPredictions | None = None):
    """`predictions`: the last step's test metrics come from it (shared with the
    decisions after the last step: one pass, one program); None: the evaluator's."""
    super().__init__(every, at_end=True)
    self._predictions = predictions

  def run(self, call: Call) -> None:
    session = call.session
    final = call.step == session.total_steps
    test = session.run_data.dataset.test
    with session.off_clock():
      if final and self._predictions is not None:
        results = self._predictions.predict(call, test).metrics
      else:
        results = session.evaluator.evaluate(call.state, test)
    if final:
      session.results.update(results)
    if not final or session.writes_final_events:
      session.write({'step': call.step, 'split': 'test', **results})
    if not final:
      # The task's headline metrics: accuracy for classification, RMSE for regression.
      ens, members = results['ensemble'], results['members']
      keys = [k for k in ('accuracy', 'rmse', 'nll') if k in ens]
      logging.info('step %d test: ensemble %s; member mean %s', call.step,
                   ' '.join(f'{k} {ens[k]:.4f}' for k in keys),
                   ' '.join(f'{k} {np.mean(members[k]):.4f}' for k in keys if k in members))


class ScoreOod(PeriodicAction):
  """After the last step: how well the ensemble's uncertainty flags config.eval.ood_dataset."""

  def __init__(self):
    super().__init__(0, at_end=True)

  def run(self, call: Call) -> None:
    session = call.session
    results = session.evaluator.ood(call.state, session.run_data.dataset.test, session.run_data.ood)
    if session.writes_final_events:
      session.write({'step': call.step, 'split': 'ood', **results})
    name = session.spec.eval.ood_dataset
    session.results['ood'] = {'dataset': name, **results}
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

  def run(self, call: Call) -> None:
    session = call.session
    split = session.run_data.validation
    session.results['validation'] = (session.evaluator.evaluate(call.state, split)
                                     if self._predictions is None else
                                     self._predictions.predict(call, split).metrics)


def evaluate(run: EvalRun) -> list[PeriodicAction]:
  """[Evaluate]: the test split every train.eval_every steps and after the last."""
  return [Evaluate(run.spec.train.eval_every, run.predictions)]


def score_ood(run: EvalRun) -> list[PeriodicAction]:
  """[ScoreOod] with eval.ood_dataset."""
  return [ScoreOod()] if run.session.run_data.ood is not None else []


def validate(run: EvalRun) -> list[PeriodicAction]:
  """[Validate] with data.validation_size > 0."""
  return [Validate(run.predictions)] if run.session.run_data.validation is not None else []
