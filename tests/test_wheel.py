"""An installed wheel checks a config as a checkout does: the fields' defaults and checks
ship inside the package (dist_ens/config/defaults.py), not in the repository's configs/."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import support

ROOT = Path(__file__).resolve().parents[1]

_CHILD = '''
import sys
import dist_ens
from dist_ens.config.defaults import get_config
from dist_ens.errors import ConfigError
assert dist_ens.__file__.startswith(sys.argv[1]), dist_ens.__file__  # the wheel's, not ours
config = get_config()
config.num_memebrs = 3
try:
  dist_ens.train(config, sys.argv[2])
except ConfigError as e:
  print(e)
'''


def test_a_wheel_install_refuses_a_mistyped_field_in_one_line(tmp_path):
  built = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps', '-w',
                          str(tmp_path / 'wheel'), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
  assert built.returncode == 0, built.stderr[-3000:]
  [wheel] = (tmp_path / 'wheel').glob('dist_ens-*.whl')
  with zipfile.ZipFile(wheel) as z:  # A plain install is the wheel's files, unpacked.
    z.extractall(tmp_path / 'site')
  # Outside the repository: neither its configs/ nor its package are in reach.
  out = subprocess.run(
      [sys.executable, '-c', _CHILD, str(tmp_path / 'site'), str(tmp_path / 'run')],
      cwd=tmp_path, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=str(tmp_path / 'site'), JAX_PLATFORMS='cpu',
               XLA_FLAGS=support.xla_flags(1)))
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.splitlines() == [
      'config.num_memebrs is not a config field (dist_ens/config/defaults.py), so nothing '
      'would read it; did you mean config.num_members?'], out.stdout
  assert not (tmp_path / 'run').exists()
