"""8 CNN members on MNIST-1D: the mnist1d reference CNN (published single model: 94%)."""

import ml_collections

from dist_ens.configuration import load_config_file


def get_config() -> ml_collections.ConfigDict:
  config = load_config_file(__file__, 'default.py')
  config.model.name = 'cnn'
  config.optim.learning_rate = 1e-2
  config.optim.weight_decay = 0.1
  config.train.steps = 3000
  return config
