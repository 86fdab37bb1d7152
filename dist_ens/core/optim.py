"""Optimizers from config, with the hyperparameters held in the optimizer state.

`optax.inject_hyperparams` keeps the learning rate, weight decay and b1 (Adam) or
momentum (SGD) as arrays in each member's optimizer state instead of constants baked into the compiled step. The
state is vmapped over members, so every member carries its own values: a sweep
over them is data, not a recompile.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from dist_ens.errors import ConfigError

SCHEDULES = ('constant', 'cosine', 'linear')


def _adam(config: ml_collections.ConfigDict) -> Callable[..., optax.GradientTransformation]:
  def factory(learning_rate, weight_decay, b1):
    # Decoupled weight decay (AdamW); with weight_decay=0 this is Adam.
    return optax.adamw(learning_rate, b1=b1, b2=config.b2, eps=config.eps,
                       weight_decay=weight_decay)
  return factory


def _sgd(config: ml_collections.ConfigDict) -> Callable[..., optax.GradientTransformation]:
  # A momentum of exactly 0 for every member is plain SGD; anything else (including
  # per-member values) keeps a momentum trace whose decay is state.
  plain = isinstance(config.momentum, (int, float)) and config.momentum == 0

  def factory(learning_rate, weight_decay, momentum):
    return optax.chain(
        optax.add_decayed_weights(weight_decay),
        optax.sgd(learning_rate, momentum=None if plain else momentum,
                  nesterov=config.nesterov))
  return factory


# name -> (factory(optim_config) -> (**hyperparameters) -> GradientTransformation,
#          the config fields injected as per-member hyperparameters)
OPTIMIZERS: dict[str, tuple[Callable[[ml_collections.ConfigDict], Callable[..., optax.GradientTransformation]], tuple[str, ...]]] = {
    'adam': (_adam, ('learning_rate', 'weight_decay', 'b1')),
    'sgd': (_sgd, ('learning_rate', 'weight_decay', 'momentum')),
}


def schedule(optim_config: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Multiplier of the learning rate over steps: linear warmup, then the decay named by
  `optim_config.schedule`. It multiplies the member's own (peak) learning rate."""
  warmup = int(optim_config.warmup_steps)
  name = optim_config.schedule
  if name not in SCHEDULES:
    raise ConfigError(f'config.optim.schedule={name!r}; use one of {SCHEDULES}.')
  if not 0 <= warmup <= total_steps:
    raise ConfigError(f'config.optim.warmup_steps={warmup} must be in [0, train.steps={total_steps}].')
  decay_steps = max(total_steps - warmup, 1)
  decay = {
      'constant': optax.constant_schedule(1.0),
      'cosine': optax.cosine_decay_schedule(1.0, decay_steps),
      'linear': optax.linear_schedule(1.0, 0.0, decay_steps),
  }[name]
  if warmup == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, 1.0, warmup), decay], [warmup])


def make_optimizer(optim_config: ml_collections.ConfigDict,
                   total_steps: int) -> optax.GradientTransformation:
  """The optimizer for ONE member; vmap its init/update over members.

  Chain: optional global-norm clipping -> the named optimizer (its per-member
  hyperparameters injected as state) -> the learning-rate schedule multiplier.
  The injected values start as the config's scalars; per-member values (lists,
  sweeps) are put into the state by `set_hyperparams` after init.
  """
  if optim_config.name not in OPTIMIZERS:
    raise ConfigError(
        f'config.optim.name={optim_config.name!r}; use one of {sorted(OPTIMIZERS)}.')
  factory, names = OPTIMIZERS[optim_config.name]
  # Non-scalar fields get NaN until set_hyperparams fills them: forgetting to would
  # freeze every member at step 1 instead of silently training with a wrong value.
  initial = {n: jnp.float32(optim_config[n] if isinstance(optim_config[n], (int, float))
                            else jnp.nan) for n in names}
  base = optax.inject_hyperparams(factory(optim_config))(**initial)
  parts = []
  if optim_config.grad_clip_norm:
    parts.append(optax.clip_by_global_norm(optim_config.grad_clip_norm))
  parts.append(base)
  if optim_config.schedule != 'constant' or optim_config.warmup_steps:
    parts.append(optax.scale_by_schedule(schedule(optim_config, total_steps)))
  return optax.chain(*parts) if len(parts) > 1 else base


def _is_inject_state(node: Any) -> bool:
  return isinstance(node, optax.InjectStatefulHyperparamsState)


def set_hyperparams(opt_state: Any, values: dict[str, jax.Array]) -> Any:
  """Returns ONE member's optimizer state with its injected hyperparameters replaced.

  `values` maps names (e.g. 'learning_rate') to this member's scalars; names the
  optimizer does not inject are ignored. Use inside vmap over members.
  """
  def replace(node):
    if not _is_inject_state(node):
      return node
    new = {k: jnp.asarray(values[k], v.dtype) if k in values else v
           for k, v in node.hyperparams.items()}
    return node._replace(hyperparams=new)
  return jax.tree.map(replace, opt_state, is_leaf=_is_inject_state)
