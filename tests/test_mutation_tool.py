"""tools/mutation.py names files that exist: the modules it mutates and the tests it runs."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool():
  spec = importlib.util.spec_from_file_location('mutation_tool', ROOT / 'tools' / 'mutation.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_each_module_and_its_test_files_exist():
  for name, (module, scope, tests) in _tool().MODULES.items():
    assert (ROOT / module).is_file(), (name, module)
    assert scope and tests, name
    for test in tests:
      assert (ROOT / test).is_file(), (name, test)
