"""The task extension point: what a member's outputs mean and how they are scored.

A Task is a bundle of pure functions, handed to the parts that need them (the train
step takes `loss` and `batch_metrics`, the evaluator `eval_batch`, `finalize` and
`ood_metrics`); none of those parts knows which task it serves. Classification
(dist_ens.tasks.classification) is one task; a user's is an import path,
`config.task = 'my_pkg.tasks:my_task'`, naming a Task or a function returning one.
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dist_ens.errors import ConfigError

# loss(outputs [B, ...], targets [B, ...], this member's hyperparameters) -> the mean loss.
Loss = Callable[[jax.Array, jax.Array, Mapping[str, Any]], jax.Array]


class Task(NamedTuple):
  """A task's functions (see the module doc). Shapes: B examples, M members.

  Attributes:
    name: what config.task names it (or its import path).
    output_units: dataset -> how many outputs the model gives per example (a
      classifier: the number of classes).
    output_shape: None (one example's outputs are [output units]), or (output units,
      one example's input shape) -> one example's output shape (token classification:
      [T, C], T the input's length); check_outputs holds the model to it. A task that
      gives one is refused by config.ensemble.method='mimo', whose heads split the last
      axis of [B, units] outputs.
    loss: the default training loss (config.train.loss may replace it).
    batch_metrics: (outputs [B, ...], targets [B, ...]) -> {name: the batch's mean}, logged
      per member during training beside the loss.
    check_targets: (targets, dataset, what) -> None; raises ConfigError naming `what`
      for targets this task cannot train on.
    eval_batch: (member outputs [M, B, ...], targets [B], mask [B], member_mask [M]) ->
      an object with `.sums` (additive sums: padding contributes zero) and `.examples`
      (per-example values, last axis B); evaluation runs it inside one jitted step.
    finalize: (summed sums, concatenated examples) -> {'members': ..., 'ensemble': ...}.
    ood_metrics: (in-distribution examples, OOD examples) -> OOD scores.
    select_metrics: {metric: higher is better} that members can be ranked by.
    unscale: None, or (summed sums, the training targets' std) -> the sums in the
      targets' own units: such a task trains on inputs and targets standardised with
      the training split's statistics (regression), and its metrics are reported in
      the original units.
    reframe: None, or (outputs [..., K], scale [D], shift [D]) -> the outputs that
      predict scale * t + shift where `outputs` predict targets t (a standardising task's
      outputs moved from one standardisation to another: run/split_frames.py scores the
      members of several member splits in one).
    predict: None (Ensemble.predict gives class probabilities), or (member outputs
      [M, N, ...], member_mask [M]) -> {name: array} of the ensemble's prediction in the
      units the model predicts (regression: the mixture's mean and variances).
    combine: None, or (member outputs [M, B, ...], member_mask [M]) -> the ensemble's
      outputs [B, ...] in a member's own format (classification: the log of the mean
      probabilities; regression: the mixture's mean and variance), so that a metric
      written for one member's outputs scores the ensemble too (config.eval.metrics),
      and MC dropout combines one member's samples with it. None: eval.mc_samples and
      eval.metrics are refused.
    log_likelihood: None, or (member outputs [M, N, ...], targets [N, ...]) -> [M, N]
      each member's log-likelihood of each example's target, in the units the model
      predicts: numpy on the host, float64; greedy selection (select.method='greedy')
      averages the likelihoods.
      None: greedy selection is refused.
    calibrate: None, or a post-hoc recalibration fitted on validation
      (eval.temperature_scaling): (scorer, validation outputs [M, N, ...], targets,
      test outputs, targets, included [M] bool) -> JSON-able results with 'before' and
      'after' ({'members', 'ensemble'}). None: eval.temperature_scaling is refused.
    conformal: whether a run with a validation split fits conformal sets (a classifier's
      APS over [N, C] probabilities) or intervals (predict's mean and variance) on it;
      False: none are fitted (token classification: no per-position sets yet).
    any_members: whether the outputs of members chosen, repeated, sampled or collected
      after training can be scored. False where the task holds a constant per trained
      member (regression_homoscedastic's noise levels, fitted after training): greedy
      selection, MC dropout, methods that collect members and member groups are refused.
  """
  name: str
  output_units: Callable[[Any], int]
  loss: Loss
  batch_metrics: Callable[[jax.Array, jax.Array], dict[str, jax.Array]]
  check_targets: Callable[[np.ndarray, Any, str], None]
  eval_batch: Callable[..., Any]
  finalize: Callable[[dict[str, Any], Any], dict[str, Any]]
  ood_metrics: Callable[[Any, Any], dict[str, Any]]
  select_metrics: Mapping[str, bool]
  unscale: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None
  reframe: Callable[[jax.Array, Any, Any], jax.Array] | None = None
  predict: Callable[..., dict[str, Any]] | None = None
  combine: Callable[[jax.Array, jax.Array], jax.Array] | None = None
  log_likelihood: Callable[[Any, Any], Any] | None = None
  calibrate: Callable[..., dict[str, Any]] | None = None
  output_shape: Callable[[int, tuple[int, ...]], tuple[int, ...]] | None = None
  conformal: bool = True
  any_members: bool = True

  def example_outputs(self, num_outputs: int, input_shape: tuple[int, ...]) -> tuple[int, ...]:
    """One example's output shape (see output_shape)."""
    if self.output_shape is None:
      return (num_outputs,)
    return tuple(self.output_shape(num_outputs, tuple(input_shape)))


# The steps after training a task may lack, by the config field that asks for each, and
# the Task field each needs (refused before training when it is None).
_NEEDS = (('eval.temperature_scaling', 'calibrate', 'a recalibration'),
          ("select.method='greedy'", 'log_likelihood', "members' likelihoods"),
          ('eval.mc_samples', 'combine', 'a way to combine samples'),
          ('eval.metrics', 'combine', "the ensemble's outputs in a member's format"))


# The steps that score members other than the trained ones, one each (Task.any_members).
_OTHER_MEMBERS = (("select.method='greedy'", 'chosen and repeated'),
                  ('eval.mc_samples', 'sampled'),
                  ('ensemble.method', 'collected while training'))


def check_steps(task: Task, asked: Mapping[str, bool], task_field: str = 'config.task') -> None:
  """One line before training for a step after it that `task` cannot do.

  Args:
    task: the run's task.
    asked: {config field (as _NEEDS and _OTHER_MEMBERS name it): whether the config asks
      for that step}.
    task_field: the config field that named the task.

  Raises:
    ConfigError: naming the step's field and the task's.
  """
  for field, needs, what in _NEEDS:
    if asked.get(field) and getattr(task, needs) is None:
      raise ConfigError(f'config.{field} needs {what} (Task.{needs}), which {task_field}='
                        f'{task.name!r} does not give; turn it off for this task.')
  for field, what in _OTHER_MEMBERS:
    if asked.get(field) and not task.any_members:
      raise ConfigError(f'config.{field} scores members {what}, and {task_field}='
                        f"{task.name!r} holds one constant per trained member (Task."
                        "any_members); turn it off, or use a task without one "
                        "(task='regression' for Gaussian targets).")


def check_outputs(model: Any, input_shape: tuple[int, ...], num_outputs: int,
                  what: str, input_dtype: Any = jnp.float32,
                  example_outputs: tuple[int, ...] | None = None) -> None:
  """One line, before anything runs, for a model whose outputs do not fit the task: in
  evaluation mode a batch of 2 must give [2, *example_outputs] (default [2, num_outputs];
  a MIMO member gives its heads' mean there). `model` is a dist_ens.core.model.Model;
  `what` names its config field; `example_outputs` is Task.example_outputs."""
  def forward(x):  # Traced abstractly: nothing is compiled or run.
    params, state = model.init(jax.random.key(0), x)
    return model.apply(params, state, x, train=False)[0]

  got = tuple(jax.eval_shape(forward, jax.ShapeDtypeStruct((2, *input_shape),
                                                           input_dtype)).shape)
  want = (2, *(example_outputs or (num_outputs,)))
  if got != want:
    raise ConfigError(f'{what} gives outputs of shape {got} for a batch of 2 inputs '
                      f'{tuple(input_shape)}, but the task needs {want} (one row per example, '
                      "the task's output units last).")
