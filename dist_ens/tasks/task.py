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
    loss: the default training loss (config.train.loss may replace it).
    batch_metrics: (outputs [B, ...], targets [B]) -> {name: the batch's mean}, logged
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
    predict: None (Ensemble.predict gives class probabilities), or (member outputs
      [M, N, ...], member_mask [M]) -> {name: array} of the ensemble's prediction in the
      units the model predicts (regression: the mixture's mean and variances).
    combine: None, or (member outputs [M, B, ...], member_mask [M]) -> the ensemble's
      outputs [B, ...] in a member's own format (classification: the log of the mean
      probabilities; regression: the mixture's mean and variance), so that a metric
      written for one member's outputs scores the ensemble too (config.eval.metrics).
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
  predict: Callable[..., dict[str, Any]] | None = None
  combine: Callable[[jax.Array, jax.Array], jax.Array] | None = None


def check_outputs(model: Any, input_shape: tuple[int, ...], num_outputs: int,
                  what: str, input_dtype: Any = jnp.float32) -> None:
  """One line, before anything runs, for a model whose outputs do not fit the task: in
  evaluation mode a batch of 2 must give [2, num_outputs] (a MIMO member gives its heads'
  mean there). `model` is a dist_ens.core.model.Model; `what` names its config field."""
  x = jnp.zeros((2, *input_shape), input_dtype)

  def forward(key):
    params, state = model.init(key, x)
    return model.apply(params, state, x, train=False)[0]

  got = tuple(jax.eval_shape(forward, jax.random.key(0)).shape)
  want = (2, num_outputs)
  if got != want:
    raise ConfigError(f'{what} gives outputs of shape {got} for a batch of 2 inputs '
                      f'{tuple(input_shape)}, but the task needs {want} (one row per example, '
                      "the task's output units last).")
