"""After the last step: the dyadic joint log-loss (config.eval.joint_tau; dist_ens.eval.joint).

  JointLogLoss   every member's and the ensemble's mean negative joint log-likelihood of
                 config.eval.joint_batches dyadic batches of tau = config.eval.joint_tau
                 test examples, under 'joint' in final_metrics.json; with a method that
                 collects members (snapshots, SWAG), its predicting members' ensemble too,
                 under 'joint'[method name].

It works from the task's per-example log-likelihood of every member's test outputs
(Task.log_likelihood), so any task that gives one is scored: classification by the
label's probability, regression by the Gaussian density (in the targets' own units, as
its marginal NLL). A task without one is skipped with a log line.
"""

from typing import Any

import numpy as np
from absl import logging

from dist_ens.ensembles import methods
from dist_ens.eval import evaluate, joint
from dist_ens.tasks import Task
from dist_ens.training.loop import Call, PeriodicAction
from dist_ens.evaluators.evaluator import EvalRun
from dist_ens.evaluators.posthoc import SplitOutputs
from dist_ens.core.state import member_flags


class JointLogLoss(PeriodicAction):
  """See the module docstring. The batches depend only on (seed, the test split's size,
  tau, num_batches): the same on any mesh and for any M."""

  def __init__(self, tau: int, num_batches: int, seed: int, cache: SplitOutputs | None = None):
    super().__init__(0, at_end=True)
    self.tau, self.num_batches, self.seed = tau, num_batches, seed
    self.cache = cache or SplitOutputs()

  def run(self, call: Call) -> None:
    session = call.session
    test = session.run_data.dataset.test
    batches = joint.dyadic_batches(len(test.y), self.tau, self.num_batches, self.seed)
    included = ~np.asarray(member_flags(session.fetch(call.state.frozen)), bool)
    if not included.any():  # Every member went non-finite: the run ends saying so.
      logging.info('joint log-loss skipped: no member is in the ensemble.')
      return
    loss = joint.joint_log_loss(_log_likelihood(call, self.cache.get(call, 'test')), batches,
                                included)
    out: dict[str, Any] = {'tau': self.tau, 'kappa': joint.KAPPA, 'batches': self.num_batches,
                           'members': loss.members.tolist(), 'ensemble': loss.ensemble}
    method = session.parts.method
    if method.collects:
      out[method.name] = _method_joint(call, batches)
    session.results['joint'] = out
    if session.writes_final_events:
      session.write({'step': call.step, 'split': 'test_joint',
                     'members': {'joint_nll': loss.members.tolist()},
                     'ensemble': {'joint_nll': loss.ensemble}})
    marginal = session.results.get('ensemble', {}).get('nll')
    logging.info('joint log-loss (tau %d, %d dyadic batches, nats per batch): member mean '
                 '%.4f, ensemble %.4f%s%s', self.tau, self.num_batches,
                 float(np.mean(loss.members[included])), loss.ensemble,
                 '' if marginal is None else f' (tau x marginal NLL: {self.tau * marginal:.4f})',
                 f"; {method.name} {out[method.name]['ensemble']:.4f}" if method.collects else '')


def _log_likelihood(call: Call, outputs: np.ndarray) -> np.ndarray:
  """[M, N] float64 log-likelihood of the test targets, in the targets' own units: a task
  that trains on standardised targets (Task.unscale) has its density rescaled by the
  training targets' std, as its reported NLL is."""
  session = call.session
  ll = np.asarray(session.parts.task.log_likelihood(outputs, session.run_data.dataset.test.y),
                  np.float64)
  scale = session.run_data.scale
  if session.parts.task.unscale is not None and scale is not None:
    ll = ll - np.sum(np.log(np.asarray(scale.y_std, np.float64)))
  return ll


def _method_joint(call: Call, batches: np.ndarray) -> dict[str, Any]:
  """The joint log-loss of the members the run's method predicts with (its ensemble)."""
  session = call.session
  members = methods.predictive_members(session.parts.method, call.state, session.spec.seed,
                                       session.parts.mesh)
  step = evaluate.make_outputs_step(session.parts.predict_model, session.parts.mesh)
  with session.off_clock():
    outputs = evaluate.split_outputs(step, (members.params, members.model_state),
                                     session.run_data.dataset.test, session.spec.eval.batch_size,
                                     session.parts.mesh)
  included = ~np.asarray(member_flags(session.fetch(members.frozen)), bool)
  loss = joint.joint_log_loss(_log_likelihood(call, outputs), batches, included)
  return {'predicting_members': int(included.sum()), 'ensemble': loss.ensemble}


def joint_actions(tau: int, num_batches: int, seed: int, task: Task,
                  cache: SplitOutputs | None = None) -> list[PeriodicAction]:
  """[JointLogLoss] when tau > 0 (config.eval.joint_tau) and `task` gives per-example
  log-likelihoods (Task.log_likelihood); else [] (a default that the task cannot do is
  skipped, with a log line, not refused)."""
  if not tau:
    return []
  if task.log_likelihood is None:
    logging.info('config.eval.joint_tau=%d: task %r gives no Task.log_likelihood; the joint '
                 'log-loss is skipped.', tau, task.name)
    return []
  return [JointLogLoss(tau, num_batches, seed, cache)]


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """[JointLogLoss] with eval.joint_tau (joint_actions), on run.outputs."""
  e = run.spec.eval
  return joint_actions(e.joint_tau, e.joint_batches, run.spec.seed, run.task, run.outputs)
