"""The package's public names (dist_ens/__init__.py): each the object its module defines,
imported on first use, with the subpackages reachable as attributes, and `import dist_ens`
alone not starting JAX."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import support

import dist_ens


def test_every_public_name_is_its_modules_object():
  assert sorted(dist_ens.__all__) == sorted(dist_ens._PUBLIC)  # pylint: disable=protected-access
  for name, module in dist_ens._PUBLIC.items():  # pylint: disable=protected-access
    assert getattr(dist_ens, name) is getattr(importlib.import_module(module), name), name
  assert set(dist_ens.__all__) <= set(dir(dist_ens))


def test_subpackages_are_attributes_and_unknown_names_are_attribute_errors():
  assert dist_ens.models.from_hf is importlib.import_module('dist_ens.models').from_hf
  assert dist_ens.data.from_arrays is importlib.import_module('dist_ens.data').from_arrays
  with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
    dist_ens.no_such_name  # pylint: disable=pointless-statement


def test_importing_the_package_and_loading_a_config_do_not_import_jax():
  code = ('import sys, dist_ens; dist_ens.load_config("configs/default.py"); '
          'print("jax" in sys.modules)')
  result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=120, check=True,
                          cwd=Path(__file__).resolve().parents[1])
  assert result.stdout.strip() == 'False', result.stderr


def test_the_package_has_no_import_circle():
  # tools/architecture.py's import graph: a module's imports, and the __init__ of every
  # package above each, which Python runs first (docs/how-it-works.md states the figure).
  found = support.load_tool('architecture').measure(Path(dist_ens.__file__).parent)
  assert found['import_cycles'] == [], found['import_cycles']


def test_a_module_of_a_former_circle_imports_alone_and_training_names_load_lazily():
  # evaluators/posthoc -> training.loop ran training/__init__, which imported trainer ->
  # the evaluators -> posthoc, half made: `import dist_ens.evaluators.posthoc` failed.
  code = ('import sys, dist_ens.evaluators.posthoc, dist_ens.training as t; '
          'print("dist_ens.training.trainer" in sys.modules, t.train.__module__)')
  result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == ['False', 'dist_ens.training.trainer'], result.stdout
