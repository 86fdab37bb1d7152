"""Users' code named in a config by import path: 'my_pkg.module:attribute'; and the
packages of dist_ens whose names are imported on first use (lazy_getattr).

Loading such a path imports that module: the trust boundary is the user's own
code, never anything stored in a workdir (dist_ens writes no pickles).
"""

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dist_ens.errors import ConfigError


class ImportPathError(ConfigError):
  """An import path that does not load: `field`, the `path` and the `reason` ("cannot be
  imported: ..."). core/, which names its own spec's fields, says it as its SpecError."""

  def __init__(self, field: str, path: str, reason: str):
    super().__init__(f'{field}={path!r} {reason}')
    self.field, self.path, self.reason = field, path, reason


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
    ImportPathError (a ConfigError): one line naming `field` and the import that failed.
  """
  module_name, _, attr = path.partition(':')
  try:
    obj = _import_here_too(module_name)
  except ImportError as e:
    raise ImportPathError(field, path, f'cannot be imported: {type(e).__name__}: {e} '
                          f'({_where_to_import_from(module_name, e)})') from None
  for part in attr.split('.'):
    if not hasattr(obj, part):
      raise ImportPathError(field, path, f'cannot be loaded: module {module_name!r} has no '
                            f'attribute {attr!r}.')
    obj = getattr(obj, part)
  return obj


def _import_here_too(module_name: str) -> Any:
  """`module_name` imported from sys.path, else from the current directory as well.

  `python -m`, `python -c` and a notebook put the current directory on sys.path; a script
  (`python /elsewhere/train.py`) and the `dist-ens` command put their own folder there
  instead, so 'examples.plain_jax:make_model' or 'my_pkg.data:load' failed from exactly
  the directory that holds them (issue 62 item 8). The directory is appended, so it never
  shadows an installed module, and kept, so the user's module can import its siblings later.
  """
  before = set(sys.modules)
  try:
    return importlib.import_module(module_name)
  except ImportError as e:
    # Only where the module itself (or a package above it) was not found: a module found
    # that fails to import something of its own fails the same way from anywhere.
    missing, here, top = e.name or '', Path.cwd(), module_name.split('.')[0]
    if (not (missing and f'{module_name}.'.startswith(f'{missing}.'))
        or not ((here / top).is_dir() or (here / f'{top}.py').is_file())
        or here in {Path(p or '.').resolve() for p in sys.path}):
      raise
  # What the failed attempt left: e.g. dm-haiku's namespace package 'examples' (found on
  # sys.path before the directory is) would stand for the directory's regular one.
  for name in list(sys.modules):
    if name == top or name.startswith(f'{top}.'):
      namespace = getattr(sys.modules[name], '__file__', None) is None
      if name not in before or namespace:
        del sys.modules[name]
  sys.path.append(str(here))
  importlib.invalidate_caches()
  return importlib.import_module(module_name)


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


def lazy_getattr(package: str, public: Mapping[str, str],
                 deprecated: Mapping[str, str] | None = None) -> Callable[[str], Any]:
  """A package's module __getattr__ (PEP 562) that imports its names on first use:
  `public` maps each name to the module defining it (the value is kept on the package,
  so later lookups skip this); a name of a submodule imports it; a `deprecated` name is
  read from its module each time, whose own __getattr__ warns.

  A package that imports its modules when it is imported runs them before any module of
  the package another asked for: a module that reads one part of the package then runs
  all of it, and a circle follows (training/__init__ -> trainer -> the evaluators ->
  training.loop). With this, `import dist_ens` and such imports run nothing else.
  """
  module = sys.modules[package]

  def __getattr__(name: str) -> Any:  # pylint: disable=invalid-name
    if name in public:
      value = getattr(importlib.import_module(public[name]), name)
      setattr(module, name, value)
      return value
    if deprecated and name in deprecated:
      return getattr(importlib.import_module(deprecated[name]), name)
    if not name.startswith('_') and importlib.util.find_spec(f'{package}.{name}') is not None:
      return importlib.import_module(f'{package}.{name}')  # A submodule, e.g. dist_ens.models.
    raise AttributeError(f'module {package!r} has no attribute {name!r}')

  return __getattr__
