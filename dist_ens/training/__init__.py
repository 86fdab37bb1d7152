"""Training: the public entry `train(config, workdir)` (trainer.py), the loop and its actions
(loop.py).

The names below are imported on first use (PEP 562), not when the package is: a module
that reads one part of training (the evaluators read training.loop) must not run
trainer.py, which imports the evaluators. `import dist_ens.evaluators.posthoc` alone went
round that circle and failed while trainer.py was imported here.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING

_PUBLIC = {'Action': 'loop', 'Call': 'loop', 'PeriodicAction': 'loop', 'Session': 'loop',
           'every': 'loop', 'train': 'trainer'}

if TYPE_CHECKING:  # For editors and type checkers; at run time __getattr__ imports them.
  from dist_ens.training.loop import Action, Call, PeriodicAction, Session, every
  from dist_ens.training.trainer import train

__all__ = ['Action', 'Call', 'PeriodicAction', 'Session', 'every', 'train']


def __getattr__(name: str):
  if name in _PUBLIC:
    return getattr(importlib.import_module(f'{__name__}.{_PUBLIC[name]}'), name)
  if name == 'Context':  # Deprecated: what actions received before Call and Session.
    return importlib.import_module(f'{__name__}.loop').__getattr__(name)
  if not name.startswith('_') and importlib.util.find_spec(f'{__name__}.{name}') is not None:
    return importlib.import_module(f'{__name__}.{name}')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
