"""The precision policy: what the model computes in, and what stays float32.

config.precision = 'bfloat16' runs the model's forward and backward pass in bf16:
the floating parameters and inputs are cast to bf16 as the model reads them. The
parameters themselves, the optimizer state, the model state (BatchNorm running
statistics), the logits handed to the loss, the loss, the metrics and checkpoints
stay float32; gradients arrive in float32 through the cast.
"""

from typing import Any

import jax
import jax.numpy as jnp

from dist_ens.core.model import Model

PRECISIONS = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}

PyTree = Any


def compute_dtype(precision: str) -> jnp.dtype:
  """The dtype a precision policy's name ('float32', 'bfloat16') names."""
  if precision not in PRECISIONS:
    raise ValueError(f'precision={precision!r}; use one of {sorted(PRECISIONS)}.')
  return PRECISIONS[precision]


def cast_floating(tree: PyTree, dtype: jnp.dtype) -> PyTree:
  """Every floating leaf of `tree` as `dtype`; other leaves (ints, keys) unchanged."""
  return jax.tree.map(
      lambda a: a.astype(dtype) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a, tree)


def with_precision(model: Model, precision: str) -> Model:
  """`model` computing in `precision`, reading and returning float32 (see the module doc).

  float32 returns the model unchanged (the same program as without a policy).
  """
  dtype = compute_dtype(precision)
  if dtype == jnp.float32:
    return model

  def apply(params, state, x, *, train, rng=None):
    logits, new_state = model.apply(cast_floating(params, dtype), state,
                                    cast_floating(x, dtype), train=train, rng=rng)
    new_state = jax.tree.map(lambda new, old: new.astype(jnp.result_type(old)), new_state, state)
    return logits.astype(jnp.float32), new_state

  return Model(model.init, apply)
