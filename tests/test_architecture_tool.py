"""tools/architecture.py measures what it says, on a package written here (its figures for
dist_ens itself are in docs/how-it-works.md)."""

import support


def _tool():
  return support.load_tool('architecture')


def test_it_counts_root_modules_cycles_raw_configs_and_group_mentions(tmp_path):
  package = tmp_path / 'dist_ens'
  (package / 'core').mkdir(parents=True)
  files = {
      '__init__.py': 'from dist_ens import a\n',
      'a.py': 'from dist_ens import b\nimport ml_collections\n',
      'b.py': 'def f():\n  from dist_ens import a  # a circle, however hidden\n',
      'core/__init__.py': '',
      'core/step.py': 'from dist_ens import b\nx = parts.groups\n',  # climbs a layer
  }
  for name, text in files.items():
    (package / name).write_text(text)
  found = _tool().measure(package)
  assert found['modules'] == 5 and found['root_modules'] == 3
  assert found['lines'] == sum(t.count('\n') for t in files.values())
  assert found['import_cycles'] == [['dist_ens.a', 'dist_ens.b']]
  assert found['raw_config'] == ['dist_ens.a']
  assert found['member_groups'] == ['dist_ens.core.step']
  assert found['back_arrows'] == ['dist_ens.core.step -> dist_ens.b']
