"""Import paths in a config ('pkg.module:attr') resolve from the current directory too, as
`python -m` does, also where Python put another folder on sys.path (a script elsewhere, the
`dist-ens` command): issue 62 item 8."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run as a script from another folder, so sys.path[0] is that folder and not the cwd.
_SCRIPT = textwrap.dedent('''
    import sys
    from dist_ens import importing
    for path in sys.argv[1:]:
      obj = importing.load_object(path, 'config.model.factory')
      print(path, sys.modules[obj.__module__].__file__)
''')


def _run_script_from(cwd: Path, tmp_path: Path, *paths: str) -> subprocess.CompletedProcess:
  script = tmp_path / 'elsewhere' / 'train.py'
  script.parent.mkdir(exist_ok=True)
  script.write_text(_SCRIPT)
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  return subprocess.run([sys.executable, str(script), *paths], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=120)


def test_a_script_elsewhere_imports_the_repositorys_examples_and_users_code_from_the_cwd(
    tmp_path):
  # The repository's examples/ from its root: dm-haiku installs a namespace package named
  # 'examples' too, found on sys.path first; the root's own must still win.
  proc = _run_script_from(ROOT, tmp_path, 'examples.plain_jax:make_model')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ['examples.plain_jax:make_model',
                                 str(ROOT / 'examples' / 'plain_jax.py')]
  # A user's own package in the folder they run from.
  project = tmp_path / 'project'
  (project / 'my_pkg').mkdir(parents=True)
  (project / 'my_pkg' / '__init__.py').write_text('')
  (project / 'my_pkg' / 'models.py').write_text('def make_model():\n  return None\n')
  proc = _run_script_from(project, tmp_path, 'my_pkg.models:make_model')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ['my_pkg.models:make_model',
                                 str(project / 'my_pkg' / 'models.py')]


def test_elsewhere_the_examples_error_still_says_where_they_are(tmp_path):
  proc = _run_script_from(tmp_path, tmp_path, 'examples.plain_jax:make_model')
  assert proc.returncode != 0
  assert (f'(the examples/ folder is in the dist_ens repository, not in the installed '
          f'package: run from {ROOT}, or add it to PYTHONPATH)') in proc.stderr

