"""The command line as a researcher meets it: one-line errors, --help per command, Ctrl-C."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_ens.data import sources
from dist_ens.errors import ConfigError
from dist_ens.training import preemption

ROOT = Path(__file__).resolve().parents[1]
TINY = ['--config=configs/default.py', '--config.train.eval_every=0',
        "--config.model.widths=(8,)", '--config.data.batch_size=16']


def _env() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(('SLURM_', 'OMPI_', 'PMI_', 'TPU_'))}
  env.update(XLA_FLAGS='--xla_force_host_platform_device_count=8', JAX_PLATFORMS='cpu')
  return env


def _command(*args: str) -> list[str]:
  return ['timeout', '-k', '5', '120', sys.executable, '-m', 'dist_ens.main', *args]


def _run(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(_command(*args), cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=150)


def _one_error_line(result: subprocess.CompletedProcess) -> str:
  assert result.returncode not in (0, 124), result.stderr
  assert 'Traceback' not in result.stderr, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  return lines[0]


@pytest.mark.parametrize('command,override,suggestion', [
    ('train', '--config.optim.learnin_rate=0.1', 'did you mean config.optim.learning_rate?'),
    ('train', '--config.optimm.name=sgd', 'did you mean config.optim.name?'),
    ('plan', '--config.trian.steps=3', 'did you mean config.train.steps?'),
])
def test_misspelt_config_field_is_one_line_with_the_closest_name(tmp_path, command, override,
                                                                 suggestion):
  args = [command, *TINY, override] + ([f'--workdir={tmp_path}'] if command == 'train' else [])
  line = _one_error_line(_run(*args))
  assert line.startswith(f'dist-ens{"" if command == "train" else " " + command}: error: ')
  assert suggestion in line
  assert not any(tmp_path.iterdir())


@pytest.mark.parametrize('args,expected', [
    (['--config.train.steps=abc'], r'--config.train.steps=abc: invalid literal for int'),
    (["--config.model.widths=abc"], r'config.model.widths holds ints, e.g. \(256, 256\)'),
    (['--wrkdir=/tmp/x'], r"Unknown command line flag 'wrkdir'. Did you mean: workdir"),
    (['--config=configs/no_such.py'], r'--config=configs/no_such.py: .*No such file'),
])
def test_bad_value_or_flag_is_one_line(tmp_path, args, expected):
  line = _one_error_line(_run('--config=configs/default.py', f'--workdir={tmp_path}', *args))
  assert re.search(expected, line), line


def test_missing_report_workdir_is_one_line(tmp_path):
  line = _one_error_line(_run('report', f'--workdir={tmp_path / "none"}'))
  assert line.startswith('dist-ens report: error: ') and 'final_metrics.json' in line


@pytest.mark.parametrize('command,flags', [
    ([], ['--config', '--workdir', '--[no]distributed', '--num_processes']),
    (['train'], ['--config', '--workdir', '--coordinator_address']),
    (['plan'], ['--config', '--memory_gb', '--[no]json']),
    (['report'], ['--workdir']),
])
def test_each_command_has_help_listing_its_flags(command, flags):
  result = _run(*command, '--help')
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith('usage: dist-ens')
  listed = re.findall(r'^  (--[\w\[\]]+):', result.stdout, re.M)
  assert sorted(listed) == sorted(set(listed)) and set(flags) <= set(listed), result.stdout
  if command == ['report']:
    assert '--config' not in listed and '--memory_gb' not in listed


def test_plan_json_reports_the_plan():
  result = _run('plan', *TINY, '--json')
  assert result.returncode == 0, result.stderr
  plan = json.loads(result.stdout)
  assert plan['num_members'] == 8 and plan['params_per_member'] == 40 * 8 + 8 + 8 * 10 + 10
  assert plan['step']['peak'] > 0
  assert plan['flops_per_example'] > 0 and 'XLA cost analysis' in plan['flops_measured']
  assert plan['train_steps'] > 0


def _start_training(workdir: Path, steps: int) -> subprocess.Popen:
  return subprocess.Popen(
      _command(*TINY, f'--workdir={workdir}', f'--config.train.steps={steps}',
               '--config.train.log_every=2', '--config.checkpoint.every=1000'),
      cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_line(process: subprocess.Popen, pattern: str) -> list[str]:
  """stderr lines up to and including the first that matches (the run keeps going)."""
  lines = []
  deadline = time.monotonic() + 100
  while time.monotonic() < deadline:
    line = process.stderr.readline()
    assert line, f'the run ended before {pattern!r}:\n{"".join(lines)}'
    lines.append(line)
    if re.search(pattern, line):
      return lines
  raise AssertionError(f'no {pattern!r} in 100 s:\n{"".join(lines)}')


def test_ctrl_c_saves_a_checkpoint_and_stops_with_one_line(tmp_path):
  process = _start_training(tmp_path, steps=1_000_000)
  _wait_for_line(process, r'step \d+/1000000')
  process.send_signal(signal.SIGINT)  # timeout passes it on to the run.
  _, err = process.communicate(timeout=100)
  assert process.returncode == 0, err
  assert 'Traceback' not in err, err
  saved = re.findall(r'saved the checkpoint at step (\d+) and stopped', err)
  assert len(saved) == 1, err
  assert [line for line in err.splitlines() if 'progress.py' not in line][-1].endswith(
      'run the same command again to resume.'), err

  step = int(saved[0])
  resumed = _run(*TINY, f'--workdir={tmp_path}', f'--config.train.steps={step + 2}',
                 '--config.train.log_every=2')
  assert resumed.returncode == 0, resumed.stderr
  assert f'resuming from the checkpoint at step {step}' in resumed.stderr
  assert json.loads((tmp_path / 'final_metrics.json').read_text())['step'] == step + 2


def test_sigterm_during_start_up_is_one_line_without_traceback(tmp_path):
  process = _start_training(tmp_path, steps=1_000_000)
  # Logged before the step compiles and the loop starts.
  _wait_for_line(process, r'mesh \{')
  process.send_signal(signal.SIGTERM)
  _, err = process.communicate(timeout=100)
  assert 'Traceback' not in err, err
  assert process.returncode in (0, 143), err  # 0: the loop had started, and saved.
  if process.returncode == 143:
    assert err.strip().splitlines()[-1].startswith('dist-ens: stopped (SIGTERM) without saving')


def test_second_signal_stops_at_once():
  previous = signal.getsignal(signal.SIGINT)
  watcher = preemption.PreemptionWatcher()
  try:
    assert not watcher.should_stop(0)
    os.kill(os.getpid(), signal.SIGINT)
    assert watcher.should_stop(1) and watcher.signal_name == 'SIGINT'
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(1)  # The handler runs between bytecodes, well before this ends.
    assert signal.getsignal(signal.SIGINT) is previous  # Put back by the second signal.
  finally:
    watcher.close()
  assert signal.getsignal(signal.SIGINT) is previous


def test_sigterm_is_a_stop_request_too():
  watcher = preemption.PreemptionWatcher()
  try:
    os.kill(os.getpid(), signal.SIGTERM)
    assert watcher.should_stop(3) and watcher.signal_name == 'SIGTERM'
  finally:
    watcher.close()


def test_digits_without_scikit_learn_is_a_config_error(monkeypatch):
  # None in sys.modules makes `import sklearn.datasets` raise ImportError.
  monkeypatch.setitem(sys.modules, 'sklearn', None)
  monkeypatch.setitem(sys.modules, 'sklearn.datasets', None)
  with pytest.raises(ConfigError, match=r"pip install 'dist_ens\[digits\]'"):
    sources.load_digits()


def test_digits_without_scikit_learn_is_one_line_on_the_command_line(tmp_path):
  code = ("import sys; sys.modules['sklearn'] = sys.modules['sklearn.datasets'] = None\n"
          'from dist_ens import main; main.entry()\n')
  result = subprocess.run(
      ['timeout', '-k', '5', '120', sys.executable, '-c', code, *TINY,
       f'--workdir={tmp_path}', '--config.data.name=digits'],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=150)
  line = _one_error_line(result)
  assert "needs scikit-learn" in line and "pip install 'dist_ens[digits]'" in line
