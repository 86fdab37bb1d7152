"""The TFDS path on real ArrayRecord files written here: reading without TensorFlow,
training through the same code a user's 'mnist' takes, and the real configs."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import support

from dist_ens.config import specs
from dist_ens import data
import dist_ens  # pylint: disable=g-import-not-at-top
from dist_ens.config.loading import load_config  # pylint: disable=g-import-not-at-top
from dist_ens.errors import ConfigError  # pylint: disable=g-import-not-at-top

ROOT = Path(__file__).resolve().parents[1]


def _pixel(i):
  # Every example's pixels hold its key (mod 256) and its label is key % 10, so a
  # read can be checked for x and y belonging together, whatever order TFDS stored.
  return i % 256


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  """tiny_mnist (28x28x1) and tiny_cifar (32x32x3), stored like TFDS's own image sets:
  256 train examples (keys 0..255) and 64 test (keys 12800..12863; 12800 % 2560 == 0),
  each image filled with _pixel(key), its label key % 10."""
  path = tmp_path_factory.mktemp('tfds')
  for name, shape in (('tiny_mnist', (28, 28, 1)), ('tiny_cifar', (32, 32, 3))):
    splits = {split: (np.stack([np.full(shape, _pixel(i), np.uint8) for i in keys]), keys % 10,
                      keys[0]) for split, keys in (('train', np.arange(256)),
                                                   ('test', 12_800 + np.arange(64)))}
    support.prepare_tfds_images(path, name, splits, 10)
  return str(path)


def _data_config(data_dir, name='tiny_mnist', **kw):
  config = load_config(ROOT / 'configs' / 'default.py')
  config.data.name, config.data.data_dir = name, data_dir
  config.data.update(kw)
  return config


def test_reads_array_record_without_tensorflow(data_dir):
  config = _data_config(data_dir)
  ds = data.load_dataset('tiny_mnist', specs.data_spec(config))
  assert 'tensorflow' not in sys.modules
  assert ds.input_shape == (28, 28, 1) and ds.num_classes == 10
  assert ds.train.num_examples == 256 and ds.test.x.shape == (64, 28, 28, 1)
  indices = np.array([5, 0, 200, 5, 255])
  x, y = ds.train.read(indices)
  assert x.dtype == np.float32 and 0 <= x.min() and x.max() <= 1
  keys = np.rint(x[:, 0, 0, 0] * 255).astype(int)
  np.testing.assert_array_equal(y, keys % 10)
  assert np.all(x == x[:, :1, :1, :1])  # Whole images decoded, not just a pixel.
  # A batch read (sorted internally) equals reading each example alone.
  for i, index in enumerate(indices):
    xi, yi = ds.train.read(np.array([index]))
    np.testing.assert_array_equal(xi[0], x[i])
    assert yi[0] == y[i]
  all_keys = np.rint(ds.train.read(np.arange(256))[0][:, 0, 0, 0] * 255).astype(int)
  assert sorted(all_keys) == list(range(256))
  np.testing.assert_array_equal(ds.test.y, np.rint(ds.test.x[:, 0, 0, 0] * 255).astype(int) % 10)


def test_normalisation_applies_to_tfds_images(data_dir):
  config = _data_config(data_dir, 'tiny_cifar', mean=(0.5, 0.5, 0.5), std=(0.5, 0.25, 0.5))
  ds = data.load_dataset('tiny_cifar', specs.data_spec(config))
  raw = data.load_dataset('tiny_cifar', specs.data_spec(_data_config(data_dir, 'tiny_cifar')))
  x, _ = ds.train.read(np.array([3]))
  expected = (raw.train.read(np.array([3]))[0][0, 0, 0] - 0.5) / np.array([0.5, 0.25, 0.5])
  np.testing.assert_allclose(x[0, 0, 0], expected, rtol=1e-5)


@pytest.mark.parametrize('model,order,mesh', [
    ('cnn', 'bootstrap', (4, 2)),
    pytest.param('mlp', 'shared', (2, 4), marks=pytest.mark.slow)])
def test_trains_on_a_tfds_dataset(tmp_path, data_dir, model, order, mesh):
  """A run on a TFDS set trains every member with one trace. The [mlp-shared] case is
  the slow tier's: test_real_configs_run_on_same_shaped_data[mnist_mlp.py-tiny_mnist]
  trains an MLP in the shared order on the same 2 x 4 mesh in the fast tier."""
  config = _data_config(data_dir, member_order=order, batch_size=32)
  config.model.name = model
  config.model.channels, config.model.kernel_sizes, config.model.strides = (8, 8), (3, 3), (2, 2)
  config.mesh.member, config.mesh.data = mesh
  config.train.steps, config.train.log_every, config.train.eval_every = 6, 3, 0
  final = dist_ens.train(config, str(tmp_path))
  assert len(final['members']['accuracy']) == 8 and final['train_step_traces'] == 1
  assert np.isfinite(final['ensemble']['nll'])


def test_missing_dataset_is_one_clear_error(tmp_path):
  config = _data_config(str(tmp_path / 'empty'), name='cifar10')
  with pytest.raises(ConfigError, match=r"config.data.name='cifar10': no prepared dataset "
                                        r"'cifar10' in data_dir .*empty.*tfds build cifar10 "
                                        r"--file_format=array_record"):
    dist_ens.train(config, str(tmp_path / 'workdir'))
  assert not (tmp_path / 'workdir').exists()


def test_cli_missing_dataset_exits_nonzero(tmp_path):
  env = dict(os.environ, XLA_FLAGS=support.xla_flags(8), JAX_PLATFORMS='cpu')
  proc = subprocess.run(
      [sys.executable, '-m', 'dist_ens.main', '--config=configs/mnist_mlp.py',
       f'--workdir={tmp_path / "w"}', f'--config.data.data_dir={tmp_path / "none"}',
       '--config.mesh.member=2', '--config.mesh.data=4'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "no prepared dataset 'mnist'" in proc.stderr and 'tfds build mnist' in proc.stderr
  assert not (tmp_path / 'w').exists()


@pytest.mark.parametrize('config_file,stand_in', [
    ('mnist_mlp.py', 'tiny_mnist'), ('fashion_mnist_cnn.py', 'tiny_mnist'),
    ('cifar10_cnn.py', 'tiny_cifar')])
def test_real_configs_run_on_same_shaped_data(tmp_path, data_dir, config_file, stand_in):
  config = load_config(ROOT / 'configs' / config_file)
  assert config.data.name in ('mnist', 'fashion_mnist', 'cifar10')
  config.data.name, config.data.data_dir = stand_in, data_dir
  config.mesh.member = 2  # 10 or 8 members on 8 devices.
  config.mesh.data = 4
  config.data.batch_size = 32
  config.train.steps, config.train.log_every, config.train.eval_every = 3, 3, 0
  config.optim.warmup_steps = 0
  # Narrow layers keep the test fast; shapes, preprocessing and M are the config's.
  config.model.channels = tuple(8 for _ in config.model.channels)
  config.model.widths = tuple(32 for _ in config.model.widths)
  final = dist_ens.train(config, str(tmp_path))
  assert final['num_members'] == config.num_members and final['train_step_traces'] == 1
  assert len(final['members']['accuracy']) == config.num_members
  assert np.isfinite(final['ensemble']['nll'])
