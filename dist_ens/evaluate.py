"""Evaluation of all members and the ensemble over a whole split, on device.

One jitted step computes the metric sums of a batch for every member at once
(members sharded over 'member', examples over 'data'); the last partial batch is
padded and masked, so every example counts exactly once.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dist_ens import metrics
from dist_ens.data import Split, to_global
from dist_ens.mesh import DATA, batch_sharding, member_sharding, replicated
from dist_ens.models import Model

EvalStep = Callable[..., dict[str, jax.Array]]


def make_eval_step(model: Model, mesh: Mesh) -> EvalStep:
  """(params, x, y, mask, member_mask) -> metric sums of the batch, replicated."""

  def eval_step(params, x, y, mask, member_mask):
    logits = jax.vmap(lambda p: model.apply(p, x, train=False))(params)
    return metrics.eval_sums(logits, y, mask, member_mask)

  data, members = batch_sharding(mesh), member_sharding(mesh)
  return jax.jit(eval_step, in_shardings=(members, data, data, data, members),
                 out_shardings=replicated(mesh))


def evaluate(eval_step: EvalStep, params: Any, split: Split, batch_size: int, mesh: Mesh,
             member_mask: jax.Array) -> dict[str, Any]:
  """Final metrics (see metrics.finalize) of every member and the ensemble on `split`."""
  d = mesh.shape[DATA]
  batch_size = -(-batch_size // d) * d  # Round up so every data shard gets equal rows.
  sharding = batch_sharding(mesh)
  total = None
  for start in range(0, len(split.y), batch_size):
    x, y = split.x[start:start + batch_size], split.y[start:start + batch_size]
    mask = np.ones(len(y), bool)
    if len(y) < batch_size:  # Pad the last batch; masked rows count for nothing.
      pad = batch_size - len(y)
      x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])
      y = np.concatenate([y, np.zeros(pad, y.dtype)])
      mask = np.concatenate([mask, np.zeros(pad, bool)])
    sums = eval_step(params, to_global(x, sharding), to_global(y, sharding),
                     to_global(mask, sharding), member_mask)
    total = sums if total is None else metrics.add_sums(total, sums)
  return metrics.finalize(jax.tree.map(np.asarray, total))


def member_mask_from_frozen(frozen: jax.Array) -> jax.Array:
  """Members in the ensemble: all that are not frozen."""
  return jnp.logical_not(frozen)
