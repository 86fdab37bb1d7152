"""4 one-dimensional ResNet-20 members on MNIST-1D (generated offline), run here.

dist_ens's CIFAR ResNet (dist_ens/models/resnet.py) follows the input's rank, so on
MNIST-1D's [40, 1] signals it is a 1-D ResNet-20: kernels 3 (and 1 for projections),
16/32/64 channels over lengths 40/20/10, BatchNorm, 0.27M parameters. Trained like the
CIFAR recipes (configs/cifar10_wrn28_10.py) at this data set's scale: SGD with
Nesterov momentum 0.9, step decay x0.2 at 30/60/80 % of training, decoupled weight
decay on every parameter. Results measured with benchmarks/readme_results.py are in
README.md.

  dist-ens --config=configs/mnist1d_resnet.py --workdir=/tmp/mnist1d_resnet
"""

from pathlib import Path

import ml_collections

from dist_ens import load_config


def get_config() -> ml_collections.ConfigDict:
  config = load_config(Path(__file__).with_name('default.py'))
  config.num_members = 4
  config.data.name = 'mnist1d'
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
  config.train.steps = 310  # 10 epochs of 31 batches
  config.train.log_every = 31
  config.train.eval_every = 0
  config.checkpoint.every = 310
  return config
