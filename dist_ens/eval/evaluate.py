"""Evaluation of all members and the ensemble over a whole split, on device.

One jitted step computes, for a batch and every member at once (members sharded
over 'member', examples over 'data'), the additive metric sums and the few
per-example values that rank-based metrics need (see dist_ens.eval.metrics). The last
partial batch is padded and masked, so every example counts exactly once: padded
rows add nothing to the sums and are cut from the per-example values on the host.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dist_ens.eval import metrics
from dist_ens.data import Split, to_global
from dist_ens.parallel.mesh import DATA, batch_sharding, member_sharding, replicated
from dist_ens.models import Model

EvalStep = Callable[..., metrics.BatchEval]


class SplitEval(NamedTuple):
  """A whole split's metric sums and its per-example stats (padding removed)."""
  sums: dict[str, np.ndarray]
  examples: metrics.ExampleStats


def member_logits(model: Model, variables: Any, x: jax.Array) -> jax.Array:
  """[M, B, C] logits of every member in evaluation mode (running statistics, no dropout).

  `variables` is (params, model_state), both stacked [M, ...].
  """
  params, model_state = variables
  return jax.vmap(lambda p, s: model.apply(p, s, x, train=False)[0])(params, model_state)


def make_eval_step(model: Model, mesh: Mesh) -> EvalStep:
  """(variables, x, y, mask, member_mask) -> metrics.BatchEval of the batch, replicated.

  `variables` is (params, model_state) of all members, sharded over 'member'.

  Example:
    step = make_eval_step(model, mesh)
    out = step((state.params, state.model_state), x, y, mask, member_mask)
    out.sums['ensemble_correct'], out.examples.entropy.shape
  """

  def eval_step(variables, x, y, mask, member_mask):
    return metrics.eval_batch(member_logits(model, variables, x), y, mask, member_mask)

  data, members = batch_sharding(mesh), member_sharding(mesh)
  return jax.jit(eval_step, in_shardings=(members, data, data, data, members),
                 out_shardings=replicated(mesh))


def evaluate_split(eval_step: EvalStep, variables: Any, split: Split, batch_size: int,
                   mesh: Mesh, member_mask: jax.Array) -> SplitEval:
  """Runs `eval_step` over `split` in batches; the last one is padded and masked.

  Example:
    out = evaluate_split(step, (state.params, state.model_state), dataset.test, 1000, mesh, mask)
    metrics.finalize(out.sums, out.examples)['ensemble']['nll']

  Args:
    eval_step: from make_eval_step.
    variables: (params, model_state) of all members, sharded over 'member'.
    split: the examples (any labels will do where only uncertainty is used).
    batch_size: rounded up to a multiple of the mesh's 'data' axis.
    mesh: the ('member', 'data') mesh `eval_step` was built for.
    member_mask: [M] bool, members in the ensemble, sharded like the state.

  Returns:
    SplitEval with the summed metrics (numpy, float32) and the per-example stats
    of the len(split.y) real examples (numpy).
  """
  if not len(split.y):
    raise ValueError('evaluate_split() got an empty split; it needs at least one example.')
  d = mesh.shape[DATA]
  batch_size = -(-batch_size // d) * d  # Round up so every data shard gets equal rows.
  sharding = batch_sharding(mesh)
  total, examples = None, []
  for start in range(0, len(split.y), batch_size):
    x, y = split.x[start:start + batch_size], split.y[start:start + batch_size]
    valid = len(y)
    mask = np.ones(valid, bool)
    if valid < batch_size:  # Pad the last batch; masked rows count for nothing.
      pad = batch_size - valid
      x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])
      y = np.concatenate([y, np.zeros(pad, y.dtype)])
      mask = np.concatenate([mask, np.zeros(pad, bool)])
    out = eval_step(variables, to_global(x, sharding), to_global(y, sharding),
                    to_global(mask, sharding), member_mask)
    total = out.sums if total is None else metrics.add_sums(total, out.sums)
    examples.append(out.examples)
  # Copied to the host after the loop, so the device never waits on a copy. Padding
  # sits at the end of each batch, on the last (example) axis.
  host = []
  for i, batch_examples in enumerate(examples):
    valid = min(batch_size, len(split.y) - i * batch_size)
    host.append([np.asarray(a)[..., :valid] for a in batch_examples])
  stacked = metrics.ExampleStats(*(np.concatenate(parts, axis=-1) for parts in zip(*host)))
  return SplitEval(jax.tree.map(np.asarray, total), stacked)


def evaluate(eval_step: EvalStep, variables: Any, split: Split, batch_size: int, mesh: Mesh,
             member_mask: jax.Array) -> dict[str, Any]:
  """Final metrics (see metrics.finalize) of every member and the ensemble on `split`.

  Example:
    results = evaluate(step, (state.params, state.model_state), dataset.test, 1000, mesh, mask)
    results['ensemble']['adaptive_ece'], results['members']['accuracy'][0]
  """
  out = evaluate_split(eval_step, variables, split, batch_size, mesh, member_mask)
  return metrics.finalize(out.sums, out.examples)


def evaluate_ood(eval_step: EvalStep, variables: Any, in_split: Split, ood_split: Split,
                 batch_size: int, mesh: Mesh, member_mask: jax.Array) -> dict[str, Any]:
  """How well the ensemble's uncertainty tells `ood_split` from `in_split`.

  OOD is the positive class and higher entropy / mutual information means "more
  likely OOD"; see metrics.ood_metrics for the keys.

  Example:
    ood = evaluate_ood(step, (state.params, state.model_state), dataset.test, noise, 1000, mesh, mask)
    ood['ensemble']['auroc_mi'], ood['members']['auroc_entropy'][0]

  Args:
    eval_step, variables, batch_size, mesh, member_mask: as for evaluate().
    in_split: in-distribution examples (the test split).
    ood_split: out-of-distribution examples of the same input shape; labels unused.

  Returns:
    {'members': {...: [M]}, 'ensemble': {...}} of plain floats (JSON-able).
  """
  if in_split.x.shape[1:] != ood_split.x.shape[1:]:
    raise ValueError(f'evaluate_ood(): OOD inputs have shape {ood_split.x.shape[1:]} but '
                     f'in-distribution inputs {in_split.x.shape[1:]}; they must match.')
  inside = evaluate_split(eval_step, variables, in_split, batch_size, mesh, member_mask)
  outside = evaluate_split(eval_step, variables, ood_split, batch_size, mesh, member_mask)
  return metrics.ood_metrics(inside.examples, outside.examples)


def member_mask_from_frozen(frozen: jax.Array) -> jax.Array:
  """Members in the ensemble: all that are not frozen."""
  return jnp.logical_not(frozen)


class Evaluator:
  """Evaluates a train state on whole splits (see evaluate / evaluate_ood).

  Example:
    evaluator = Evaluator(make_eval_step(model, mesh), mesh, batch_size=1000)
    evaluator.evaluate(state, dataset.test)['ensemble']['nll']
  """

  def __init__(self, eval_step: EvalStep, mesh: Mesh, batch_size: int):
    self.eval_step, self.mesh, self.batch_size = eval_step, mesh, batch_size

  def evaluate(self, state: Any, split: Split, member_mask: jax.Array | None = None
               ) -> dict[str, Any]:
    """Metrics of every member and the ensemble of the non-frozen (or masked-in) members."""
    if member_mask is None:
      member_mask = member_mask_from_frozen(state.frozen)
    # A small split is evaluated in one batch, not padded up to the batch size.
    batch_size = min(self.batch_size, len(split.y))
    return evaluate(self.eval_step, (state.params, state.model_state), split, batch_size,
                    self.mesh, member_mask)

  def ood(self, state: Any, in_split: Split, ood_split: Split) -> dict[str, Any]:
    """AUROC/AUPR of telling `ood_split` from `in_split` by the ensemble's uncertainty."""
    return evaluate_ood(self.eval_step, (state.params, state.model_state), in_split, ood_split,
                        self.batch_size, self.mesh, member_mask_from_frozen(state.frozen))
