"""Training: the public entry `train(config, workdir)`, the step, the loop and its actions."""

from dist_ens.training.run import run as train

__all__ = ['train']
