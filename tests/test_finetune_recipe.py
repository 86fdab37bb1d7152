"""The fine-tuning recipe's shifted task (benchmarks/finetune.py, docs/finetune.md): the
training augmentation it names by import path is exactly eval.shift's test transform."""

import sys
from pathlib import Path

import numpy as np
import pytest

from dist_ens import importing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, as the recipe's PYTHONPATH=.
from benchmarks import finetune  # noqa: E402  pylint: disable=g-import-not-at-top


# Bits of two differently built programs: XLA's default level keeps them, -O0 not.
@pytest.mark.xla_default
def test_the_contrast_augmentation_is_the_shifted_test_transform_bit_for_bit():
  assert finetune.check_shift_matches('contrast:3')
  # A noise family is not claimed to match: Gaussian noise draws other keys in training
  # than eval.shift does on the test split. Checked in this child process, which pays
  # XLA's default level once for both (a test of its own would start a second child).
  assert not finetune.check_shift_matches('gaussian_noise:3')


def test_the_augment_path_of_the_recipe_resolves_to_the_module_function():
  fn = importing.load_object('benchmarks.finetune:contrast_3', 'config.data.augment')
  x = np.zeros((8, 8, 1), np.float32)
  x[:, 4:] = 1.0  # half black, half white: lower contrast pulls both towards the mean
  out = np.asarray(fn(None, x))
  assert fn is finetune.contrast_3 and 0.0 < out.min() < out.max() < 1.0
