"""Finished runs shared by the whole test session (issue 64 item 3): tests that only read a
run (its final metrics, events, checkpoints, a load, a prediction, a report, a pretrained
source) read one of these instead of training their own. tests/conftest.py imports the
fixtures, so any test file can name them; under xdist (`--dist loadfile`) each worker
builds a fixture once, the first time one of its files asks for it.

A test must not write into a shared workdir: one that damages, resumes, extends or reports
on a run works on its own copy (`copy(run, tmp_path)`). Each fixture records every file's
bytes when it is built and checks them again at the end of the session, so a test that
writes into a shared run fails there (as an error of the session's last test) instead of
silently changing what later tests read.
"""

import hashlib
import shutil
from pathlib import Path

import pytest

import support

ROOT = Path(__file__).resolve().parents[1]

# support.config's tiny run for 8 steps: logged, evaluated and checkpointed at 4 and 8
# (keep 3: both checkpoints stay; a report's curves have two points each), no joint
# log-loss. Resuming a copy with tiny_config(...) changes only what the test overrides;
# a test's own config may differ from it in train.log_every, train.eval_every, checkpoint.*
# and eval.* too (a resume may change them: dist_ens/io/checkpoint.py ALWAYS_COMPATIBLE).
TINY = {'train.steps': 8, 'train.log_every': 4, 'train.eval_every': 4, 'eval.joint_tau': 0,
        'checkpoint.keep': 3}


def tiny_config(overrides=(), /, **fields):
  """The config `tiny_run` trained, with `overrides` and `fields` (support.config's)."""
  return support.config({**TINY, **dict(overrides)}, **fields)


def uci_config():
  """configs/uci.py on the shipped yacht set (277 train, 31 test examples): 5 members for
  4 epochs, logged, evaluated and saved every 4 steps, events in jsonl."""
  import dist_ens  # pylint: disable=g-import-not-at-top  (jax after conftest's XLA_FLAGS)
  config = dist_ens.load_config(ROOT / 'configs' / 'uci.py')
  config.data.name, config.train.epochs = 'uci:yacht', 4
  config.train.log_every = config.train.eval_every = config.checkpoint.every = 4
  config.writers = ('jsonl',)
  return config


def copy(run, to):
  """`to` holding a copy of the shared run `run` ((workdir, final) or a workdir), for a
  test that writes into it; returns the copy's path."""
  workdir = run[0] if isinstance(run, tuple) else run
  shutil.copytree(workdir, to, dirs_exist_ok=True)
  return Path(to)


def killed_after(run, step, to):
  """`to` holding what a kill right after the finished run's step-`step` checkpoint leaves:
  a copy of `run` ((workdir, final metrics) or a workdir) without its later checkpoints and
  its final metrics; resuming it drops the events after `step`. A resume from it is a
  resume from that checkpoint, at the cost of one run (a preempted run and its resume are
  two): the method files' exact-resume tests start from it (the matrix preempts every
  method's run). Returns the copy's path."""
  workdir = copy(run, to)
  for path in (workdir / 'checkpoints').iterdir():
    if path.name.isdigit() and int(path.name) > step:
      shutil.rmtree(path)
  (workdir / 'final_metrics.json').unlink()
  assert max(int(p.name) for p in (workdir / 'checkpoints').iterdir()
             if p.name.isdigit()) == step
  return workdir


def _digest(workdir):
  return {str(p.relative_to(workdir)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(Path(workdir).rglob('*')) if p.is_file()}


def _shared(tmp_path_factory, name, config, **train_kwargs):
  """Trains `config` into a fresh workdir; yields (workdir, final metrics) for the
  session and checks afterwards that no test changed a file of it."""
  import dist_ens  # pylint: disable=g-import-not-at-top
  workdir = tmp_path_factory.mktemp(name)
  final = dist_ens.train(config, str(workdir), **train_kwargs)
  built = _digest(workdir)
  yield workdir, final
  changed = sorted(set(built.items()) ^ set(_digest(workdir).items()))
  assert not changed, (f'a test wrote into the shared run {name} ({workdir}); copy it with '
                       f'runs.copy first: {sorted({path for path, _ in changed})[:10]}')


@pytest.fixture(scope='session')
def tiny_run(tmp_path_factory):
  """(workdir, final metrics) of tiny_config(): support.config's 4 members of a (16,) MLP
  on MNIST-1D for 8 steps, events and checkpoints at 4 and 8."""
  yield from _shared(tmp_path_factory, 'shared_tiny', tiny_config())


@pytest.fixture(scope='session')
def uci_run(tmp_path_factory):
  """(workdir, final metrics) of uci_config(): the regression recipe on uci:yacht."""
  yield from _shared(tmp_path_factory, 'shared_uci', uci_config())
