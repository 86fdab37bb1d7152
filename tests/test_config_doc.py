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


def test_a_method_declares_its_fields_in_its_own_file():
  # A built-in method's fields are its file's FIELDS (config.ensemble.<file name>): the
  # defaults carry what Python makes of each file's dict, the registry's option groups are
  # exactly the registered files that declare them, and a mistyped one is refused like any
  # other.
  import importlib  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top
  from dist_ens.config import loading, schema  # pylint: disable=g-import-not-at-top
  from dist_ens.ensembles import methods  # pylint: disable=g-import-not-at-top
  from dist_ens.errors import ConfigError  # pylint: disable=g-import-not-at-top
  config = loading.load_config(loading.DEFAULT_CONFIG)
  groups = {methods.options_group(name) for name in methods.METHODS} - {None}
  assert groups == set(schema.method_defaults()) >= {'swag', 'sgmcmc', 'masksembles'}
  for group in groups:
    module = importlib.import_module(f'dist_ens.ensembles.{group}')
    assert config.ensemble[group].to_dict() == module.FIELDS, group
  assert schema.method_fields()['ensemble.swag.rank'].meaning.startswith('deviations kept')
  config.ensemble.sgmcmc.sampelr = 'sgld'
  with pytest.raises(ConfigError, match=r'config.ensemble.sgmcmc.sampelr is not a config '
                     r'field.*ensemble.sgmcmc.sampler'):
    loading.check_known_fields(config)


def test_a_method_files_fields_are_read_with_their_checks(tmp_path, monkeypatch):
  from dist_ens.config import schema  # pylint: disable=g-import-not-at-top
  (tmp_path / 'mine.py').write_text(
      'import jax\n\nFIELDS = dict(\n    # how many draws\n'
      '    draws=4,  # at evaluation [int >= 1]\n'
      "    kind='a',  # [one of 'a', 'b']\n)\n")
  (tmp_path / 'other.py').write_text('X = dict(a=1)\n')  # No FIELDS: no group.
  (tmp_path / 'unused.py').write_text('FIELDS = dict(a=1)\n')  # Not registered: no group.
  (tmp_path / 'methods.py').write_text(
      'from pkg import mine as mine_lib, other\n\nMETHODS = {\'m\': mine_lib, \'o\': other}\n')
  monkeypatch.setattr(schema, 'METHODS_DIR', tmp_path)
  for cached in (schema.method_fields, schema.method_defaults):
    cached.cache_clear()
  try:
    fields = schema.method_fields()
    assert set(fields) == {'ensemble.mine.draws', 'ensemble.mine.kind'}
    draws = fields['ensemble.mine.draws']
    assert draws.meaning == 'how many draws at evaluation' and draws.check.text == 'int >= 1'
    assert not draws.check.holds(0) and fields['ensemble.mine.kind'].check.holds('b')
    assert schema.method_defaults() == {'mine': {'draws': 4, 'kind': 'a'}}
  finally:
    monkeypatch.undo()
    for cached in (schema.method_fields, schema.method_defaults):
      cached.cache_clear()


def test_member_groups_declare_their_field_in_their_own_module():
  # config.ensemble.groups is declared once, in config/groups.py's FIELDS beside the code
  # that reads and checks it: the defaults place it (taking a list of dicts, as from a
  # config file), the schema reads its meaning, and validation runs the module's check.
  import pytest  # pylint: disable=g-import-not-at-top
  from dist_ens.config import checks, groups, loading, schema  # pylint: disable=g-import-not-at-top
  from dist_ens.errors import ConfigError  # pylint: disable=g-import-not-at-top
  assert 'ensemble.groups' not in loading.DEFAULT_CONFIG.read_text()
  field = schema.declared(loading.DEFAULT_CONFIG)['ensemble.groups']
  assert field.meaning.startswith('Members of different architectures') and field.check is None
  config = loading.load_config(loading.DEFAULT_CONFIG)
  assert config.ensemble.groups == groups.FIELDS['groups'] == ()
  config.ensemble.groups = [{'count': 4}, {'count': 3}]  # any type, as a config.json holds
  with pytest.raises(ConfigError, match=r'config.num_members=8 but config.ensemble.groups '
                     r'counts 7 members'):
    checks.validate(config)
