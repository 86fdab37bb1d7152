"""Training: the public entry `train(config, workdir)`, the step, the loop and its actions."""

from dist_ens.training import loop
from dist_ens.training.loop import Action, Call, PeriodicAction, Session, every
from dist_ens.training.trainer import train

__all__ = ['Action', 'Call', 'PeriodicAction', 'Session', 'every', 'train']


def __getattr__(name: str):
  if name == 'Context':  # Deprecated: what actions received before Call and Session.
    return loop.__getattr__(name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
