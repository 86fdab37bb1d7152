"""Regression targets through TFDS: a float Tensor label feature (no num_classes) is read
as float32 targets, the streamed training split is standardised like arrays, and a run
reports its metrics in the targets' units. Written here as ArrayRecord, read without
TensorFlow."""

from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds

import dist_ens
from dist_ens import data
from dist_ens.data import DataSpec

ROOT = Path(__file__).resolve().parents[1]


def _example(i):
  x = np.array([np.sin(i), np.cos(0.5 * i), (i % 7) / 7.0], np.float32)
  return x, np.float32(100.0 + 30.0 * x[0] - 10.0 * x[1] + 0.25 * (i % 3))


class TinyTable(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Tabular inputs [3] and a float target, stored as TFDS stores such features."""
  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'features': tfds.features.Tensor(shape=(3,), dtype=np.float32),
        'target': tfds.features.Tensor(shape=(), dtype=np.float32)}),
        supervised_keys=('features', 'target'))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples(0, 400), 'test': self._generate_examples(1000, 100)}

  def _generate_examples(self, offset, n):
    for i in range(offset, offset + n):
      x, y = _example(i)
      yield i, {'features': x, 'target': y}


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp('tfds_regression')
  TinyTable(data_dir=str(path), file_format='array_record').download_and_prepare()
  return str(path)


def test_float_targets_are_read_as_float32_never_cast(data_dir):
  dataset = data.load_dataset('tiny_table', DataSpec('tiny_table', data_dir, add_channel=False))
  assert dataset.num_classes == 0 and dataset.input_shape == (3,)
  x, y = dataset.train.read(np.arange(400))
  assert y.dtype == np.float32 and x.shape == (400, 3)
  # Each row's target is its own example's (TFDS may store examples in any order).
  np.testing.assert_allclose(y, 100 + 30 * x[:, 0] - 10 * x[:, 1], atol=0.51)
  assert len(np.unique(y)) > 300  # Not truncated to integer classes.
  np.testing.assert_allclose(np.sort(dataset.test.y), np.sort([_example(i)[1] for i in range(
      1000, 1100)]), rtol=1e-6)


def test_a_regression_run_on_tfds_reports_target_units(data_dir, tmp_path):
  config = dist_ens.load_config(ROOT / 'configs' / 'uci.py')
  config.data.name, config.data.data_dir = 'tiny_table', data_dir
  config.data.add_channel = False
  config.num_members, config.train.epochs = 2, 0
  config.train.steps, config.train.log_every, config.checkpoint.every = 200, 100, 200
  config.data.batch_size, config.writers = 50, ('jsonl',)
  final = dist_ens.train(config, str(tmp_path))
  test_y = np.array([_example(i)[1] for i in range(1000, 1100)])
  # In the targets' units: far below their spread (~21), not a standardised ~0.1-1.
  assert final['ensemble']['rmse'] < 0.3 * np.std(test_y)
  assert final['ensemble']['rmse'] > 1e-3
