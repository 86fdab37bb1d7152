"""The homoscedastic regression task's noise level, fitted after training.

config.task='regression_homoscedastic' trains each member's means on the MSE; its predictive
variance is one noise level, which MSE training does not learn. Given a member's means, the
maximum-likelihood level is its mean squared residual (tasks/regression.py). After the last
step this action measures it, per member, on the validation split when there is one (else
on the training split, where it is optimistic: the means were fitted there), and rebuilds
the evaluator with it, so every evaluation that follows (test, held-out parts, shift,
conformal) scores the members' Gaussians N(mean, fitted level). The levels, in the targets'
units and in standardised units (each member's own: its split's with member splits), go to
final_metrics.json as 'noise_variance'; Ensemble.load predicts with them.

One level per member, the same for every target dimension in standardised units (for
targets [N, D] it is the mean over dimensions of the squared standardised residual).
"""

import numpy as np
from absl import logging

from dist_ens import data, tasks
from dist_ens.run import evaluation
from dist_ens.tasks.regression import dataset_target_dim
from dist_ens.training.loop import Call, PeriodicAction
from dist_ens.evaluators.evaluator import EvalRun


def member_y_std(session, target_dim: int) -> np.ndarray:
  """[M, D] the target std each member's standardised units have: its split's (member
  splits), the training split's, or ones (a task that does not standardise)."""
  run_data, m = session.run_data, session.spec.num_members
  if run_data.split_scales is not None:
    splits = run_data.member_splits
    return np.stack([np.broadcast_to(np.reshape(run_data.split_scales[splits.split_of(i)].y_std,
                                                -1), (target_dim,)) for i in range(m)])
  y_std = np.ones(target_dim) if run_data.scale is None else np.reshape(run_data.scale.y_std, -1)
  return np.broadcast_to(y_std, (m, target_dim)).astype(np.float64)


def fitted_levels(call: Call, y_std: np.ndarray) -> tuple[np.ndarray, str]:
  """Each member's noise variance [M] in its own standardised units (y_std [M, D]: theirs),
  and the split it came from."""
  session = call.session
  split, name = session.run_data.validation, 'validation'
  # rmse^2 in target units is the mean over dims of (residual * y_std_d)^2.
  y_var = np.mean(np.square(y_std), axis=1)
  rmse = lambda split: np.asarray(session.evaluator.evaluate(call.state, split)['members']['rmse'],
                                  np.float64)
  if split is not None:
    return np.square(rmse(split)) / y_var, name
  train, splits = session.run_data.dataset.train, session.run_data.member_splits
  if session.run_data.split_scales is None:
    return np.square(rmse(data.Split(*train.read(np.arange(train.num_examples))))) / y_var, 'train'
  # Member splits: each member on its split's training rows (the pool is in its units;
  # evaluation standardises as it does the test split).
  levels, e = np.zeros(session.spec.num_members), splits.members_per_split
  frame = session.run_data.scale
  for s, rows in enumerate(splits.train):
    levels[s * e:(s + 1) * e] = np.square(rmse(data.Split(*frame.apply(*train.read(rows)))))[
        s * e:(s + 1) * e]
  return levels / y_var, 'train'


class FitNoise(PeriodicAction):
  """After the last step, before the final evaluations: fit and install the noise levels."""

  def __init__(self):
    super().__init__(0, at_end=True)

  def run(self, call: Call) -> None:
    session = call.session
    target_dim = dataset_target_dim(session.run_data.dataset)
    y_std = member_y_std(session, target_dim)
    with session.off_clock():
      levels, split = fitted_levels(call, y_std)
    # In the units evaluation scores the members in, RunData.scale's: the training split's,
    # or with member splits the frame's (run/split_frames.py).
    scale = session.run_data.scale
    frame_std = 1.0 if scale is None else np.reshape(scale.y_std, -1)
    per_member = (levels[:, None] * np.square(y_std / frame_std)).astype(np.float32)
    task = tasks.regression_homoscedastic(target_dim, noise_variance=per_member)
    session.parts = session.parts._replace(task=task)
    session.evaluator = evaluation.build_evaluator(
        session.spec.eval, task, session.parts.predict_model, session.parts.mesh,
        session.run_data)
    target_units = levels[:, None] * np.square(y_std)
    session.results['noise_variance'] = {
        'fitted_on': split, 'standardised': levels.tolist(), 'target_units': target_units.tolist()}
    logging.info('homoscedastic noise fitted on %s: std %s (target units)', split,
                 np.round(np.sqrt(target_units)[:, 0], 4).tolist())


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """[FitNoise] for task='regression_homoscedastic', before the final evaluations use it."""
  return [FitNoise()] if run.spec.task == 'regression_homoscedastic' else []
