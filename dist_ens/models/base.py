"""Initialisers the built-in models share."""

import jax
import jax.numpy as jnp


def dense_init(rng: jax.Array, fan_in: int, fan_out: int,
               scale: float | jax.Array = 1.0) -> dict[str, jax.Array]:
  """He-normal weights (suits ReLU), times `scale`; zero bias."""
  std = scale * jnp.sqrt(2.0 / fan_in)
  return {'w': std * jax.random.normal(rng, (fan_in, fan_out), jnp.float32),
          'b': jnp.zeros((fan_out,), jnp.float32)}
