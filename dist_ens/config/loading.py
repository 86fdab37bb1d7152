"""Config files read into ConfigDicts: load_config, the checks that every field is one the
package's defaults have (a misspelt one would be ignored) and holds what its declaration
allows (check_fields: neither imports JAX, so the command line refuses such a config at
once), and a workdir's saved config compared with a new one and upgraded to this
version's fields.

Configs are Python files whose get_config() returns an ml_collections.ConfigDict (the
package's defaults: dist_ens/config/defaults.py; presets: configs/).
"""

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import ml_collections

from dist_ens.config import schema
from dist_ens.config.command_line import config_fields, field_hint
from dist_ens.errors import ConfigError


def load_config(path: str | Path, arg: str | None = None) -> ml_collections.ConfigDict:
  """get_config() (or get_config(arg)) of the config file at `path`.

  Example, in a variant config that starts from the default one:
    config = load_config(Path(__file__).with_name('default.py'))
  """
  path = Path(path)
  spec = importlib.util.spec_from_file_location(f'_dist_ens_config_{path.stem}', path)
  if spec is None or not path.is_file():
    raise ConfigError(f'config file {path} does not exist.')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg is not None else module.get_config()


# The config every field is checked against (check_known_fields), inside the package: an
# installed wheel checks as a checkout does.
DEFAULT_CONFIG = Path(__file__).resolve().with_name('defaults.py')


def _model_spec_module() -> Any:
  """dist_ens/models/spec.py (the standard library only), loaded by its path: importing it
  as dist_ens.models.spec runs dist_ens.models first, which imports every model and JAX."""
  name = '_dist_ens_models_spec'
  if name not in sys.modules:
    path = Path(__file__).resolve().parents[1] / 'models' / 'spec.py'
    spec = importlib.util.spec_from_file_location(name, path)
    sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])
  return sys.modules[name]


# config.data's TFDS-only fields: a config may set them; configs/default.py does not.
DATA_OPTIONAL_FIELDS = ('train_split', 'test_split', 'add_channel')
# Dotted fields a config may have beyond configs/default.py's: those only some models or
# data sets read (their defaults live in their specs: dist_ens.models.spec.ModelSpec's
# Optional fields, config.specs.data_spec), and under model.kwargs and ensemble.options
# anything (a user's model factory's keywords, a user's method's fields).
OPTIONAL_FIELDS = (*(f'model.{name}' for name in _model_spec_module().OPTIONAL_FIELDS),
                   *(f'data.{name}' for name in DATA_OPTIONAL_FIELDS))
FREE_FORM_FIELDS = ('model.kwargs', 'ensemble.options')


def check_known_fields(config: ml_collections.ConfigDict) -> None:
  """Refuses a field the package's defaults do not have (a misspelt one would be ignored).

  For a config from a file or from Python, as --config.x overrides are refused on the
  command line. A workdir's saved config is not checked: a field that a later version
  dropped must not stop an old run from loading.

  Raises:
    ConfigError: naming the first unknown field (or group) and the closest known ones.
  """
  known = config_fields(load_config(DEFAULT_CONFIG))
  allowed = {*known, *OPTIONAL_FIELDS}
  for path in config_fields(config):  # A group comes before its fields.
    if path in allowed or any(path.startswith(f'{free}.') for free in FREE_FORM_FIELDS):
      continue
    raise ConfigError(f'config.{path} is not a config field (dist_ens/config/defaults.py), so '
                      f'nothing would read it; {field_hint(path, known)}')


def require(ok: bool, field: str, value: Any, what: str) -> None:
  """Refuses config.`field`'s `value` unless `ok`, saying `what` it must be."""
  if not ok:
    raise ConfigError(f'config.{field}={value!r} is invalid: {what}.')


def field_value(config: ml_collections.ConfigDict, dotted: str) -> Any:
  """config's value of the `dotted` field ('train.steps'); a field it lacks is refused."""
  node = config
  for part in dotted.split('.'):
    if part not in node:
      raise ConfigError(f'config.{dotted} is missing; start from dist_ens.config.defaults.'
                        'get_config() (or configs/default.py), which has every field.')
    node = node[part]
  return node


def check_declared(config: ml_collections.ConfigDict) -> None:
  """Every check the package's defaults declare beside a field ('[int >= 1]', see
  dist_ens.config.schema), on this config's value of that field."""
  for path, field in schema.declared(DEFAULT_CONFIG).items():
    if field.check is not None:
      value = field_value(config, path)
      require(field.check.holds(value), path, value, field.check.requirement)


def check_fields(config: ml_collections.ConfigDict) -> None:
  """check_known_fields, then check_declared: what a config is refused for without
  importing JAX. The command line runs it before it imports JAX, so that a misspelt field
  or a value out of its declared range answers at once; train and plan run both as well
  (checks.validate runs check_declared).

  Raises:
    ConfigError: naming the first unknown field, or the first field whose value its
      declaration refuses.
  """
  check_known_fields(config)
  check_declared(config)


def to_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The config as plain JSON-able data (tuples become lists)."""
  return json.loads(config.to_json())


# An old workdir's config lacks the fields added since it was saved. upgrade() gives
# each field the package's default, except where runs before the field behaved as
# another value would: {group: {field: the value runs had before}}. A new field needs
# an entry here only when its default changes what an old run did.
OLD_BEHAVIOUR = {'eval': {'joint_tau': 0}}  # No joint log-loss was computed.


def _defaults() -> dict[str, Any]:
  """The package's defaults as a plain dict."""
  return to_dict(load_config(DEFAULT_CONFIG))


def _fill(saved: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
  """`saved` with the fields it lacks taken from `defaults`, group by group."""
  out = dict(saved)
  for key, value in defaults.items():
    if key not in out:
      out[key] = value
    elif isinstance(out[key], dict) and isinstance(value, dict):
      out[key] = _fill(out[key], value)
  return out


def upgrade(saved: dict[str, Any]) -> dict[str, Any]:
  """A config saved by an earlier version, with the fields added since at the values its
  run had (OLD_BEHAVIOUR's, else the package's defaults), and train.loss 'cross_entropy'
  written as '' (the classification task's own loss: the same function, now the
  default)."""
  out = dict(saved)
  for group, fields in OLD_BEHAVIOUR.items():
    if isinstance(out.get(group), dict):
      out[group] = {**fields, **out[group]}
  out = _fill(out, _defaults())
  train = out.get('train')
  if isinstance(train, dict) and train.get('loss') == 'cross_entropy' and (
      out.get('task', 'classification') == 'classification'):
    out['train'] = {**train, 'loss': ''}
  return out


def differences(old: dict[str, Any], new: dict[str, Any], prefix: str = '') -> list[str]:
  """Dotted names of the fields that differ between two config dicts."""
  out = []
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key), new.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      out += differences(a, b, f'{prefix}{key}.')
    elif a != b:
      out.append(f'{prefix}{key}')
  return out
