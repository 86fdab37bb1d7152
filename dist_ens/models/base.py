"""The single-member model interface and the initialisers the models share."""

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from dist_ens.errors import ConfigError

Params = Any


class InitFn(Protocol):

  def __call__(self, rng: jax.Array, input_shape: tuple[int, ...],
               init_scale: float | jax.Array | None = None) -> Params:
    ...


class ApplyFn(Protocol):

  def __call__(self, params: Params, x: jax.Array, train: bool = False,
               rng: jax.Array | None = None) -> jax.Array:
    ...


class Model(NamedTuple):
  """A pure model for ONE member.

  init(rng, input_shape, init_scale=None) -> params, where input_shape excludes the
  batch axis; init_scale (a scalar, possibly traced: one per member under vmap)
  overrides config.model.init_scale.
  apply(params, x, train=False, rng=None) -> logits [batch, num_classes] for x of
  shape [batch, *input_shape]; `rng` is only needed by stochastic layers in training.
  """
  init: InitFn
  apply: ApplyFn


def dense_init(rng: jax.Array, fan_in: int, fan_out: int,
               scale: float | jax.Array) -> dict[str, jax.Array]:
  """He-normal weights (suits ReLU), times `scale`; zero bias."""
  std = scale * jnp.sqrt(2.0 / fan_in)
  return {'w': std * jax.random.normal(rng, (fan_in, fan_out), jnp.float32),
          'b': jnp.zeros((fan_out,), jnp.float32)}


def init_scale_picker(config: Any) -> Callable[[float | jax.Array | None], float | jax.Array]:
  """The init scale to use: the one passed to init, else config.model.init_scale.

  When the config holds per-member values (a list or a spec), init must be given
  each member's scale (dist_ens.core.state.init_state does).
  """
  default = config.get('init_scale', 1.0)
  if not isinstance(default, (int, float)) or isinstance(default, bool):
    default = None

  def pick(override):
    scale = default if override is None else override
    if scale is None:
      raise ConfigError('config.model.init_scale holds per-member values; pass init_scale= '
                        "to init (dist_ens's init_state does).")
    return scale

  return pick
