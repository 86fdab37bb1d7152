"""8 CNN members on CIFAR-10 (TFDS 'cifar10', prepared once as ArrayRecord).

A plain 4-layer strided CNN (64-128-256-256, kernel 3), AdamW with warmup and cosine
decay, no augmentation: a baseline, well short of ResNet figures. Not yet measured on
the real data set (the development machine cannot download it).

  tfds build cifar10 --file_format=array_record     # once, needs TensorFlow
  dist-ens --config=configs/cifar10_cnn.py --workdir=/tmp/cifar10
"""

from pathlib import Path

import ml_collections

from dist_ens import load_config


def get_config() -> ml_collections.ConfigDict:
  config = load_config(Path(__file__).with_name('default.py'))
  config.num_members = 8
  config.data.name = 'cifar10'
  config.data.mean = (0.4914, 0.4822, 0.4465)
  config.data.std = (0.2470, 0.2435, 0.2616)
  config.data.batch_size = 128
  config.model.name = 'cnn'
  config.model.channels = (64, 128, 256, 256)
  config.model.kernel_sizes = (3, 3, 3, 3)
  config.model.strides = (1, 2, 2, 2)
  config.optim.learning_rate = 2e-3
  config.optim.weight_decay = 0.05
  config.optim.schedule = 'cosine'
  config.optim.warmup_steps = 1000
  config.train.steps = 11720  # 30 epochs of 50,000
  config.train.log_every = 500
  config.train.eval_every = 1954
  config.checkpoint.every = 1954
  return config
