"""An MLP in Haiku, with BatchNorm and Dropout, trained as a dist_ens ensemble.

  python -m examples.haiku_mlp [workdir]     # from the repository root

The factory returns hk.transform_with_state(forward) (or hk.transform for a model
without state); dist_ens calls forward(x, is_training=...) and passes the member's
step key as the apply rng in training, None in evaluation, so forward may call
hk.next_rng_key() only when is_training.
"""

import sys
from collections.abc import Sequence
from pathlib import Path

import haiku as hk
import jax

import dist_ens


def make_model(num_classes: int = 10, widths: Sequence[int] = (64, 64),
               dropout_rate: float = 0.1) -> hk.TransformedWithState:
  """The factory config.model.factory names, called with config.model.kwargs."""
  widths = tuple(widths)

  def forward(x: jax.Array, is_training: bool) -> jax.Array:
    h = hk.Flatten()(x)
    for width in widths:
      h = hk.Linear(width, with_bias=False)(h)
      h = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(h, is_training)
      h = jax.nn.relu(h)
    if is_training:
      h = hk.dropout(hk.next_rng_key(), dropout_rate, h)
    return hk.Linear(num_classes)(h)

  return hk.transform_with_state(forward)


def main(workdir: str) -> None:
  config = dist_ens.load_config(Path(__file__).parents[1] / 'configs' / 'default.py')
  config.model.factory = 'examples.haiku_mlp:make_model'
  config.model.kwargs.widths = (64, 64)
  config.num_members = 4
  config.train.steps = 200
  config.train.log_every = 50
  config.train.eval_every = 0
  config.checkpoint.every = 100
  results = dist_ens.train(config, workdir)
  print(f"ensemble test accuracy {results['ensemble']['accuracy']:.3f}")


if __name__ == '__main__':
  main(sys.argv[1] if len(sys.argv) > 1 else '/tmp/dist_ens_haiku_mlp')
