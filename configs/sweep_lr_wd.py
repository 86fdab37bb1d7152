"""A learning-rate x weight-decay grid trained as ONE ensemble of 16 MLPs on MNIST-1D.

Every member has its own (learning_rate, weight_decay); the whole sweep compiles once.
The 4 members best on a validation split carved from train form the selected
ensemble (hyper-deep-ensemble style); members.csv lists every member.
"""

from pathlib import Path

import ml_collections

from dist_ens import load_config


def get_config() -> ml_collections.ConfigDict:
  config = load_config(Path(__file__).with_name('default.py'))
  config.num_members = 16
  config.optim.learning_rate = 'grid(3e-4,1e-3,3e-3,1e-2)'
  config.optim.weight_decay = 'grid(0.0,0.03,0.1,0.3)'
  config.data.validation_size = 500
  config.select.metric = 'nll'
  config.select.top_k = 4
  return config
