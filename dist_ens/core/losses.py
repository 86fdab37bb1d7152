"""Training losses: functions of (logits, labels, this member's hyperparameters)."""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from dist_ens import importing
from dist_ens.errors import ConfigError

Loss = Callable[[jax.Array, jax.Array, Mapping[str, Any]], jax.Array]


def cross_entropy(logits: jax.Array, labels: jax.Array,
                  label_smoothing: float | jax.Array = 0.0) -> jax.Array:
  """Mean softmax cross-entropy over the batch, with (possibly traced) label smoothing."""
  targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
  return optax.softmax_cross_entropy(logits, targets).mean()


def smoothed_cross_entropy(logits: jax.Array, labels: jax.Array,
                           hparams: Mapping[str, Any]) -> jax.Array:
  """The default loss: cross_entropy with this member's train.label_smoothing."""
  return cross_entropy(logits, labels, hparams.get('train.label_smoothing', 0.0))


# config.train.loss: a name here, or your own by import path 'my_pkg.losses:fn' with
# fn(logits [B, C], labels [B], hparams) -> the mean loss of one member's batch.
LOSSES: dict[str, Loss] = {'cross_entropy': smoothed_cross_entropy}


def loss_for(name: str) -> Loss:
  """The loss config.train.loss names."""
  if importing.is_import_path(name):
    return importing.load_object(name, 'config.train.loss')
  if name not in LOSSES:
    raise ConfigError(f'config.train.loss={name!r}; use one of {sorted(LOSSES)}, or your own '
                      "by import path, 'my_pkg.losses:my_loss'.")
  return LOSSES[name]
