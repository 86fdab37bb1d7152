"""dist_ens: train ensembles of neural networks as one sharded, vmapped JAX program.

  config = dist_ens.load_config('configs/default.py')
  results = dist_ens.train(config, '/tmp/run')
  ensemble = dist_ens.Ensemble.load('/tmp/run')

The public names, and the subpackages (`dist_ens.models.from_hf`, `dist_ens.data.from_arrays`),
are imported on first use (PEP 562), so `import dist_ens` and the command line's --help
and refusals at flag parsing do not start JAX.
"""

from typing import TYPE_CHECKING

from dist_ens import importing

# Each public name and the module that defines it.
_PUBLIC = {
    'Action': 'dist_ens.training.loop',
    'Call': 'dist_ens.training.loop',
    'ConfigError': 'dist_ens.errors',
    'Ensemble': 'dist_ens.inference.ensemble',
    'Model': 'dist_ens.core.model',
    'PeriodicAction': 'dist_ens.training.loop',
    'Session': 'dist_ens.training.loop',
    'TrainingError': 'dist_ens.errors',
    'every': 'dist_ens.training.loop',
    'load_config': 'dist_ens.config.loading',
    'load_member': 'dist_ens.io.member_files',
    'num_members': 'dist_ens.ensembles.stacking',
    'stack': 'dist_ens.ensembles.stacking',
    'train': 'dist_ens.training.trainer',
    'unstack': 'dist_ens.ensembles.stacking',
}
__all__ = ['Action', 'Call', 'ConfigError', 'Ensemble', 'Model', 'PeriodicAction', 'Session',
           'TrainingError', 'every', 'load_config', 'load_member', 'num_members', 'stack',
           'train', 'unstack']
__version__ = '0.2.0'

if TYPE_CHECKING:  # What type checkers and editors see; at run time, __getattr__ below.
  from dist_ens.config.loading import load_config
  from dist_ens.core.model import Model
  from dist_ens.ensembles.stacking import num_members, stack, unstack
  from dist_ens.errors import ConfigError, TrainingError
  from dist_ens.inference.ensemble import Ensemble
  from dist_ens.io.member_files import load_member
  from dist_ens.training.loop import Action, Call, PeriodicAction, Session, every
  from dist_ens.training.trainer import train


# Deprecated: what actions received before Call and Session (training.loop warns).
__getattr__ = importing.lazy_getattr(__name__, _PUBLIC,
                                     deprecated={'Context': 'dist_ens.training.loop'})


def __dir__() -> list[str]:
  return sorted({*globals(), *_PUBLIC})
