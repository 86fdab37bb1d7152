"""dist_ens: train ensembles of neural networks as one sharded, vmapped JAX program.

  config = dist_ens.load_config('configs/default.py')
  results = dist_ens.train(config, '/tmp/run')
  ensemble = dist_ens.Ensemble.load('/tmp/run')
"""

from dist_ens.config.loading import load_config
from dist_ens.core.model import Model
from dist_ens.ensembles.stacking import num_members, stack, unstack
from dist_ens.errors import ConfigError, TrainingError
from dist_ens.inference.ensemble import Ensemble
from dist_ens.io.member_files import load_member
from dist_ens.training import Action, Call, PeriodicAction, Session, every, train

__all__ = ['Action', 'Call', 'ConfigError', 'Ensemble', 'Model', 'PeriodicAction', 'Session',
           'TrainingError', 'every', 'load_config', 'load_member', 'num_members', 'stack',
           'train', 'unstack']
__version__ = '0.2.0'


def __getattr__(name: str):
  if name == 'Context':  # Deprecated: what actions received before Call and Session.
    from dist_ens.training import loop  # pylint: disable=g-import-not-at-top
    return loop.__getattr__(name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
