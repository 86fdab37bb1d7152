"""Classification: the model gives logits over classes; members combine as the mean of
their softmax probabilities (dist_ens.eval.metrics defines every metric)."""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dist_ens import data
from dist_ens.eval import metrics, ranks, registry as metric_registry
from dist_ens.tasks import temperature
from dist_ens.tasks.task import Task


def cross_entropy(logits: jax.Array, labels: jax.Array,
                  label_smoothing: float | jax.Array = 0.0) -> jax.Array:
  """Mean softmax cross-entropy over the batch, with (possibly traced) label smoothing."""
  targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
  return optax.softmax_cross_entropy(logits, targets).mean()


def smoothed_cross_entropy(logits: jax.Array, labels: jax.Array,
                           hparams: Mapping[str, Any]) -> jax.Array:
  """The default loss: cross_entropy with this member's train.label_smoothing."""
  return cross_entropy(logits, labels, hparams.get('train.label_smoothing', 0.0))


def accuracy(logits: jax.Array, labels: jax.Array) -> dict[str, jax.Array]:
  """{'accuracy': the fraction of argmax predictions that are right}.

  Logits may carry head axes ([B, H, C]: MIMO): every head is scored against y."""
  labels = labels.reshape(labels.shape + (1,) * (logits.ndim - 2))
  return {'accuracy': jnp.mean(jnp.argmax(logits, -1) == labels)}


def combine(logits: jax.Array, member_mask: jax.Array) -> jax.Array:
  """The ensemble's outputs as logits: log of the included members' mean probabilities
  ([M, B, C] -> [B, C])."""
  weights = member_mask.astype(jnp.float32) / jnp.maximum(jnp.sum(member_mask), 1)
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jax.nn.logsumexp(log_probs, axis=0, b=weights.reshape(-1, *[1] * (logits.ndim - 1)))


def log_likelihood(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """[M, N] float64 each member's log-probability of each example's label, from [M, N, C]
  logits held on the host (computed in float64: greedy selection compares sums of them)."""
  z = np.asarray(logits, np.float64)
  with np.errstate(invalid='ignore'):  # A NaN member stays NaN (and is never picked).
    z = z - np.logaddexp.reduce(z, axis=-1, keepdims=True)
  labels = np.asarray(labels, np.int64)
  return np.take_along_axis(z, np.broadcast_to(labels[None, :, None], (*z.shape[:2], 1)),
                            axis=-1)[..., 0]


def classification() -> Task:
  """The classification task (config.task = 'classification')."""
  return Task(
      name='classification',
      output_units=lambda dataset: dataset.num_classes,
      loss=smoothed_cross_entropy,
      batch_metrics=accuracy,
      check_targets=lambda y, dataset, what: data.check_label_values(y, dataset.num_classes,
                                                                     what),
      eval_batch=metrics.eval_batch,
      finalize=metric_registry.finalize,
      ood_metrics=ranks.ood_metrics,
      combine=combine,
      log_likelihood=log_likelihood,
      calibrate=temperature.temperature_scaling,
      select_metrics={m.name: bool(m.higher_is_better) for m in metric_registry.METRICS
                      if 'members' in m.scopes and m.higher_is_better is not None})
