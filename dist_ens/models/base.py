"""The single-member model interface and the initialisers the models share."""

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

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
