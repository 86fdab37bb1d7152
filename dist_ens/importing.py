"""Users' code named in a config by import path: 'my_pkg.module:attribute'.

Loading such a path imports that module: the trust boundary is the user's own
code, never anything stored in a workdir (dist_ens writes no pickles).
"""

import importlib
from pathlib import Path
from typing import Any

from dist_ens.errors import ConfigError


def is_import_path(value: Any) -> bool:
  """Whether `value` names an object as 'module:attribute' (a TFDS name with a version,
  'mnist:3.0.1', is not one: its attribute part is not a Python name)."""
  if not isinstance(value, str) or ':' not in value:
    return False
  module_name, _, attr = value.partition(':')
  return bool(module_name) and all(part.isidentifier() for part in attr.split('.'))


def load_object(path: str, field: str) -> Any:
  """The object at import path `path` ('pkg.module:attr.sub'), for config field `field`.

  Example:
    >>> load_object('math:sqrt', 'config.x')(4.0)
    2.0

  Raises:
    ConfigError: one line naming `field` and the import that failed.
  """
  module_name, _, attr = path.partition(':')
  try:
    obj = importlib.import_module(module_name)
  except ImportError as e:
    raise ConfigError(f'{field}={path!r} cannot be imported: {type(e).__name__}: {e} '
                      f'({_where_to_import_from(module_name, e)})') from None
  for part in attr.split('.'):
    if not hasattr(obj, part):
      raise ConfigError(f'{field}={path!r}: module {module_name!r} has no attribute {attr!r}.')
    obj = getattr(obj, part)
  return obj


# The repository's examples/ (e.g. 'examples.plain_jax:make_model' in the README): a
# folder beside the package, not part of what pip installs.
_REPOSITORY = Path(__file__).resolve().parents[1]


def _where_to_import_from(module_name: str, error: ImportError) -> str:
  top = module_name.split('.')[0]
  # (Another library's 'examples' on sys.path gives "No module named 'examples.x'".)
  missing = getattr(error, 'name', None) or ''
  if top == 'examples' and missing.split('.')[0] == top and (_REPOSITORY / 'examples').is_dir():
    return (f'the examples/ folder is in the dist_ens repository, not in the installed '
            f'package: run from {_REPOSITORY}, or add it to PYTHONPATH')
  return f'is {module_name!r} installed or on PYTHONPATH?'
