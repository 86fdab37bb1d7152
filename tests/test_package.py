"""The package's public names (dist_ens/__init__.py): each the object its module defines,
imported on first use, with the subpackages reachable as attributes, and `import dist_ens`
alone not starting JAX."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

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
