"""8 CNN members on MNIST-1D: the mnist1d reference CNN (published single model: 94%)."""

from pathlib import Path

import ml_collections

from dist_ens import load_config


def get_config() -> ml_collections.ConfigDict:
  config = load_config(Path(__file__).with_name('default.py'))
  config.model.name = 'cnn'
  config.optim.learning_rate = 1e-2
  config.optim.weight_decay = 0.1
  config.train.steps = 3000
  return config
