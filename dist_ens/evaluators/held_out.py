"""After the last step of a config.data.member_split run: each split's ensemble on its own
held-out examples, and the mean and standard error over splits.

Split s's members (a block of M / S, data/member_split.py) are evaluated together on split
s's held-out part of the training split: the ensemble is theirs alone (a member mask), the
metrics are the task's. Where the task standardises, split s's members trained with
split s's statistics (fitted on its training rows alone: RunData.split_scales) and see
its held-out rows in them, as separate per-split jobs would: the evaluation scores every
member in one frame's units (run/split_frames.py), the metrics come back in the targets'
units. Every split runs the program that predicts the run's test and validation splits
(evaluators/predictions.py), in its batches, with the split's member mask: no evaluation
program of its own. The results go to final_metrics.json under 'member_split':

  {'spec': 'holdout:20', 'splits': 20, 'members_per_split': 5,
   'ensemble':    {metric: {'mean': ..., 'se': ...}},   # over the splits' ensembles
   'member_mean': {metric: {'mean': ..., 'se': ...}},   # over splits, of the mean member
   'members':     {metric: [M values]},                  # each member on its split's part
   'per_split':   [{'held_out': n, 'ensemble': {metric: value}}, ...]}

The split ensembles evaluate all M members on each held-out part and read off their own:
S times the members' work of the smallest program, and one program, not S.
"""

from typing import Any

import numpy as np
from absl import logging

from dist_ens import data
from dist_ens.data.member_split import aggregate
from dist_ens.training.loop import Call, PeriodicAction
from dist_ens.evaluators.evaluator import EvalRun
from dist_ens.evaluators.predictions import SplitPredictions
from dist_ens.core.state import member_flags


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
  return {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}


def evaluate_held_out(call: Call, predictions: SplitPredictions) -> dict[str, Any]:
  """The 'member_split' results of the run in `call` (see the module doc), predicted by
  the run's shared prediction program."""
  session = call.session
  splits: data.MemberSplits = session.run_data.member_splits
  m, e = session.spec.num_members, splits.members_per_split
  frozen = np.asarray(member_flags(session.fetch(call.state.frozen)), bool)
  train, predictor = session.run_data.dataset.train, predictions.evaluator(call)
  members: dict[str, list[float]] = {}
  per_split = []
  for s, held in enumerate(splits.held_out):
    mask = np.zeros(m, bool)
    mask[s * e:(s + 1) * e] = True
    mask &= ~frozen
    split = data.Split(*train.read(held))
    if session.run_data.split_scales is not None:  # The pool is in its units: as test is.
      split = data.Split(*session.run_data.scale.apply(split.x, split.y))
    results = predictor.predict(call.state, split, member_mask=mask).metrics
    for name, values in results['members'].items():
      if np.ndim(values) == 1 and len(values) == m:
        members.setdefault(name, []).extend(np.asarray(values, float)[s * e:(s + 1) * e])
    per_split.append({'held_out': len(held), 'ensemble': _scalars(results['ensemble'])})
  ensemble = {k: aggregate([p['ensemble'][k] for p in per_split])
              for k in per_split[0]['ensemble']}
  member_mean = {k: aggregate([np.mean(v[s * e:(s + 1) * e]) for s in range(splits.count)])
                 for k, v in members.items()}
  return {'spec': splits.spec, 'splits': splits.count, 'members_per_split': e,
          'ensemble': ensemble, 'member_mean': member_mean,
          'members': {k: [float(x) for x in v] for k, v in members.items()},
          'per_split': per_split}


class EvaluateHeldOut(PeriodicAction):
  """After the last step: evaluate_held_out into session.results['member_split'] and a
  log line."""

  def __init__(self, predictions: SplitPredictions):
    super().__init__(0, at_end=True)
    self._predictions = predictions

  def run(self, call: Call) -> None:
    session = call.session
    with session.off_clock():
      results = evaluate_held_out(call, self._predictions)
    session.results['member_split'] = results
    if session.writes_final_events:
      session.write({'step': call.step, 'split': 'held_out', 'member_split': results})
    shown = [k for k in ('accuracy', 'rmse', 'nll') if k in results['ensemble']]
    logging.info('held-out (%s, %d splits): ensemble %s', results['spec'], results['splits'],
                 ', '.join(f"{k} {results['ensemble'][k]['mean']:.4f} +- "
                           f"{results['ensemble'][k]['se']:.4f}" for k in shown))


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """[EvaluateHeldOut] where member splits hold rows out ('blocks:S' holds none)."""
  splits = run.session.run_data.member_splits
  holds_rows_out = splits is not None and any(map(len, splits.held_out))
  return [EvaluateHeldOut(run.predictions)] if holds_rows_out else []
