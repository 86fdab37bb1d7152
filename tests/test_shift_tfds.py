"""eval.shift='tfds:NAME': the prepared <corruption>_<severity> configs of a -C style TFDS
dataset, written here as ArrayRecord (as tests/test_tfds.py does), evaluated as shifted
test sets without TensorFlow; and the errors when none is prepared or shapes differ."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import support

from dist_ens import data
from dist_ens.config.loading import load_config
from dist_ens.config.checks import validate
from dist_ens.errors import ConfigError
from dist_ens import Ensemble
from dist_ens.training.trainer import train

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (8, 8, 3)


def _images(n, seed):
  """uint8 images of 4 classes (a noisy colour each), and labels."""
  rng = np.random.default_rng(seed)
  y = rng.integers(0, 4, n).astype(np.int32)
  centres = np.random.default_rng(0).integers(40, 215, (4, 1, 1, 3))
  x = np.clip(centres[y] + rng.normal(0, 40, (n, *SHAPE)), 0, 255).astype(np.uint8)
  return x, y


def _as_inputs(x):
  return x.astype(np.float32) * np.float32(1.0 / 255.0)  # as TFDS images are preprocessed


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
  """data_dir with contrast_1 (the run's own test split) and gaussian_noise_2 (its first
  25 examples) prepared; pixelate_3 a folder without a prepared version."""
  path = tmp_path_factory.mktemp('tfds_c')
  test = _images(60, 2)
  first_25 = (test[0][:25], test[1][:25])
  for name, examples in (('contrast_1', test), ('gaussian_noise_2', first_25)):
    support.prepare_tfds_images(path, 'tiny_corrupted', {'test': examples}, 4, config=name)
  for folder in ('not_a_config', 'pixelate_3'):
    (path / 'tiny_corrupted' / folder).mkdir()
  return path, test


def _config(data_dir, shift='tfds:tiny_corrupted'):
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.model.widths, config.data.batch_size = 2, (16,), 32
  config.train.steps, config.train.log_every, config.checkpoint.every = 30, 30, 30
  config.mesh.member, config.mesh.data, config.writers = 2, 2, ('jsonl',)
  config.data.data_dir, config.eval.shift = str(data_dir), shift
  return config


def test_prepared_configs_are_the_shifted_test_sets(tmp_path, devices, prepared):
  data_dir, (test_x, test_y) = prepared
  train_x, train_y = _images(300, 1)
  dataset = data.from_arrays(_as_inputs(train_x), train_y, _as_inputs(test_x), test_y)
  final = train(_config(data_dir), str(tmp_path), devices=devices[:4], dataset=dataset)
  assert 'tensorflow' not in sys.modules
  shift = final['shift']
  assert shift['pairs'] == 2 and shift['spec'] == 'tfds:tiny_corrupted'
  assert {c: set(s) for c, s in shift['corruptions'].items()} == {
      'contrast': {'1'}, 'gaussian_noise': {'2'}}  # prepared ones only
  assert 'value_range' not in shift  # nothing corrupted on device
  # contrast_1 holds the run's own test split: the clean metrics again.
  same = shift['corruptions']['contrast']['1']['ensemble']
  assert same['nll'] == pytest.approx(final['ensemble']['nll'], rel=1e-6)
  assert same['accuracy'] == final['ensemble']['accuracy']
  # gaussian_noise_2 holds its first 25 examples: the accuracy there, from the loaded ensemble.
  out = Ensemble.load(tmp_path, devices=devices[:4]).predict(_as_inputs(test_x[:25]),
                                                              preprocessed=True)
  want = np.mean(np.argmax(np.asarray(out.probs), -1) == test_y[:25])
  got = shift['corruptions']['gaussian_noise']['2']['ensemble']['accuracy']
  assert got == pytest.approx(want)
  assert shift['cA'] == pytest.approx((got + same['accuracy']) / 2)
  assert json.loads((tmp_path / 'final_metrics.json').read_text())['shift']['cA'] == shift['cA']


def test_errors_name_the_field_before_training(tmp_path, devices, prepared):
  data_dir, (test_x, test_y) = prepared
  dataset = data.from_arrays(_as_inputs(test_x), test_y, _as_inputs(test_x), test_y)
  with pytest.raises(ConfigError, match=r"eval\.shift='tfds:elsewhere': no prepared "
                                        r'elsewhere/<corruption>_<severity>.*tfds build '
                                        r'elsewhere/gaussian_noise_1 --file_format=array_record'):
    train(_config(data_dir, 'tfds:elsewhere'), str(tmp_path / 'a'), devices=devices[:4],
          dataset=dataset)
  assert not (tmp_path / 'a').exists()
  small = data.from_arrays(*(_as_inputs(_images(40, 4)[0][:, :4, :4]), _images(40, 4)[1]) * 2)
  with pytest.raises(ConfigError, match=r"eval\.shift.*'tiny_corrupted/contrast_1' holds "
                                        r'inputs of shape \(8, 8, 3\).*\(4, 4, 3\)'):
    train(_config(data_dir), str(tmp_path / 'b'), devices=devices[:4], dataset=small)
  for spec in ('tfds:', 'tfds:tiny_corrupted,contrast:1', 'tfds:tiny_corrupted/contrast_1'):
    with pytest.raises(ConfigError, match=r"eval\.shift=.*'tfds:NAME' takes one TFDS"):
      validate(_config(data_dir, spec))
