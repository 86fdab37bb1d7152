"""The --config flag and the diagnostics of command-line overrides: one line for a
mistyped field, a value of the wrong type, or a field given twice (the last wins)."""

import difflib
import re
from collections.abc import Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

# Command-line overrides: one line for a mistyped field or a value of the wrong type.

def define_config_flag(fv: flags.FlagValues, sys_argv: Sequence[str] | None = None) -> None:
  """--config: a config file, its fields overridable as --config.field=value."""
  config_flags.DEFINE_config_file(
      'config', None, 'Config file (a .py whose get_config() returns a ConfigDict, e.g. '
      'configs/default.py); override fields with --config.field=value.',
      flag_values=fv, lock_config=True, sys_argv=sys_argv)


def config_fields(config: ml_collections.ConfigDict, prefix: str = '') -> list[str]:
  """Every dotted field name of `config`, nested ConfigDicts and their fields alike."""
  names = []
  for key, value in config.items():
    names.append(prefix + key)
    if isinstance(value, ml_collections.ConfigDict):
      names.extend(config_fields(value, f'{prefix}{key}.'))
  return names


def _load_config(argv: Sequence[str]) -> ml_collections.ConfigDict | None:
  """The config file of --config in argv, without overrides (None: none given or loadable)."""
  path = None
  for i, arg in enumerate(argv):
    if arg.startswith(('--config=', '-config=')):
      path = arg.split('=', 1)[1]
    elif arg in ('--config', '-config') and i + 1 < len(argv):
      path = argv[i + 1]
  if path is None:
    return None
  fv = flags.FlagValues()
  define_config_flag(fv, sys_argv=['dist-ens', f'--config={path}'])
  try:
    fv(['dist-ens', f'--config={path}'])
  except flags.Error:
    return None
  return fv.config


def unknown_field_message(argv: Sequence[str]) -> str | None:
  """For the first --config.X in argv that names no field: the error, with the closest names.

  Example:
    unknown_field_message(['dist-ens', '--config=configs/default.py',
                           '--config.optim.learnin_rate=0.1'])
    # -> '--config.optim.learnin_rate: the config has no field optim.learnin_rate; did you
    #     mean config.optim.learning_rate?'
  """
  config = _load_config(argv)
  if config is None:
    return None
  fields = config_fields(config)
  for arg in argv:
    match = re.match(r'^--?(?:no)?config\.([^=]+)', arg)
    if not match or match.group(1) in fields:
      continue
    path = match.group(1)
    return f'--config.{path}: the config has no field {path}; {field_hint(path, fields)}'
  return None


def field_hint(path: str, fields: Sequence[str]) -> str:
  """'did you mean config.X?' for the fields closest to the unknown dotted `path`, or,
  with none close, what the deepest known part of the path holds."""
  scored = sorted(((difflib.SequenceMatcher(None, path, f).ratio(), f) for f in fields),
                  reverse=True)
  # The best match, and any as good; a poor match misleads more than none.
  close = [f for score, f in scored[:3] if score >= max(0.75, scored[0][0] - 0.02)]
  if close:
    return 'did you mean ' + ' or '.join(f'config.{c}' for c in close) + '?'
  parts = path.split('.')
  known = next(('.'.join(parts[:k]) for k in range(len(parts) - 1, 0, -1)
                if '.'.join(parts[:k]) in fields), '')
  siblings = [f.rpartition('.')[2] for f in fields if f.rpartition('.')[0] == known]
  return f'config{"." if known else ""}{known} has {", ".join(siblings)}'


def last_overrides(argv: Sequence[str]) -> list[str]:
  """argv with only the last of each repeated --config.X: the last value wins, as for
  any flag (ml_collections would join a tuple field's values: widths '(8,)' then '(16,)'
  trained (8, 16))."""
  last = {}
  for i, arg in enumerate(argv):
    match = re.match(r'^--?(?:no)?config\.([^=]+)', arg)
    if match:
      last[match.group(1)] = i
  return [arg for i, arg in enumerate(argv)
          if not (m := re.match(r'^--?(?:no)?config\.([^=]+)', arg)) or last[m.group(1)] == i]


def _is_kind(value, kind: type) -> bool:
  """isinstance, except that a bool is no number and an int may stand for a float."""
  if isinstance(value, bool) and kind is not bool:
    return False
  return isinstance(value, (int, float) if kind is float else kind)


def wrong_type_message(argv: Sequence[str], config: ml_collections.ConfigDict) -> str | None:
  """For an override that turned a tuple of numbers (or strings) into something else: the error.

  ml_collections parses any text as a tuple ('abc' -> ('abc',)), so a mistyped
  --config.model.widths would surface only deep inside training.
  """
  matches = [re.match(r'^--?config\.([^=]+)=.*', arg) for arg in argv]
  overrides = [(m.group(0), m.group(1)) for m in matches if m]
  default = _load_config(argv) if overrides else None
  if default is None:
    return None
  fields = config_fields(default)
  for arg, path in overrides:
    if path not in fields:
      continue
    old = default
    for part in path.split('.'):
      old = old[part]
    if not isinstance(old, tuple) or not old or len({type(x) for x in old}) != 1:
      continue
    new = config
    for part in path.split('.'):
      new = new[part]
    kind = type(old[0])
    if not isinstance(new, tuple) or not all(_is_kind(x, kind) for x in new):
      return (f'{arg}: config.{path} holds {kind.__name__}s, e.g. {old}; got {new!r} '
              f"(write a tuple as --config.{path}='{old}')")
  return None
