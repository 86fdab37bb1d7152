"""docs/config.md is what tools/gen_config_doc.py generates from configs/default.py now."""

import importlib.util
from pathlib import Path

import ml_collections

ROOT = Path(__file__).resolve().parents[1]


def _tool():
  spec = importlib.util.spec_from_file_location('gen_config_doc', ROOT / 'tools' / 'gen_config_doc.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


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
