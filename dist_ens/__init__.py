"""dist_ens: train ensembles of neural networks as one sharded, vmapped JAX program."""

from dist_ens.ensembles.stacking import init_members, member_keys, num_members, stack, unstack
from dist_ens.errors import ConfigError
from dist_ens.inference import Ensemble

__all__ = ['ConfigError', 'Ensemble', 'init_members', 'member_keys', 'num_members', 'stack',
           'unstack']
__version__ = '0.1.0'
