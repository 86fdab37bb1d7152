"""An MLP in Equinox, with BatchNorm (eqx.nn.make_with_state) and Dropout, as a dist_ens ensemble.

  python -m examples.equinox_mlp [workdir]     # from the repository root

An Equinox module sees ONE example; dist_ens vmaps it over the batch with
axis_name='batch', the name eqx.nn.BatchNorm must be given. The factory takes
`key` (each member's init calls it with its own) and returns (module, state) from
eqx.nn.make_with_state; __call__(x, state, *, key=None) returns (logits, state).
In evaluation dist_ens runs eqx.nn.inference_mode(module) with key=None.
"""

import sys
from collections.abc import Sequence
from pathlib import Path

import equinox as eqx
import jax

import dist_ens


class MLP(eqx.Module):
  """flatten, [linear (no bias), BatchNorm, relu] per width, dropout, linear to logits."""
  linears: list[eqx.nn.Linear]
  norms: list[eqx.nn.BatchNorm]
  dropout: eqx.nn.Dropout
  head: eqx.nn.Linear

  def __init__(self, in_features: int, widths: Sequence[int], num_classes: int,
               dropout_rate: float, *, key: jax.Array):
    sizes = (in_features, *widths)
    keys = jax.random.split(key, len(widths) + 1)
    self.linears = [eqx.nn.Linear(a, b, use_bias=False, key=k)
                    for a, b, k in zip(sizes[:-1], sizes[1:], keys)]
    self.norms = [eqx.nn.BatchNorm(w, axis_name='batch', momentum=0.9, mode='batch')
                  for w in widths]
    self.dropout = eqx.nn.Dropout(dropout_rate)
    self.head = eqx.nn.Linear(sizes[-1], num_classes, key=keys[-1])

  def __call__(self, x: jax.Array, state: eqx.nn.State, *,
               key: jax.Array | None = None) -> tuple[jax.Array, eqx.nn.State]:
    h = x.reshape(-1)
    for linear, norm in zip(self.linears, self.norms):
      h, state = norm(linear(h), state)
      h = jax.nn.relu(h)
    return self.head(self.dropout(h, key=key)), state


class PlainMLP(eqx.Module):
  """The same MLP without BatchNorm (no state): __call__(x, *, key=None) -> logits."""
  mlp: eqx.nn.MLP
  dropout: eqx.nn.Dropout

  def __init__(self, in_features: int, widths: Sequence[int], num_classes: int,
               dropout_rate: float, *, key: jax.Array):
    width = widths[0] if widths else num_classes
    self.mlp = eqx.nn.MLP(in_features, num_classes, width, len(widths), key=key)
    self.dropout = eqx.nn.Dropout(dropout_rate)

  def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
    h = x.reshape(-1)
    for layer in self.mlp.layers[:-1]:
      h = jax.nn.relu(layer(h))
    return self.mlp.layers[-1](self.dropout(h, key=key))


def make_model(*, key: jax.Array, num_classes: int = 10, in_features: int = 40,
               widths: Sequence[int] = (64, 64), dropout_rate: float = 0.1,
               batch_norm: bool = True) -> tuple[MLP, eqx.nn.State] | PlainMLP:
  """The factory config.model.factory names: key from dist_ens, the rest from config.model.kwargs.

  batch_norm=False returns a stateless module (equal widths), which dist_ens adapts
  with an empty model state.
  """
  if not batch_norm:
    return PlainMLP(in_features, tuple(widths), num_classes, dropout_rate, key=key)
  return eqx.nn.make_with_state(MLP)(in_features, tuple(widths), num_classes, dropout_rate,
                                     key=key)


def main(workdir: str) -> None:
  config = dist_ens.load_config(Path(__file__).parents[1] / 'configs' / 'default.py')
  config.model.factory = 'examples.equinox_mlp:make_model'
  config.model.kwargs.widths = (64, 64)
  config.num_members = 4
  config.train.steps = 200
  config.train.log_every = 50
  config.train.eval_every = 0
  config.checkpoint.every = 100
  results = dist_ens.train(config, workdir)
  print(f"ensemble test accuracy {results['ensemble']['accuracy']:.3f}")


if __name__ == '__main__':
  main(sys.argv[1] if len(sys.argv) > 1 else '/tmp/dist_ens_equinox_mlp')
