"""docs/config.md is what tools/gen_config_doc.py generates from the package's defaults now."""

from pathlib import Path

import ml_collections

import support

ROOT = Path(__file__).resolve().parents[1]


def _tool():
  return support.load_tool('gen_config_doc')


def test_committed_config_doc_is_current():
  expected = _tool().generate()
  committed = (ROOT / 'docs' / 'config.md').read_text()
  assert committed == expected, (
      'docs/config.md is stale (configs/default.py changed): run python tools/gen_config_doc.py')


def test_every_field_of_the_default_config_is_documented():
  tool = _tool()
  text = tool.generate()

  def leaves(node, prefix=''):
    for key in node.keys():
      value = node[key]
      name = f'{prefix}{key}'
      if isinstance(value, ml_collections.ConfigDict) and len(value):
        yield from leaves(value, name + '.')
      else:
        yield name

  config = tool._load_config(tool.CONFIG)  # pylint: disable=protected-access
  missing = [name for name in leaves(config) if f'| `{name}` |' not in text]
  assert not missing, f'fields missing from docs/config.md: {missing}'


def test_each_field_is_one_row_with_a_meaning():
  """A group given inline (config.mesh = ConfigDict(dict(...))) and extended later once
  listed its later fields twice, the first time with no meaning."""
  rows = [line.split('|') for line in _tool().generate().splitlines()
          if line.startswith('| `')]
  names = [row[1].strip() for row in rows]
  assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
  empty = [row[1].strip() for row in rows if not row[3].strip()]
  assert not empty, f'fields with no meaning (comment them in configs/default.py): {empty}'


def _breaking(check):
  """A value `check` refuses: just past a bound, the wrong type, an unknown choice."""
  if check.kind == 'bool':
    return 'yes'
  if check.kind == 'one of':
    return 'nope'
  step = 1 if check.kind == 'int' else 0.5
  if check.low is not None:
    return type(step)(check.low) - (step if check.low_closed else 0)
  if check.high is not None:
    return type(step)(check.high) + (step if check.high_closed else 0)
  return 1.5 if check.kind == 'int' else float('nan')


def test_each_declared_check_is_what_validation_applies():
  # A field's check is declared once, beside it in configs/default.py ('[int >= 1]'):
  # validation refuses a value that breaks it in one line naming the field and the rule.

  from dist_ens.config import checks, loading, schema  # pylint: disable=g-import-not-at-top
  from dist_ens.errors import ConfigError  # pylint: disable=g-import-not-at-top
  declared = {path: field.check for path, field in schema.declared(
      loading.DEFAULT_CONFIG).items() if field.check is not None}
  assert {'train.steps', 'optim.b2', 'reproducible', 'train.on_nonfinite'} <= set(declared)
  for path, check in declared.items():
    config = loading.load_config(loading.DEFAULT_CONFIG)
    *parents, leaf = path.split('.')
    node = config
    for name in parents:
      node = node[name]
    bad = _breaking(check)
    assert not check.holds(bad) and check.holds(node[leaf]), (path, bad)
    with node.ignore_type():
      node[leaf] = bad
    try:
      checks.validate(config)
    except ConfigError as e:
      assert str(e) == f'config.{path}={bad!r} is invalid: {check.requirement}.', str(e)
    else:
      raise AssertionError(f'config.{path}={bad!r} passed validation; it must be {check.text}')
