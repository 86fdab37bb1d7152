"""Issue 39, items 11, 13 and 14: a workdir that cannot be written, a user's code that
raises, an empty test split, float labels and a damaged final_metrics.json each end in
one dist-ens line naming what to fix, before anything is written; what a kill or a lost
metrics.jsonl leaves behind is cleaned up or said."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import support

import dist_ens
from dist_ens import commands, data
from dist_ens.errors import ConfigError
from dist_ens.report import build as report
from dist_ens.training import workdir as workdir_lib

ROOT = Path(__file__).resolve().parents[1]
_LIMIT_S = 300


def _config():
  return support.config()


def _cli(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if not k.startswith(('SLURM_', 'OMPI_', 'PMI_'))}
  env.update(XLA_FLAGS=support.xla_flags(8), JAX_PLATFORMS='cpu')
  if pythonpath is not None:
    env['PYTHONPATH'] = os.pathsep.join([str(pythonpath), env.get('PYTHONPATH', '')])
  return subprocess.run(['timeout', '-k', '5', str(_LIMIT_S), sys.executable, '-m',
                         'dist_ens.main', *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=_LIMIT_S + 30)


def _last_line(result: subprocess.CompletedProcess, traceback: bool = False) -> str:
  assert result.returncode not in (0, 124), result.stderr[-3000:]
  assert ('Traceback' in result.stderr) == traceback, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert traceback or len(lines) == 1, result.stderr[-3000:]
  return lines[-1]


def test_a_workdir_that_is_a_file_is_one_line(tmp_path):
  (tmp_path / 'f').write_text('x')
  line = _last_line(_cli('--config=configs/default.py', f'--workdir={tmp_path / "f"}'))
  assert line == (f'dist-ens: error: --workdir={tmp_path / "f"} is a file, not a directory; '
                  'name a directory (new or holding a run to resume).')
  assert (tmp_path / 'f').read_text() == 'x'


def test_a_workdir_under_a_file_is_refused_before_anything_runs(tmp_path):
  (tmp_path / 'f').write_text('x')
  with pytest.raises(ConfigError, match=f'{tmp_path / "f"} is a file, not a directory'):
    dist_ens.train(_config(), str(tmp_path / 'f' / 'a' / 'run'))


def test_a_read_only_workdir_is_refused_before_anything_runs(tmp_path, monkeypatch):
  # Root may write anywhere, so a read-only filesystem is what os.access reports for it.
  (tmp_path / 'run').mkdir()
  real_access = os.access
  monkeypatch.setattr(os, 'access', lambda p, mode: False if Path(p) == tmp_path / 'run'
                      else real_access(p, mode))
  with pytest.raises(ConfigError, match='the workdir is not writable .a read-only filesystem'):
    dist_ens.train(_config(), str(tmp_path / 'run'))
  with pytest.raises(ConfigError, match=f'{tmp_path / "run"}, where it would be created, is '
                     'not writable'):
    workdir_lib.check_workdir(tmp_path / 'run' / 'new')
  assert not any((tmp_path / 'run').iterdir())


def test_a_lock_file_that_cannot_be_opened_is_one_line(tmp_path, monkeypatch):
  def refuse(*args, **kwargs):
    raise PermissionError(13, 'Permission denied')
  monkeypatch.setattr(os, 'open', refuse)
  with pytest.raises(ConfigError, match=r'cannot open .*\.lock: Permission denied'):
    workdir_lib.WorkdirLock(tmp_path).acquire()


_USER_MODULE = '''
import numpy as np

def load():
  raise ValueError('cannot find /data/mine')

def other():
  return None

def make_net(num_classes):
  raise RuntimeError('factory bug')
'''


def test_an_error_in_the_users_loader_gives_its_traceback_then_the_field(tmp_path):
  (tmp_path / 'mine.py').write_text(_USER_MODULE)
  result = _cli('--config=configs/default.py', f'--workdir={tmp_path / "w"}',
                '--config.data.name=mine:load', pythonpath=tmp_path)
  line = _last_line(result, traceback=True)
  assert "ValueError: cannot find /data/mine" in result.stderr
  assert line == ("dist-ens: error: the code config.data.name='mine:load' names raised "
                  'ValueError: cannot find /data/mine (its traceback is above).'), line
  assert not (tmp_path / 'w').exists()


def test_the_field_is_told_apart_by_the_function_that_raised(tmp_path, monkeypatch):
  (tmp_path / 'mine.py').write_text(_USER_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  import mine  # pylint: disable=import-error,g-import-not-at-top
  config = _config()
  config.data.name, config.model.factory = 'mine:other', 'mine:make_net'
  try:
    mine.make_net(10)
  except RuntimeError as e:
    assert commands._user_code_field(e, config) == "config.model.factory='mine:make_net'"
  try:
    np.asarray([1]).reshape(3)  # numpy raises it: no user code involved.
  except ValueError as e:
    assert commands._user_code_field(e, config) is None
  monkeypatch.delitem(sys.modules, 'mine')


def _arrays(test_size=8):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(64, 5)), rng.integers(0, 3, 64),
          rng.normal(size=(test_size, 5)), rng.integers(0, 3, test_size))


@pytest.mark.parametrize('field, value, message', [
    ('ensemble.method', 'deeep', r"^config.ensemble.method='deeep'; use one of \('deep'"),
    ('model.name', 'mlpp', r"^config.model.name='mlpp' is not a known model; use one of"),
    ('optim.name', 'adamm', r"^config.optim.name='adamm'; use one of \['adam'"),
    ('optim.schedule', 'cosin', r"^config.optim.schedule='cosin'; use one of \('constant'"),
])
def test_a_misspelt_name_is_refused_before_the_data_set_is_read(tmp_path, field, value,
                                                                message):
  # Were the data set read first, its own misspelt name would be the error.
  config = _config()
  config.data.name = 'no_such_data_set'
  config.update_from_flattened_dict({field: value})
  with pytest.raises(ConfigError, match=message):
    dist_ens.train(config, tmp_path / 'run')
  assert not (tmp_path / 'run').exists()


def test_an_empty_test_split_is_refused_before_anything_is_written(tmp_path):
  dataset = data.from_arrays(*_arrays(test_size=0), name='mine')
  with pytest.raises(ConfigError, match="dataset 'mine' .* has an empty test split"):
    dist_ens.train(_config(), str(tmp_path / 'w'), dataset=dataset)
  assert not (tmp_path / 'w').exists()


def test_non_integer_labels_for_classification_are_refused(tmp_path):
  x, y, x_test, y_test = _arrays()
  dataset = data.from_arrays(x, y + 0.5, x_test, y_test + 0.5, name='mine')
  with pytest.raises(ConfigError, match="dataset 'mine' .*labels must be integer classes"):
    dist_ens.train(_config(), str(tmp_path / 'w'), dataset=dataset)
  assert not (tmp_path / 'w').exists()


@pytest.mark.parametrize('content', [b'{"step": 20, "ensemble": {"accu', b'\xff\xfe{'])
def test_report_on_a_damaged_final_metrics_is_one_line(tmp_path, content):
  (tmp_path / 'final_metrics.json').write_bytes(content)
  with pytest.raises(ConfigError, match='final_metrics.json is damaged'):
    report.make_report(tmp_path)


def test_report_on_a_truncated_final_metrics_is_one_line_on_the_command_line(tmp_path):
  (tmp_path / 'final_metrics.json').write_text('{"step": 20, "ens')
  line = _last_line(_cli('report', f'--workdir={tmp_path}'))
  assert line.startswith(f'dist-ens report: error: {tmp_path / "final_metrics.json"} is '
                         'damaged'), line


# Issue 39, item 14: what a kill or a lost file leaves behind.

def _checkpointed_config(steps):
  config = _config()
  config.train.steps, config.checkpoint.every, config.checkpoint.keep = steps, 2, 2
  config.writers = ('jsonl',)
  return config


def _steps(workdir):
  return sorted(int(d.name) for d in (workdir / 'checkpoints').iterdir() if d.name.isdigit())


@pytest.fixture(scope='module')
def six_steps(tmp_path_factory):
  """A finished 6-step run (checkpoints 4 and 6): each test below resumes its own copy."""
  workdir = tmp_path_factory.mktemp('six')
  dist_ens.train(_checkpointed_config(6), str(workdir))
  return workdir


def test_a_checkpoint_beyond_keep_left_by_a_kill_goes_at_the_next_save(tmp_path, six_steps):
  shutil.copytree(six_steps, tmp_path, dirs_exist_ok=True)
  assert _steps(tmp_path) == [4, 6]
  # A kill after a save's commit and before the oldest is deleted leaves keep + 1.
  shutil.copytree(tmp_path / 'checkpoints' / '4', tmp_path / 'checkpoints' / '2')
  dist_ens.train(_checkpointed_config(8), str(tmp_path))
  assert _steps(tmp_path) == [6, 8]


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records
          if r.levelno == logging.WARNING and 'metrics.jsonl' in r.getMessage()]


@pytest.mark.parametrize('damage', ['deleted', 'truncated', 'intact'])
def test_a_resume_without_the_events_before_it_warns_once(tmp_path, caplog, six_steps, damage):
  shutil.copytree(six_steps, tmp_path, dirs_exist_ok=True)
  path = tmp_path / 'metrics.jsonl'
  if damage == 'deleted':
    path.unlink()
  elif damage == 'truncated':  # Only the first event (step 2) is left.
    path.write_text(path.read_text().splitlines(keepends=True)[0])
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    dist_ens.train(_checkpointed_config(8), str(tmp_path))
  expected = {
      'deleted': [f'{path} is missing: the events of steps 1-6 are lost; the run resumes '
                  'from its checkpoint at step 6 and writes the events from there on.'],
      'truncated': [f'{path} ends at step 2 but the run resumes from its checkpoint at step '
                    '6: the events of steps 3-6 are lost (the file was truncated or '
                    'replaced).'],
      'intact': []}[damage]
  assert _warnings(caplog) == expected
  steps = [json.loads(line)['step'] for line in path.read_text().splitlines()]
  assert steps[-1] == 8
