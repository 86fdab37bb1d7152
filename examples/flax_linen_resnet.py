"""A small 1-D ResNet in Flax linen, with BatchNorm and Dropout, trained as a dist_ens ensemble.

  python -m examples.flax_linen_resnet [workdir]     # from the repository root

or from a config: config.model.factory = 'examples.flax_linen_resnet:make_model'.
dist_ens adapts a linen module (dist_ens.core.adapters): params are
variables['params'], the model state is the rest ({'batch_stats': ...}); the module
is called with `train=` and draws dropout from the 'dropout' rng stream, which
dist_ens keys per member and step.
"""

import functools
import sys
from pathlib import Path

import flax.linen as nn
import jax

import dist_ens


class ResBlock(nn.Module):
  """conv-BN-relu-conv-BN plus the identity, then relu. No conv bias before a BatchNorm."""
  channels: int

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    h = nn.relu(norm()(nn.Conv(self.channels, (3,), use_bias=False)(x)))
    h = norm(scale_init=nn.initializers.zeros)(nn.Conv(self.channels, (3,), use_bias=False)(h))
    return nn.relu(x + h)


class ResNet1D(nn.Module):
  """Stem conv (stride 2), `num_blocks` residual blocks, flatten, dropout, dense to logits."""
  num_classes: int = 10
  channels: int = 16
  num_blocks: int = 2
  dropout_rate: float = 0.1

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    h = nn.Conv(self.channels, (5,), strides=(2,), use_bias=False)(x)
    h = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(h))
    for _ in range(self.num_blocks):
      h = ResBlock(self.channels)(h, train)
    h = nn.Dropout(self.dropout_rate, deterministic=not train)(h.reshape(h.shape[0], -1))
    return nn.Dense(self.num_classes)(h)


def make_model(num_classes: int = 10, channels: int = 16, num_blocks: int = 2,
               dropout_rate: float = 0.1) -> ResNet1D:
  """The factory config.model.factory names; config.model.kwargs are its keywords.

  dist_ens passes num_classes (the dataset's) because the signature names it.
  """
  return ResNet1D(num_classes=num_classes, channels=channels, num_blocks=num_blocks,
                  dropout_rate=dropout_rate)


def main(workdir: str) -> None:
  config = dist_ens.load_config(Path(__file__).parents[1] / 'configs' / 'default.py')
  config.model.factory = 'examples.flax_linen_resnet:make_model'
  config.model.kwargs.channels = 16
  config.num_members = 4
  config.train.steps = 200
  config.train.log_every = 50
  config.train.eval_every = 0
  config.checkpoint.every = 100
  results = dist_ens.train(config, workdir)
  print(f"ensemble test accuracy {results['ensemble']['accuracy']:.3f}")


if __name__ == '__main__':
  main(sys.argv[1] if len(sys.argv) > 1 else '/tmp/dist_ens_flax_linen_resnet')
