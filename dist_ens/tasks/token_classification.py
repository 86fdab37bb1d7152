"""Token classification: a class per position of a sequence (next-token prediction with
the built-in causal token_transformer and config.model.pool='tokens').

One example's inputs are token ids [T]; its outputs are logits [T, C] and its targets
class ids [T] (int), where a target equal to the padding id (PAD_ID, -1) marks a
position that is not scored: the loss, every metric, greedy selection's likelihoods
and temperature scaling leave it out exactly (selected with jnp.where, never weighted by
zero, so whatever the model gives there changes nothing). Inputs keep their own padding
token; only the targets say what is padding. Map yours with `y[y == pad] = -1`, or build
the task with another id: `config.task = 'my_pkg.tasks:my_task'`, where my_task returns
`token_classification(pad_id=0)`.

Every metric is classification's (dist_ens.eval.metrics), per token: the positions of a
batch are scored as if each were an example, so 'nll', 'accuracy', 'brier', 'ece',
'adaptive_ece', 'entropy' (members and ensemble) and the ensemble's 'mutual_information',
'expected_entropy', 'disagreement' and 'pairwise_kl' are means over the split's
non-padding tokens. OOD scores rank sequences by their tokens' mean uncertainty.
Members combine per position as the log of their mean probabilities; Ensemble.predict
gives `probs` [N, T, C], `member_probs` [M, N, T, C], and `entropy` and
`mutual_information` [N, T] (padding positions too: predict has no targets).
"""

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dist_ens.errors import ConfigError
from dist_ens.eval import metrics, ranks, registry as metric_registry
from dist_ens.eval.ranks import ExampleStats
from dist_ens.tasks.classification import classification, combine, log_likelihood as class_ll
from dist_ens.tasks import temperature
from dist_ens.tasks.task import Task

PAD_ID = -1


class TokenStats(NamedTuple):
  """Per-token stats of a batch (ExampleStats' fields, per position), examples on the
  last axis so that the evaluator cuts padded rows there: members' [M, T, B], the
  ensemble's [T, B]; `token` [T, B] is True at the positions that are scored."""
  member_confidence: Any
  member_correct: Any
  member_entropy: Any
  ensemble_confidence: Any
  ensemble_correct: Any
  entropy: Any
  mutual_information: Any
  token: Any


def _tokens_stats(examples: TokenStats) -> ExampleStats:
  """The scored tokens' stats as classification's per-example stats: [M, K] and [K]."""
  keep = np.asarray(examples.token, bool)
  return ExampleStats(*(np.asarray(getattr(examples, f))[..., keep]
                        for f in ExampleStats._fields))


def _sequence_stats(examples: TokenStats) -> ExampleStats:
  """Each sequence's mean over its scored tokens ([M, B] and [B]), for OOD ranking."""
  keep = np.asarray(examples.token, np.float64)
  count = np.maximum(keep.sum(axis=0), 1.0)
  mean = lambda a: np.where(keep > 0, np.asarray(a, np.float64), 0.0).sum(axis=-2) / count
  return ExampleStats(*(mean(getattr(examples, f)) for f in ExampleStats._fields))


def _loss(pad_id: int, logits: jax.Array, targets: jax.Array,
          hparams: Mapping[str, Any]) -> jax.Array:
  """Mean cross-entropy over the batch's non-padding positions (with this member's
  train.label_smoothing)."""
  keep = targets != pad_id
  onehot = jax.nn.one_hot(jnp.where(keep, targets, 0), logits.shape[-1])
  smoothed = optax.smooth_labels(onehot, hparams.get('train.label_smoothing', 0.0))
  nll = optax.softmax_cross_entropy(logits.astype(jnp.float32), smoothed)
  return jnp.sum(jnp.where(keep, nll, 0.0)) / jnp.maximum(jnp.sum(keep), 1)


def _accuracy(pad_id: int, logits: jax.Array, targets: jax.Array) -> dict[str, jax.Array]:
  keep = targets != pad_id
  right = jnp.where(keep, jnp.argmax(logits, -1) == targets, False)
  return {'accuracy': jnp.sum(right) / jnp.maximum(jnp.sum(keep), 1)}


def _check_targets(pad_id: int, y: np.ndarray, dataset: Any, what: str) -> None:
  y = np.asarray(y)
  if not np.issubdtype(y.dtype, np.integer) or y.ndim != 2:
    raise ConfigError(f"{what}: config.task='token_classification' needs integer targets "
                      f'[N, T] (a class per position), got {y.dtype} {y.shape}.')
  bad = (y != pad_id) & ((y < 0) | (y >= dataset.num_classes))
  if bad.any():
    raise ConfigError(f'{what}: {int(bad.sum())} targets lie outside [0, '
                      f'{dataset.num_classes}) and are not the padding id {pad_id} '
                      f'(e.g. {int(y[bad][0])}).')


def _eval_batch(pad_id: int, logits: jax.Array, targets: jax.Array, mask: jax.Array,
                member_mask: jax.Array | None = None) -> metrics.BatchEval:
  """metrics.eval_batch with every position of [M, B, T, C] a row of its own; padded
  rows (mask False) and padding positions are left out exactly."""
  m, b, t, c = logits.shape
  keep = jnp.asarray(mask, bool)[:, None] & (targets != pad_id)
  out = metrics.eval_batch(logits.reshape(m, b * t, c), targets.reshape(b * t),
                           keep.reshape(b * t), member_mask)
  per_token = lambda a: jnp.swapaxes(a.reshape(*a.shape[:-1], b, t), -1, -2)
  return metrics.BatchEval(out.sums, TokenStats(
      *(per_token(a) for a in out.examples), token=keep.T))


def _finalize(sums: dict[str, Any], examples: TokenStats | None = None) -> dict[str, Any]:
  return metric_registry.finalize(sums, None if examples is None else _tokens_stats(examples))


def _ood_metrics(inside: TokenStats, outside: TokenStats) -> dict[str, Any]:
  return ranks.ood_metrics(_sequence_stats(inside), _sequence_stats(outside))


def _log_likelihood(pad_id: int, logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """[M, N]: each member's summed log-probability of a sequence's scored tokens."""
  targets = np.asarray(targets)
  m, n, t, c = np.shape(logits)
  keep = targets != pad_id
  ll = class_ll(np.reshape(logits, (m, n * t, c)), np.where(keep, targets, 0).reshape(-1))
  return np.where(keep[None], ll.reshape(m, n, t), 0.0).sum(axis=-1)


def _scored_tokens(pad_id: int, outputs: np.ndarray, targets: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
  """([M, K, C], [K]): the outputs and targets of the K scored positions."""
  keep = np.asarray(targets).reshape(-1) != pad_id
  flat = np.asarray(outputs).reshape(outputs.shape[0], -1, outputs.shape[-1])
  return flat[:, keep], np.asarray(targets).reshape(-1)[keep]


def _calibrate(pad_id: int, scorer: Any, val: np.ndarray, val_y: np.ndarray, test: np.ndarray,
               test_y: np.ndarray, included: np.ndarray) -> dict[str, Any]:
  """Classification's temperature scaling over the scored tokens."""
  per_token = type(scorer)(metrics.eval_batch, metric_registry.finalize, ranks.ood_metrics)
  return temperature.temperature_scaling(per_token, *_scored_tokens(pad_id, val, val_y),
                                         *_scored_tokens(pad_id, test, test_y), included)


def token_classification(pad_id: int = PAD_ID) -> Task:
  """The token classification task (config.task = 'token_classification'); targets
  equal to `pad_id` are padding (see the module doc)."""
  with_pad = lambda fn: functools.partial(fn, pad_id)
  return Task(
      name='token_classification',
      output_units=lambda dataset: dataset.num_classes,
      output_shape=lambda units, input_shape: (input_shape[0], units),
      loss=with_pad(_loss),
      batch_metrics=with_pad(_accuracy),
      check_targets=with_pad(_check_targets),
      eval_batch=with_pad(_eval_batch),
      finalize=_finalize,
      ood_metrics=_ood_metrics,
      combine=combine,
      log_likelihood=with_pad(_log_likelihood),
      calibrate=with_pad(_calibrate),
      select_metrics=classification().select_metrics,
      conformal=False)
