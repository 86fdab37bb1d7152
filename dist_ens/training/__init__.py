"""Training: the public entry `train(config, workdir)`, the step, the loop and its actions."""

from dist_ens.training.loop import Action, Context, PeriodicAction, every
from dist_ens.training.trainer import train

__all__ = ['Action', 'Context', 'PeriodicAction', 'every', 'train']
