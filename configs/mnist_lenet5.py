"""10 LeNet-5 members on MNIST, with the batch, optimizer and schedule of the WRN recipe.

Published targets (uncertainty-baselines' MNIST LeNet-5; NOT results of dist_ens,
whose development machine cannot download MNIST): single model 99.1% accuracy /
NLL 0.037; ensemble of 10: 99.4% / 0.016.

LeNet-5 as in dist_ens/models/lenet.py (61,706 parameters; no BatchNorm: it keeps its
biases). Trained like configs/cifar10_wrn28_10.py (whose docstring explains the
weight-decay conversion): batch 512, SGD with Nesterov momentum 0.9, learning rate
0.1 per 128 examples (0.4) after one epoch of warm-up, x0.2 at epochs 60/120/160 of
200, L2 2e-4 as decoupled weight decay 4e-3 on every parameter. No augmentation:
digits must not be mirrored.

  tfds build mnist --file_format=array_record     # once, needs TensorFlow
  dist-ens --config=configs/mnist_lenet5.py --workdir=/tmp/mnist_lenet5
"""

from pathlib import Path

import ml_collections

from dist_ens import load_config


def get_config() -> ml_collections.ConfigDict:
  config = load_config(Path(__file__).with_name('default.py'))
  config.num_members = 10
  config.mesh.member = -1
  config.data.name = 'mnist'
  config.data.mean = (0.1307,)
  config.data.std = (0.3081,)
  config.data.batch_size = 512
  config.data.member_order = 'shuffled'  # each member its own data order, as separate runs
  config.model.name = 'lenet5'
  config.model.dropout = 0.0
  config.optim.name = 'sgd'
  config.optim.momentum = 0.9
  config.optim.nesterov = True
  config.optim.learning_rate = 0.1 * 512 / 128
  config.optim.weight_decay = 2 * 2e-4 / (1 - 0.9)  # L2 2e-4, decoupled
  config.optim.decay_mask = 'all'
  config.optim.schedule = 'step'
  config.optim.decay_boundaries = (60 / 200, 120 / 200, 160 / 200)
  config.optim.decay_factor = 0.2
  config.optim.warmup_steps = 60_000 // 512  # one epoch
  config.train.epochs = 200  # 23,400 steps of 512
  config.train.log_every = 117
  config.train.eval_every = 117 * 10
  config.checkpoint.every = 117 * 5
  return config
