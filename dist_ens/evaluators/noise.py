"""The homoscedastic regression task's noise level, fitted after training.

config.task='regression_homoscedastic' trains each member's means on the MSE; its predictive
variance is one noise level, which MSE training does not learn. Given a member's means, the
maximum-likelihood level is its mean squared residual (tasks/regression.py). After the last
step this action measures it, per member, on the validation split when there is one (else
on the training split, where it is optimistic: the means were fitted there), and rebuilds
the evaluator with it, so every evaluation that follows (test, held-out parts, shift,
conformal) scores the members' Gaussians N(mean, fitted level). The levels, in the targets'
units and in standardised units, go to final_metrics.json as 'noise_variance'; Ensemble.load
predicts with them.

One level per member, the same for every target dimension in standardised units (for
targets [N, D] it is the mean over dimensions of the squared standardised residual).
"""

import numpy as np
from absl import logging

from dist_ens import data, tasks
from dist_ens.run import assemble
from dist_ens.tasks.regression import dataset_target_dim
from dist_ens.training.loop import Call, PeriodicAction
from dist_ens.evaluators.evaluator import EvalRun


def fitted_levels(call: Call) -> tuple[np.ndarray, str]:
  """Each member's noise variance in standardised units [M], and the split it came from."""
  session = call.session
  split, name = session.run_data.validation, 'validation'
  scale = session.run_data.scale
  # rmse^2 in target units is the mean over dims of (residual * y_std_d)^2.
  y_var = 1.0 if scale is None else float(np.mean(np.square(scale.y_std)))
  rmse = lambda split: np.asarray(session.evaluator.evaluate(call.state, split)['members']['rmse'],
                                  np.float64)
  if split is not None:
    return np.square(rmse(split)) / y_var, name
  train, splits = session.run_data.dataset.train, session.run_data.member_splits
  if session.run_data.split_scales is None:
    return np.square(rmse(data.Split(*train.read(np.arange(train.num_examples))))) / y_var, 'train'
  # Member splits: each member on its split's training rows, in the units it trained in.
  levels, e = np.zeros(session.spec.num_members), splits.members_per_split
  for s, (rows, own) in enumerate(zip(splits.train, session.run_data.split_scales)):
    levels[s * e:(s + 1) * e] = np.square(rmse(data.Split(*own.apply(*train.read(rows)))))[
        s * e:(s + 1) * e] / y_var
  return levels, 'train'



class FitNoise(PeriodicAction):
  """After the last step, before the final evaluations: fit and install the noise levels."""

  def __init__(self):
    super().__init__(0, at_end=True)

  def run(self, call: Call) -> None:
    session = call.session
    with session.off_clock():
      levels, split = fitted_levels(call)
    target_dim = dataset_target_dim(session.run_data.dataset)
    per_member = np.repeat(levels[:, None], target_dim, axis=1).astype(np.float32)
    task = tasks.regression_homoscedastic(target_dim, noise_variance=per_member)
    session.parts = session.parts._replace(task=task)
    session.evaluator = assemble.build_evaluator(session.spec.eval, session.parts,
                                                 session.run_data)
    scale = session.run_data.scale
    y_var = np.ones(target_dim) if scale is None else np.square(np.reshape(scale.y_std, -1))
    session.results['noise_variance'] = {
        'fitted_on': split, 'standardised': levels.tolist(),
        'target_units': (levels[:, None] * y_var[None, :]).tolist()}
    logging.info('homoscedastic noise fitted on %s: std %s (target units)', split,
                 np.round(np.sqrt(levels[:, None] * y_var[None, :])[:, 0], 4).tolist())


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """[FitNoise] for task='regression_homoscedastic', before the final evaluations use it."""
  return [FitNoise()] if run.spec.task == 'regression_homoscedastic' else []
