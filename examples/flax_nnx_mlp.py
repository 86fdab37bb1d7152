"""An MLP in Flax NNX, with BatchNorm and Dropout, trained as a dist_ens ensemble.

  python -m examples.flax_nnx_mlp [workdir]     # from the repository root

dist_ens needs the FACTORY of an NNX module, not a module: every member's init calls
make_model(rngs=nnx.Rngs(...), **config.model.kwargs) with its own keys. In training
dist_ens calls module.train() and re-keys the module's rng streams from the member's
step key (so Dropout needs nothing more); in evaluation module.eval().
"""

import sys
from collections.abc import Sequence
from pathlib import Path

import jax
from flax import nnx

import dist_ens


class MLP(nnx.Module):
  """flatten, [linear (no bias), BatchNorm, relu] per width, dropout, linear to logits."""

  def __init__(self, in_features: int, widths: Sequence[int], num_classes: int,
               dropout_rate: float, *, rngs: nnx.Rngs):
    sizes = (in_features, *widths)
    self.linears = nnx.List([nnx.Linear(a, b, use_bias=False, rngs=rngs)
                             for a, b in zip(sizes[:-1], sizes[1:])])
    self.norms = nnx.List([nnx.BatchNorm(w, momentum=0.9, rngs=rngs) for w in widths])
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
    self.head = nnx.Linear(sizes[-1], num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = x.reshape(x.shape[0], -1)
    for linear, norm in zip(self.linears, self.norms):
      h = nnx.relu(norm(linear(h)))
    return self.head(self.dropout(h))


def make_model(*, rngs: nnx.Rngs, num_classes: int = 10, in_features: int = 40,
               widths: Sequence[int] = (64, 64), dropout_rate: float = 0.1) -> MLP:
  """The factory config.model.factory names: rngs from dist_ens, the rest from config.model.kwargs.

  in_features is the flattened input size (MNIST-1D: 40); NNX builds with shapes.
  """
  return MLP(in_features, tuple(widths), num_classes, dropout_rate, rngs=rngs)


def main(workdir: str) -> None:
  config = dist_ens.load_config(Path(__file__).parents[1] / 'configs' / 'default.py')
  config.model.factory = 'examples.flax_nnx_mlp:make_model'
  config.model.kwargs.widths = (64, 64)
  config.num_members = 4
  config.train.steps = 200
  config.train.log_every = 50
  config.train.eval_every = 0
  config.checkpoint.every = 100
  results = dist_ens.train(config, workdir)
  print(f"ensemble test accuracy {results['ensemble']['accuracy']:.3f}")


if __name__ == '__main__':
  main(sys.argv[1] if len(sys.argv) > 1 else '/tmp/dist_ens_flax_nnx_mlp')
