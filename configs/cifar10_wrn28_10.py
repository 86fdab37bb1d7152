"""4 WRN-28-10 members on CIFAR-10: the deep-ensemble baseline recipe of uncertainty-baselines.

Published targets (uncertainty-baselines, baselines/cifar; NOT results of dist_ens,
whose development machine cannot download CIFAR): single model 96.0% accuracy /
NLL 0.159 / ECE 0.0231; ensemble of 4: 96.6% / 0.114 / 0.010.

The recipe (baselines/cifar/deterministic.py and utils.py there): WRN-28-10 with
BatchNorm (36.5M parameters), batch 512, SGD with Nesterov momentum 0.9, learning
rate 0.1 per 128 examples (0.4 at 512) with one epoch of linear warm-up, x0.2 at
epochs 60/120/160 of 200, L2 2e-4, random crop (pad 4) and horizontal flip.

Weight decay: the recipe adds 2e-4 * sum(w^2) over every weight (Keras l2 on conv
kernels, BatchNorm scales and offsets, the dense kernel and bias) to the loss, a
gradient of 4e-4 * w that then passes through the momentum. dist_ens decays
decoupled from the momentum (core/optim.py: each step subtracts lr * weight_decay * w).
Through momentum mu, a constant gradient term is applied 1 / (1 - mu) = 10 times
over, so the same steady-state shrinkage is weight_decay = 4e-4 / (1 - 0.9) = 4e-3,
on every parameter (decay_mask='all'). The two agree while the learning rate is
constant; around a decay step they differ for the ~10 steps the momentum remembers.

  tfds build cifar10 --file_format=array_record     # once, needs TensorFlow
  dist-ens plan --config=configs/cifar10_wrn28_10.py --memory_gb=80   # no data needed
  dist-ens --config=configs/cifar10_wrn28_10.py --workdir=/tmp/cifar10_wrn
"""

from pathlib import Path

import ml_collections

from dist_ens import load_config


def get_config() -> ml_collections.ConfigDict:
  config = load_config(Path(__file__).with_name('default.py'))
  config.num_members = 4
  config.data.name = 'cifar10'
  config.data.mean = (0.4914, 0.4822, 0.4465)
  config.data.std = (0.2470, 0.2435, 0.2616)
  config.data.batch_size = 512
  config.data.augment = 'crop_flip'
  config.data.member_order = 'shuffled'  # each member its own data order, as separate runs
  config.model.name = 'wide_resnet'
  config.model.depth = 28
  config.model.widen_factor = 10
  config.model.dropout = 0.0
  config.optim.name = 'sgd'
  config.optim.momentum = 0.9
  config.optim.nesterov = True
  config.optim.learning_rate = 0.1 * 512 / 128
  config.optim.weight_decay = 2 * 2e-4 / (1 - 0.9)  # L2 2e-4, decoupled (see above)
  config.optim.decay_mask = 'all'
  config.optim.schedule = 'step'
  config.optim.decay_boundaries = (60 / 200, 120 / 200, 160 / 200)
  config.optim.decay_factor = 0.2
  config.optim.warmup_steps = 50_000 // 512  # one epoch
  config.train.epochs = 200  # 19,400 steps of 512
  config.train.log_every = 97
  config.train.eval_every = 97 * 10
  config.checkpoint.every = 97 * 5
  config.eval.batch_size = 500
  return config
