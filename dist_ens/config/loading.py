"""Config files read into ConfigDicts: load_config, the check that every field is one the
package's defaults have (a misspelt one would be ignored), and a workdir's saved config
compared with a new one and upgraded to this version's fields.

Configs are Python files whose get_config() returns an ml_collections.ConfigDict (the
package's defaults: dist_ens/config/defaults.py; presets: configs/).
"""

import importlib.util
import json
from pathlib import Path
from typing import Any

import ml_collections

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


def check_known_fields(config: ml_collections.ConfigDict) -> None:
  """Refuses a field the package's defaults do not have (a misspelt one would be ignored).

  For a config from a file or from Python, as --config.x overrides are refused on the
  command line. A workdir's saved config is not checked: a field that a later version
  dropped must not stop an old run from loading.

  Raises:
    ConfigError: naming the first unknown field (or group) and the closest known ones.
  """
  # The optional fields are the specs' (models' and data's): imported here, so that loading
  # a config (the command line's flags) does not import JAX.
  from dist_ens.config import specs  # pylint: disable=g-import-not-at-top
  known = config_fields(load_config(DEFAULT_CONFIG))
  allowed = {*known, *specs.OPTIONAL_FIELDS}
  for path in config_fields(config):  # A group comes before its fields.
    if path in allowed or any(path.startswith(f'{free}.') for free in specs.FREE_FORM_FIELDS):
      continue
    raise ConfigError(f'config.{path} is not a config field (dist_ens/config/defaults.py), so '
                      f'nothing would read it; {field_hint(path, known)}')


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
