"""dist_ens.parallel.distributed in one process: config comparison, launch flags, cluster detection.

The multi-process behaviour (real jax.distributed runs) is in test_multihost.py.
"""

import json
import logging as std_logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils

import support

from dist_ens.config import agreement, loading
from dist_ens.parallel import distributed, launch
from dist_ens.config.loading import load_config
from dist_ens.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
# Variables by which JAX detects a cluster job; cleared so the host's own
# environment (e.g. pytest run inside a SLURM allocation) cannot leak in.
CLUSTER_VARS = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID',
                'SLURM_LOCALID', 'OMPI_MCA_orte_hnp_uri', 'KUBERNETES_SERVICE_HOST',
                'JAX_COORDINATOR_ADDRESS')


@pytest.fixture
def no_cluster(monkeypatch):
  for var in CLUSTER_VARS:
    monkeypatch.delenv(var, raising=False)


@pytest.fixture
def slurm_job(monkeypatch, no_cluster):
  """SLURM's variables for task 1 of a 2-task job step on one node."""
  for var, value in {'SLURM_JOB_ID': '1234', 'SLURM_STEP_NODELIST': 'node[001-002]',
                     'SLURM_NTASKS': '2', 'SLURM_PROCID': '1', 'SLURM_LOCALID': '0'}.items():
    monkeypatch.setenv(var, value)


def _config_dict(**overrides):
  config = load_config(ROOT / 'configs' / 'default.py')
  return loading.to_dict(support.override(config, **overrides))


def test_describe_differences_names_fields_and_values():
  base = _config_dict()
  other = _config_dict(train__steps=30, mesh__hosts_along='data')
  message = agreement.describe_differences([base, base, other])
  assert message == ("process 2: mesh.hosts_along='data' (process 0: 'member'); "
                     'train.steps=30 (process 0: 2000)')


def test_describe_differences_missing_field_and_equal_configs():
  base = _config_dict()
  other = json.loads(json.dumps(base))
  del other['train']['steps']
  assert agreement.describe_differences([base, other]) == (
      "process 1: train.steps='<missing>' (process 0: 2000)")
  assert agreement.describe_differences([base, base]) == ''


def test_config_hash_ignores_key_order_not_values():
  base = _config_dict()
  reordered = dict(reversed(list(base.items())))
  assert agreement.config_hash(reordered) == agreement.config_hash(base)
  assert agreement.config_hash(_config_dict(seed=1)) != agreement.config_hash(base)


def test_check_same_config_one_process_uses_no_collective(monkeypatch):
  def no_collective(*args, **kwargs):
    raise AssertionError('a single process must not run a collective')
  monkeypatch.setattr(multihost_utils, 'process_allgather', no_collective)
  agreement.check_same_config(_config_dict())


def _fake_other_process(monkeypatch, other: dict):
  """Makes check_same_config see two processes, the second holding `other`.

  process_allgather returns [this process's value, the other's], computing the
  other's value as that process would at the same call (hash, length, bytes).
  """
  calls = []
  other_bytes = json.dumps(other, sort_keys=True, separators=(',', ':')).encode()

  def allgather(x):
    x = np.asarray(x)
    step = len(calls)
    calls.append(x)
    if step == 0:
      theirs = np.frombuffer(agreement.config_hash(other), np.uint8)
    elif step == 1:
      theirs = np.int32(len(other_bytes))
    else:
      theirs = np.zeros_like(x)
      theirs[:len(other_bytes)] = np.frombuffer(other_bytes, np.uint8)
    return np.stack([x, theirs])

  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(multihost_utils, 'process_allgather', allgather)
  return calls


def test_check_same_config_equal_configs_gathers_only_the_hash(monkeypatch):
  calls = _fake_other_process(monkeypatch, _config_dict())
  agreement.check_same_config(_config_dict())
  assert len(calls) == 1 and calls[0].shape == (32,)


def test_check_same_config_names_differing_fields(monkeypatch):
  _fake_other_process(monkeypatch, _config_dict(seed=3, optim__learning_rate=0.1))
  with pytest.raises(ConfigError) as error:
    agreement.check_same_config(_config_dict())
  message = str(error.value)
  assert 'processes resolved different configs' in message
  assert 'optim.learning_rate=0.1 (process 0: 0.001)' in message
  assert 'seed=3 (process 0: 0)' in message


def test_flag_combinations_that_cannot_work(no_cluster):
  cases = [
      (launch.Launch(enabled=False, num_processes=2), '--nodistributed'),
      (launch.Launch(num_processes=2, process_id=2), '--process_id=2 must be below'),
      (launch.Launch(num_processes=0), '--num_processes=0'),
      (launch.Launch(process_id=-1), '--process_id=-1'),
      (launch.Launch(enabled=True, heartbeat_timeout_s=0), '--heartbeat_timeout_s=0'),
  ]
  for flags, expected in cases:
    with pytest.raises(ConfigError, match=expected):
      distributed.initialize(flags)


def test_plain_run_does_not_start_distributed(no_cluster):
  assert distributed.initialize(launch.Launch()) is False
  assert distributed.initialize(launch.Launch(enabled=False)) is False


def test_missing_addresses_without_a_cluster_are_named(no_cluster):
  with pytest.raises(ConfigError, match='needs --coordinator_address, --num_processes, '
                     '--process_id: no cluster'):
    distributed.initialize(launch.Launch(enabled=True))
  with pytest.raises(ConfigError, match=r'needs --coordinator_address, --process_id:'):
    distributed.initialize(launch.Launch(num_processes=2))


def test_refuses_to_start_after_the_backend(no_cluster):
  # Here the backend exists already (conftest asked for devices): starting now
  # would fail inside JAX; the error says what to do instead.
  with pytest.raises(ConfigError, match='must start before any JAX call'):
    distributed.initialize(launch.Launch(coordinator_address='localhost:1',
                                              num_processes=2, process_id=0))


def test_slurm_job_is_detected(slurm_job):
  assert distributed.detected_cluster() == ('slurm', 2)


def test_no_cluster_detected(no_cluster):
  assert distributed.detected_cluster() is None


def test_single_task_slurm_job_runs_plain(slurm_job, monkeypatch):
  monkeypatch.setenv('SLURM_NTASKS', '1')
  monkeypatch.setenv('SLURM_PROCID', '0')
  assert distributed.initialize(launch.Launch()) is False


def test_log_lines_name_their_process():
  prefix = distributed._ProcessPrefix(3)  # pylint: disable=protected-access
  record = std_logging.LogRecord('x', std_logging.INFO, __file__, 1, 'step %d', (5,), None)
  prefix.filter(record)
  assert record.getMessage() == '[process 3] step 5'
  prefix.filter(record)  # Already prefixed (e.g. by train.run): unchanged.
  assert record.getMessage() == '[process 3] step 5'
  record = std_logging.LogRecord('x', std_logging.INFO, __file__, 1, '%s%s',
                                 ('[process 3] ', 'step 6'), None)
  prefix.filter(record)  # Prefixed through an argument.
  assert record.getMessage() == '[process 3] step 6'


def test_main_rejects_contradictory_flags(tmp_path):
  env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS}
  result = subprocess.run(
      [sys.executable, '-m', 'dist_ens.main', f'--config={ROOT / "configs" / "default.py"}',
       f'--workdir={tmp_path / "w"}', '--nodistributed', '--num_processes=2'],
      capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
  assert result.returncode != 0
  assert 'dist-ens: error: --nodistributed was given together with' in result.stderr
  assert not (tmp_path / 'w').exists()


def test_importing_the_entry_point_touches_no_device():
  # jax.distributed.initialize must come before the backend starts; main imports
  # train (and so every module) before it can call it.
  code = ('import dist_ens.main, dist_ens.training.trainer\n'
          'from jax._src import xla_bridge\n'
          'assert not xla_bridge.backends_are_initialized(), "a module touched a device"\n')
  env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS}
  result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=env)
  assert result.returncode == 0, result.stderr


def test_a_collective_failed_by_a_lost_process_is_one_line(monkeypatch):
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(jax, 'process_index', lambda: 1)
  error = jax.errors.JaxRuntimeError(
      'UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read error [127.0.0.1]:39823: '
      'Connection reset by peer')
  assert distributed.lost_process_line(error, 40) == (
      'dist-ens: error: [process 1] lost process 0 of 2 (it died or stopped; see its log): '
      'UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read error [127.0.0.1]:39823: Connection '
      'reset by peer; the newest intact checkpoint is at step 40: rerun the same command on '
      'every process to resume from it.')
  monkeypatch.setattr(jax, 'process_count', lambda: 4)  # Which of three: its log says.
  assert 'lost another process of 4' in distributed.lost_process_line(error, None)
  # Errors of another kind keep their traceback.
  assert distributed.lost_process_line(jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: out of '
                                                                  'memory'), 40) is None
  assert distributed.lost_process_line(ValueError('Connection reset by peer'), 40) is None
