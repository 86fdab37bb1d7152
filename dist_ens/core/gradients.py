"""One member's loss, batch metrics, gradients and new model state on its batch: whole, or
cut into micro-batches (config.train.micro_batches = K).

With K micro-batches every result is the mean of the K micro-batches' results: the
loss (each micro-batch's mean loss, so the mean over the batch), the accuracy, the
gradients and the model state (each micro-batch starts from the same state, so
BatchNorm's running statistics move by the mean of the micro-batches' statistics).
Micro-batch k's stochastic layers draw from fold_in(key, k).

Two ways to sum them:
  accumulate  (default) a lax.scan over the micro-batches, summed in order: the
              activations of one micro-batch are live at a time. Micro-batch k
              holds examples k, k + K, k + 2K, ... of the batch, so under the
              global view over 'data' each one stays spread over the data devices.
  canonical   (config.reproducible) inside a step that is manual over 'data':
              micro-batch k holds the k-th contiguous block of B/K examples; each
              device computes its own micro-batches one at a time (lax.map) and
              the K results are summed as one balanced binary tree over k, which
              is the same tree however many data devices hold the micro-batches
              (K a power of two, the data axis dividing it). The sum is therefore
              bit-identical on every mesh.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dist_ens.core.model import Model

PyTree = Any


class Objective(NamedTuple):
  """What a member's batch is scored by, from its task (dist_ens.tasks)."""
  loss: Callable[..., jax.Array]  # (outputs, targets, hparams) -> the mean loss, trained on
  metrics: Callable[..., dict[str, jax.Array]]  # (outputs, targets) -> {name: batch mean}


class BatchResult(NamedTuple):
  """One member's results on one (micro-)batch."""
  loss: jax.Array  # [] the mean loss
  metrics: dict[str, jax.Array]  # {name: []} the task's batch metrics (e.g. accuracy)
  grads: PyTree  # the loss's gradient with respect to the params
  model_state: PyTree  # the model state after this batch


# fn(params, model_state, x, y, key, hparams) -> BatchResult
BatchFn = Callable[..., BatchResult]


def batch_fn(model: Model, objective: Objective) -> BatchFn:
  """The results of one forward and backward pass over the whole batch (x, y)."""

  def run(params, model_state, x, y, key, hp):
    def loss_fn(p):
      logits, new_state = model.apply(p, model_state, x, train=True, rng=key)
      return objective.loss(logits, y, hp), (logits, new_state)

    (value, (logits, new_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return BatchResult(value, objective.metrics(logits, y), grads, new_state)

  return run


def _mean(total: BatchResult, k: int) -> BatchResult:
  """A sum of k results -> their mean (integer state leaves, e.g. counters, floor-divided)."""

  def div(a):
    return a // k if jnp.issubdtype(a.dtype, jnp.integer) else a / k

  return jax.tree.map(div, total)


def _strided(a: jax.Array, k: int) -> jax.Array:
  """[B, ...] -> [k, B/k, ...] with row j of micro-batch i being example j * k + i."""
  return jnp.swapaxes(a.reshape(a.shape[0] // k, k, *a.shape[1:]), 0, 1)


def accumulate(fn: BatchFn, k: int) -> BatchFn:
  """`fn` over k strided micro-batches in a lax.scan; the mean of their results.

  A model-state value that no micro-batch changed is kept as it was, bit for bit (a
  randomized prior's frozen network): the mean of k copies, summed in order, may round.
  """
  if k == 1:
    return fn

  def run(params, model_state, x, y, key, hp):
    def body(carry, chunk):
      total, changed = carry
      i, xi, yi = chunk
      result = fn(params, model_state, xi, yi, jax.random.fold_in(key, i), hp)
      changed = jax.tree.map(lambda c, new, old: c | (new != old), changed,
                             result.model_state, model_state)
      return (jax.tree.map(jnp.add, total, result), changed), None

    shapes = jax.eval_shape(fn, params, model_state, x[:x.shape[0] // k], y[:y.shape[0] // k],
                            key, hp)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    unchanged = jax.tree.map(lambda s: jnp.zeros(s.shape, bool), shapes.model_state)
    (total, changed), _ = jax.lax.scan(body, (zeros, unchanged),
                                       (jnp.arange(k), _strided(x, k), _strided(y, k)))
    mean = _mean(total, k)
    return mean._replace(model_state=jax.tree.map(
        lambda c, new, old: jnp.where(c, new, old), changed, mean.model_state, model_state))

  return run


def tree_sum(tree: PyTree) -> PyTree:
  """Sums every leaf over its leading axis (a power of two) as a balanced binary tree:
  neighbours first ((a0 + a1) + (a2 + a3)), a fixed order whatever the layout."""

  def pairwise(a):
    n = a.shape[0]
    if n & (n - 1):
      raise ValueError(f'tree_sum needs a power-of-two leading axis, got {n}.')
    while a.shape[0] > 1:
      a = a[0::2] + a[1::2]
    return a[0]

  return jax.tree.map(pairwise, tree)


def canonical_split(k: int, data_size: int) -> str | None:
  """Why k micro-batches cannot be summed canonically over `data_size` devices, or None:
  both must be powers of two and `data_size` must divide k (the edge says it as the
  config's fields: run/mesh_layout.py)."""
  if data_size & (data_size - 1):
    return f'a data axis of {data_size} devices is not a power of two'
  if k & (k - 1) or k % data_size:
    return f'{k} micro-batches are not a power of two that {data_size} devices divide'
  return None


def canonical(fn: BatchFn, k: int, data_axis: str, data_size: int) -> BatchFn:
  """`fn` over k contiguous micro-batches, summed in one fixed tree on any data split.

  Runs inside a shard_map that is manual over `data_axis` (of `data_size` devices):
  x and y are this device's block of the member's batch, k / data_size micro-batches.
  """
  why = canonical_split(k, data_size)
  if why is not None:
    raise ValueError(f'canonical sums: {why}.')
  local = k // data_size

  def run(params, model_state, x, y, key, hp):
    first = jax.lax.axis_index(data_axis) * local

    def one(chunk):
      i, xi, yi = chunk
      chunk_key = key if k == 1 else jax.random.fold_in(key, first + i)
      return fn(params, model_state, xi, yi, chunk_key, hp)

    chunks = (jnp.arange(local), x.reshape(local, -1, *x.shape[1:]),
              y.reshape(local, -1, *y.shape[1:]))
    partial = tree_sum(jax.lax.map(one, chunks))
    return _mean(tree_sum(jax.lax.all_gather(partial, data_axis)), k)

  return run
