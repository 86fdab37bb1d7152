"""A plain-JAX MLP with dropout, on dist_ens's model contract directly, trained as an ensemble.

  python -m examples.plain_jax [workdir]     # from the repository root

The factory returns dist_ens.Model(init, apply) (an (init, apply) tuple works too):
  init(rng, sample_x) -> (params, state)
  apply(params, state, x, *, train, rng=None) -> (logits, new_state)
for ONE member; dist_ens vmaps them over the members. rng is the member's step key
in training and None in evaluation.
"""

import math
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

import dist_ens


def make_model(num_classes: int = 10, widths: Sequence[int] = (64, 64),
               dropout_rate: float = 0.1) -> dist_ens.Model:
  """The factory config.model.factory names, called with config.model.kwargs."""
  widths = tuple(widths)

  def init(rng, sample_x):
    sizes = (math.prod(sample_x.shape[1:]), *widths, num_classes)
    keys = jax.random.split(rng, len(sizes) - 1)
    params = [{'w': jax.random.normal(k, (a, b)) * math.sqrt(2.0 / a), 'b': jnp.zeros((b,))}
              for k, a, b in zip(keys, sizes[:-1], sizes[1:])]
    return params, {}

  def apply(params, state, x, *, train, rng=None):
    h = x.reshape(x.shape[0], -1)
    for layer in params[:-1]:
      h = jax.nn.relu(h @ layer['w'] + layer['b'])
    if train and dropout_rate > 0:
      keep = jax.random.bernoulli(rng, 1.0 - dropout_rate, h.shape)
      h = jnp.where(keep, h / (1.0 - dropout_rate), 0.0)
    return h @ params[-1]['w'] + params[-1]['b'], state

  return dist_ens.Model(init, apply)


def main(workdir: str) -> None:
  config = dist_ens.load_config(Path(__file__).parents[1] / 'configs' / 'default.py')
  config.model.factory = 'examples.plain_jax:make_model'
  config.model.kwargs.widths = (64, 64)
  config.num_members = 4
  config.train.steps = 200
  config.train.log_every = 50
  config.train.eval_every = 0
  config.checkpoint.every = 100
  results = dist_ens.train(config, workdir)
  print(f"ensemble test accuracy {results['ensemble']['accuracy']:.3f}")


if __name__ == '__main__':
  main(sys.argv[1] if len(sys.argv) > 1 else '/tmp/dist_ens_plain_jax')
