"""Training: the public entry `train(config, workdir)` (trainer.py), the loop and its actions
(loop.py).

The names below are imported on first use (importing.lazy_getattr), not when the package
is: a module that reads one part of training (the evaluators read training.loop) must not
run trainer.py, which imports the evaluators. `import dist_ens.evaluators.posthoc` alone
went round that circle and failed while trainer.py was imported here.
"""

from typing import TYPE_CHECKING

from dist_ens import importing

_PUBLIC = {'Action': 'dist_ens.training.loop', 'Call': 'dist_ens.training.loop',
           'PeriodicAction': 'dist_ens.training.loop', 'Session': 'dist_ens.training.loop',
           'every': 'dist_ens.training.loop', 'train': 'dist_ens.training.trainer'}
__all__ = ['Action', 'Call', 'PeriodicAction', 'Session', 'every', 'train']

if TYPE_CHECKING:  # For editors and type checkers; at run time __getattr__ imports them.
  from dist_ens.training.loop import Action, Call, PeriodicAction, Session, every
  from dist_ens.training.trainer import train

# Deprecated: what actions received before Call and Session (training.loop warns).
__getattr__ = importing.lazy_getattr(__name__, _PUBLIC,
                                     deprecated={'Context': 'dist_ens.training.loop'})
