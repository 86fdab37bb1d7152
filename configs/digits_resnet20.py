"""4 ResNet-20 members on scikit-learn's 8x8 digits: the CIFAR ResNet recipe, run here.

The CIFAR ResNet-20 (He et al. 2016; 0.27M parameters, BatchNorm) trained like the
recipes of configs/cifar10_wrn28_10.py, shrunk to a data set of 1,437 training
images that a laptop CPU trains in minutes: SGD with Nesterov momentum, step decay
x0.2 at 30/60/80 % of training, weight decay on every parameter. No augmentation:
digits must not be mirrored, and an 8x8 image has little room to crop.
Results measured with benchmarks/readme_results.py are in README.md.

  dist-ens --config=configs/digits_resnet20.py --workdir=/tmp/digits_resnet20
"""

from pathlib import Path

import ml_collections

from dist_ens import load_config


def get_config() -> ml_collections.ConfigDict:
  config = load_config(Path(__file__).with_name('default.py'))
  config.num_members = 4
  config.data.name = 'digits'
  config.data.batch_size = 128
  config.model.name = 'resnet'
  config.model.depth = 20
  config.optim.name = 'sgd'
  config.optim.momentum = 0.9
  config.optim.nesterov = True
  config.optim.learning_rate = 0.1
  # Decoupled (lr * weight_decay * w a step), as configs/cifar10_wrn28_10.py explains.
  config.optim.weight_decay = 5e-3
  config.optim.decay_mask = 'all'
  config.optim.schedule = 'step'
  config.optim.decay_boundaries = (0.3, 0.6, 0.8)
  config.optim.decay_factor = 0.2
  config.train.steps = 110  # 10 epochs of 11 batches
  config.train.log_every = 22
  config.train.eval_every = 0
  config.checkpoint.every = 110
  return config
