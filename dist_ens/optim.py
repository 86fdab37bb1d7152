"""Optimizers from config, with the hyperparameters held in the optimizer state.

`optax.inject_hyperparams` keeps learning_rate and weight_decay as arrays in each
member's optimizer state instead of constants baked into the compiled step. The
state is vmapped over members, so every member carries its own values: a sweep
over them is data, not a recompile.
"""

from collections.abc import Callable

import jax.numpy as jnp
import ml_collections
import optax

from dist_ens.errors import ConfigError

SCHEDULES = ('constant', 'cosine', 'linear')


def _adam(config: ml_collections.ConfigDict) -> Callable[..., optax.GradientTransformation]:
  def factory(learning_rate, weight_decay):
    # Decoupled weight decay (AdamW); with weight_decay=0 this is Adam.
    return optax.adamw(learning_rate, b1=config.b1, b2=config.b2, eps=config.eps,
                       weight_decay=weight_decay)
  return factory


def _sgd(config: ml_collections.ConfigDict) -> Callable[..., optax.GradientTransformation]:
  def factory(learning_rate, weight_decay):
    return optax.chain(
        optax.add_decayed_weights(weight_decay),
        optax.sgd(learning_rate, momentum=config.momentum or None, nesterov=config.nesterov))
  return factory


# name -> factory(optim_config) -> (learning_rate, weight_decay) -> GradientTransformation
OPTIMIZERS: dict[str, Callable[[ml_collections.ConfigDict], Callable[..., optax.GradientTransformation]]] = {
    'adam': _adam,
    'sgd': _sgd,
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

  Chain: optional global-norm clipping -> the named optimizer (learning rate and
  weight decay injected as state) -> the learning-rate schedule multiplier.
  """
  if optim_config.name not in OPTIMIZERS:
    raise ConfigError(
        f'config.optim.name={optim_config.name!r}; use one of {sorted(OPTIMIZERS)}.')
  base = optax.inject_hyperparams(OPTIMIZERS[optim_config.name](optim_config))(
      learning_rate=jnp.float32(optim_config.learning_rate),
      weight_decay=jnp.float32(optim_config.weight_decay))
  parts = []
  if optim_config.grad_clip_norm:
    parts.append(optax.clip_by_global_norm(optim_config.grad_clip_norm))
  parts.append(base)
  if optim_config.schedule != 'constant' or optim_config.warmup_steps:
    parts.append(optax.scale_by_schedule(schedule(optim_config, total_steps)))
  return optax.chain(*parts) if len(parts) > 1 else base
