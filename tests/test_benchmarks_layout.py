"""benchmarks/ is a package run as `python -m benchmarks.NAME` from the repository root: no
script edits sys.path, siblings are imported as `benchmarks.X`, and every module imports.

Static checks read the files (no jax); one subprocess imports every module the way
`python -m` does (the root on sys.path from the working directory, no PYTHONPATH).
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / 'benchmarks'
SCRIPTS = sorted(p for p in BENCHMARKS.glob('*.py') if p.name != '__init__.py')
SIBLINGS = {p.stem for p in SCRIPTS}
# Files allowed to edit sys.path, each with why.
SYS_PATH_EXCEPTIONS = {
    # --source DIR names the dist_ens checkout under test: its CLI children get it by cwd
    # and PYTHONPATH, and the parent's Ensemble.load must read their checkpoints with that
    # same checkout's code, so main() puts it first on sys.path before importing dist_ens.
    'fault_injection.py',
}
_EDITS_SYS_PATH = re.compile(r'sys\.path\.(insert|append|extend)\(|sys\.path\s*(\+=|=[^=])')
# A child started as `python benchmarks/NAME.py` has benchmarks/, not the root, on sys.path.
_CHILD_BY_FILE = re.compile(r'sys\.executable,\s*__file__')


def test_benchmarks_is_a_regular_package():
  # A namespace package would merge with any other `benchmarks` folder on sys.path.
  assert (BENCHMARKS / '__init__.py').is_file()


@pytest.mark.parametrize('path', SCRIPTS, ids=lambda p: p.name)
def test_no_script_edits_sys_path_or_runs_itself_by_file(path):
  text = path.read_text()
  if path.name not in SYS_PATH_EXCEPTIONS:
    assert not _EDITS_SYS_PATH.search(text), f'{path.name} edits sys.path'
  assert not _CHILD_BY_FILE.search(text), (
      f'{path.name} starts itself by file; use -m benchmarks.{path.stem} with cwd=ROOT')


@pytest.mark.parametrize('path', SCRIPTS, ids=lambda p: p.name)
def test_siblings_are_imported_through_the_package(path):
  bare = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      bare += [a.name for a in node.names if a.name.split('.')[0] in SIBLINGS]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      if node.module.split('.')[0] in SIBLINGS:
        bare.append(node.module)
  assert not bare, f'{path.name} imports {bare}: write `from benchmarks import X`'


def test_every_module_imports_as_benchmarks_name():
  """One process imports them all (~3 s of CPU, jax once); sys.path must be unchanged."""
  names = [p.stem for p in SCRIPTS]
  code = ('import importlib, sys\n'
          'before = list(sys.path)\n'
          f'for name in {names!r}:\n'
          '  importlib.import_module("benchmarks." + name)\n'
          'assert sys.path == before, [p for p in sys.path if p not in before]\n'
          f'print("imported", {len(names)})\n')
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  env.update(JAX_PLATFORMS='cpu', MPLBACKEND='Agg')
  done = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert f'imported {len(names)}' in done.stdout


def test_a_script_runs_as_a_module():
  # memory imports resnet20, which imports throughput: the chain the old sys.path edits served.
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  done = subprocess.run([sys.executable, '-m', 'benchmarks.memory', '--help'], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert 'usage:' in done.stdout


def test_run_rounds_measures_each_job_once_a_round_in_rotating_order(capsys):
  from benchmarks import harness  # pylint: disable=import-outside-toplevel
  order = []
  jobs = {name: (lambda n=name: order.append(n) or len(order)) for name in 'abc'}
  results = harness.run_rounds(jobs, 2, lambda r, name, got: f'{r}:{name}={got}')
  assert order == ['a', 'b', 'c', 'b', 'c', 'a']
  assert results == {'a': [1, 6], 'b': [2, 4], 'c': [3, 5]}
  assert capsys.readouterr().out.split() == ['0:a=1', '0:b=2', '0:c=3', '1:b=4', '1:c=5', '1:a=6']


def test_a_results_header_records_the_versions_its_figures_depend_on(monkeypatch):
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from benchmarks import harness  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(harness, 'PACKAGES', (*harness.PACKAGES, 'no-such-package-here'))
  got = harness.run_header(['bench.py'])['packages']
  assert (got['jax'], got['jaxlib'], got['numpy']) == (jax.__version__, jaxlib.__version__,
                                                       np.__version__)
  assert got['no-such-package-here'] is None
  assert got['XLA_FLAGS'] == os.environ['XLA_FLAGS']  # conftest's fake devices among them
