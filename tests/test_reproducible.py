"""Reproducible mode (config.reproducible): member i's whole run is bit-identical whatever M,
the mesh, the data split and the process count, over 40-step runs.

The runs happen in child processes, because reproducible mode needs XLA flags set
before JAX starts (dist_ens/parallel/xla_flags.py), which this pytest process is past:
one worker process for every single-process run (this file, `python
tests/test_reproducible.py worker NAME,... OUT`) and launch/local.sh with two processes for
the multi-process run (the dist-ens command sets the flags itself there).

What is compared, bit for bit: every parameter of member i at step 100, and member i's
training loss and accuracy at every logged step (the trajectory).
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tests'))
from test_multihost import _env, _local_sh, _wait  # noqa: E402  pylint: disable=g-import-not-at-top

STEPS = 40  # Without the mode, parameters differ from the first steps on.
LOG_EVERY = 10
MLP = {'model.widths': (32, 32), 'data.batch_size': 32, 'train.micro_batches': 4,
       'data.member_order': 'shuffled'}
# BatchNorm, dropout and augmentation: a 1-D ResNet-8 on MNIST-1D, shift-crop augmented.
RESNET = {'model.name': 'resnet', 'model.depth': 8, 'model.dropout': 0.1,
          'data.augment': 'crop_flip', 'data.batch_size': 16, 'train.micro_batches': 2,
          'data.member_order': 'bootstrap', 'optim.name': 'sgd', 'optim.learning_rate': 0.05}
# The same on 8x8 digits: 2-D convolutions, whose sums XLA:CPU splits by the threads a
# device gets, so they agree only between processes of one device count
# (docs/reproducibility.md); here every run is in one 8-device process.
RESNET_2D = {**RESNET, 'data.name': 'digits', 'optim.name': 'adam', 'optim.learning_rate': 1e-3}
# Members split over a 'model' axis of 2 (32 x 32 kernels: 1,024 elements, split by FSDP).
MODEL2 = {**MLP, 'mesh.model': 2, 'mesh.fsdp_min_size': 512}
# name: (overrides, members, member axis, data axis); devices: member x data (x mesh.model).
RUNS = {
    'mlp_8x1_m8': (MLP, 8, 8, 1),
    'mlp_1x1_m3': (MLP, 3, 1, 1),
    'mlp_2x4_m8': (MLP, 8, 2, 4),
    'shared_4x2_m4': ({**MLP, 'data.member_order': 'shared'}, 4, 4, 2),
    'shared_1x1_m2': ({**MLP, 'data.member_order': 'shared'}, 2, 1, 1),
    'resnet_4x2_m4': (RESNET, 4, 4, 2),
    'resnet_1x1_m2': (RESNET, 2, 1, 1),
    'model2_4x1_m8': (MODEL2, 8, 4, 1),
    'model2_1x1_m3': (MODEL2, 3, 1, 1),
    'resnet2d_2x2_m2': (RESNET_2D, 2, 2, 2),
    'resnet2d_1x1_m2': (RESNET_2D, 2, 1, 1),
}


def _config(overrides, members, member, data):
  from dist_ens.config.loading import load_config  # pylint: disable=g-import-not-at-top
  config = load_config(ROOT / 'configs' / 'default.py')
  config.reproducible = True
  config.num_members = members
  config.mesh.member, config.mesh.data = member, data
  config.train.steps, config.train.log_every, config.train.eval_every = STEPS, LOG_EVERY, 0
  config.checkpoint.every = STEPS
  config.writers = ('jsonl',)
  for key, value in overrides.items():
    section, field = key.split('.')
    config[section][field] = value
  return config


def _worker(names: list[str], out: str) -> None:
  from dist_ens.parallel import xla_flags  # pylint: disable=g-import-not-at-top
  xla_flags.set_flags()
  import jax  # pylint: disable=g-import-not-at-top
  import dist_ens  # pylint: disable=g-import-not-at-top
  for name in names:
    overrides, members, member, data = RUNS[name]
    model = overrides.get('mesh.model', 1)
    dist_ens.train(_config(overrides, members, member, data), str(Path(out) / name),
                   devices=jax.devices()[:member * data * model])


def _start_worker(names, out: Path) -> subprocess.Popen:
  """A worker process with 8 fake CPU devices that trains the RUNS entries `names`."""
  return subprocess.Popen(
      [sys.executable, __file__, 'worker', ','.join(names), str(out)], env=_env(devices=8),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """Every RUNS entry trained in one worker process with 8 fake CPU devices."""
  out = tmp_path_factory.mktemp('reproducible')
  [(status, log)] = _wait([_start_worker(RUNS, out)], 1800)  # ~5 min idle; more when loaded
  assert status == 0, log[-5000:]
  assert 'members are reproducible on this mesh but may differ' not in log  # flags were set
  return out


def _members(workdir: Path, count: int) -> tuple[list[np.ndarray], list[dict]]:
  """The first `count` members' parameter leaves and their logged training metrics."""
  import jax  # pylint: disable=g-import-not-at-top
  import dist_ens  # pylint: disable=g-import-not-at-top
  params = dist_ens.Ensemble.load(workdir, devices=jax.devices()[:1]).params
  leaves = [np.asarray(leaf)[:count] for leaf in jax.tree.leaves(params)]
  lines = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  train = [{k: v[:count] for k, v in l['members'].items()} | {'step': l['step']}
           for l in lines if l.get('split') == 'train']
  return leaves, train


def _assert_same_members(a: Path, b: Path, count: int) -> None:
  (leaves_a, log_a), (leaves_b, log_b) = _members(a, count), _members(b, count)
  assert len(log_a) == STEPS // LOG_EVERY and log_a == log_b, (log_a, log_b)
  for x, y in zip(leaves_a, leaves_b, strict=True):
    np.testing.assert_array_equal(x, y, err_msg=f'{a.name} vs {b.name}')


@pytest.mark.parametrize('a, b, count', [
    ('mlp_8x1_m8', 'mlp_1x1_m3', 3),  # M = 8 vs 3; 8 devices vs 1
    ('mlp_8x1_m8', 'mlp_2x4_m8', 8),  # member split vs data split
    ('shared_4x2_m4', 'shared_1x1_m2', 2),
    ('resnet_4x2_m4', 'resnet_1x1_m2', 2),  # BatchNorm, dropout, augmentation; bootstrap
    ('model2_4x1_m8', 'model2_1x1_m3', 3),  # a fixed 'model' size: any member x data, any M
    ('resnet2d_2x2_m2', 'resnet2d_1x1_m2', 2),  # the same with 2-D convolutions and Adam
])
def test_members_are_bit_identical_across_layouts(runs, a, b, count):
  _assert_same_members(runs / a, runs / b, count)


def test_runs_differ_where_they_should(runs):
  """The comparison can fail: other members, and another order, give other numbers."""
  leaves, _ = _members(runs / 'mlp_8x1_m8', 8)
  assert not np.array_equal(leaves[0][0], leaves[0][1])
  shared, _ = _members(runs / 'shared_1x1_m2', 2)
  shuffled, _ = _members(runs / 'mlp_1x1_m3', 2)
  assert not np.array_equal(shared[-1], shuffled[-1])


# One process against two: their programs differ (gloo's collectives across processes),
# equal to the bit at XLA's default level, not at the tests' -O0 (found 2026-11-27).
@pytest.mark.xla_default
def test_two_processes_match_one(tmp_path):
  """2 processes x 4 devices (dist-ens through launch/local.sh) vs 1 process x 8 devices.

  Both runs compile at XLA's default level here, so the one-process run is trained beside
  the two (not read from `runs`, whose eleven runs would all compile again at that level)."""
  overrides, members, member, data = RUNS['mlp_2x4_m8']
  args = [f'--config.{k}={v!r}' if isinstance(v, tuple) else f'--config.{k}={v}'
          for k, v in overrides.items()]
  args += ['--config.reproducible=True', f'--config.num_members={members}',
           f'--config.mesh.member={member}', f'--config.mesh.data={data}',
           f'--config.train.steps={STEPS}', f'--config.train.log_every={LOG_EVERY}',
           '--config.train.eval_every=0', f'--config.checkpoint.every={STEPS}',
           "--config.writers=('jsonl',)"]
  (status, log), (one_status, one_log) = _wait(
      [_local_sh(tmp_path / 'two', *args, timeout_s=300),
       _start_worker(['mlp_2x4_m8'], tmp_path / 'one')], 360)
  assert status == 0, log[-5000:]
  assert one_status == 0, one_log[-5000:]
  for output in (log, one_log):
    assert 'members are reproducible on this mesh but may differ' not in output
  _assert_same_members(tmp_path / 'one' / 'mlp_2x4_m8', tmp_path / 'two', members)


@pytest.mark.parametrize('data, micro_batches, message', [
    (2, 1, r'config.train.micro_batches=1 must be a power of two .* data axis \(2\) divides'),
    (2, 3, r'config.train.micro_batches=3 must be a power of two .* e.g. 2 or 4'),
])
def test_micro_batches_the_data_axis_cannot_sum_canonically_are_refused(tmp_path, data,
                                                                         micro_batches, message):
  import dist_ens  # pylint: disable=g-import-not-at-top
  from dist_ens.errors import ConfigError  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  config = _config({**MLP, 'data.batch_size': 48}, 2, 1, data)
  config.train.micro_batches = micro_batches
  with pytest.raises(ConfigError, match=message):
    dist_ens.train(config, str(tmp_path / 'w'), devices=jax.devices()[:data])
  assert not (tmp_path / 'w').exists()  # refused before anything was written


def test_a_data_axis_that_is_not_a_power_of_two_is_refused():
  # The edge names the config's field; core's canonical sums refuse the same split plainly.
  from dist_ens.core import step as step_lib  # pylint: disable=g-import-not-at-top
  from dist_ens.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from dist_ens.run import mesh_layout  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match=r'config.mesh.data=3: .* power of two'):
    mesh_layout.check_canonical(6, 3)
  with pytest.raises(ValueError, match=r'^canonical sums: a data axis of 3 devices is not a '
                                       r'power of two\.$'):
    step_lib.canonical(None, 6, 'data', 3)
  assert step_lib.canonical_split(8, 4) is None and step_lib.canonical_split(6, 2)


def test_flags_are_added_once_and_only_where_missing(monkeypatch):
  from dist_ens.parallel import xla_flags  # pylint: disable=g-import-not-at-top
  assert xla_flags.flags_for('x86_64') == ('--xla_cpu_max_isa=AVX',
                                           '--xla_gpu_deterministic_ops=true')
  assert xla_flags.flags_for('aarch64') == ('--xla_gpu_deterministic_ops=true',)
  # A user's own value of a flag is kept, not overridden.
  assert xla_flags.missing('--xla_cpu_max_isa=SSE4_2 --foo', 'x86_64') == [
      '--xla_gpu_deterministic_ops=true']
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  added = xla_flags.set_flags()
  assert set(added) == set(xla_flags.flags_for())
  assert xla_flags.set_flags() == []
  import os  # pylint: disable=g-import-not-at-top
  assert os.environ['XLA_FLAGS'].split() == ['--xla_force_host_platform_device_count=8', *added]


def test_a_python_run_without_the_flags_warns(tmp_path, caplog):
  """A run from Python whose process started JAX without the flags says what to set, once;
  with them already in XLA_FLAGS (a user's --xla_cpu_max_isa=AVX2, say), it says nothing."""
  import dist_ens  # pylint: disable=g-import-not-at-top
  from dist_ens.parallel import xla_flags  # pylint: disable=g-import-not-at-top
  config = _config(MLP, 2, 1, 1)
  config.train.steps, config.train.log_every, config.checkpoint.every = 2, 2, 2
  import jax  # pylint: disable=g-import-not-at-top
  dist_ens.train(config, str(tmp_path / 'w'), devices=jax.devices()[:1])
  warned = [r.getMessage() for r in caplog.records if 'config.reproducible=True on cpu' in
            r.getMessage()]
  lacking = [f for f in xla_flags.missing() if f.startswith('--xla_cpu_')]
  if lacking:
    assert len(warned) == 1 and all(f in warned[0] for f in lacking), warned
  else:
    assert not warned


if __name__ == '__main__' and sys.argv[1] == 'worker':
  _worker(sys.argv[2].split(','), sys.argv[3])
