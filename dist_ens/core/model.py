"""The model contract: what dist_ens needs from ONE member's model.

A model is a pair of pure functions over one member's variables; dist_ens vmaps
them over the member axis itself, so a model never knows it is in an ensemble.

  init(rng, sample_x) -> (params, state)
      rng: a PRNG key; sample_x: a batch of inputs [B, *input_shape] (only its
      shape and dtype matter). params are trained; state holds what is updated in
      training but never by the optimizer (BatchNorm running statistics), {} if
      the model has none.

  apply(params, state, x, *, train, rng=None) -> (logits, new_state)
      x: [B, *input_shape]; logits: [B, num_classes]. With train=True, BatchNorm
      normalises by the statistics of this batch and new_state holds the updated
      running statistics; with train=False it uses the running statistics and
      returns state unchanged. rng drives stochastic layers (dropout) in training;
      it is None in evaluation.

Under dist_ens's global-view step, `x` is a member's WHOLE batch even when it is
split over the 'data' axis of the mesh: a mean over the batch axis is the mean over
all shards (XLA inserts the cross-device reduction), so BatchNorm needs no
axis_name and is the same on any mesh.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

Params = Any
State = Any


class Model(NamedTuple):
  """A pure model for ONE member: init(rng, sample_x) and apply(params, state, x, *, train, rng)."""
  init: Callable[[jax.Array, jax.Array], tuple[Params, State]]
  apply: Callable[..., tuple[jax.Array, State]]


def is_kernel(leaf: Any) -> bool:
  """Whether a parameter is a weight matrix or convolution kernel: at least two axes
  longer than one. Biases and normalisation scales are not, whatever their layout
  ([C], or Haiku's [1, C]). model.init_scale and weight decay act on kernels."""
  return sum(d > 1 for d in leaf.shape) >= 2
