"""4 WRN-28-10 members on CIFAR-100: configs/cifar10_wrn28_10.py's recipe on 100 classes.

Published target (uncertainty-baselines, baselines/cifar; NOT a result of dist_ens,
whose development machine cannot download CIFAR): ensemble of 4: 82.7% accuracy /
NLL 0.666. The recipe and its weight-decay conversion are explained in
configs/cifar10_wrn28_10.py.

  tfds build cifar100 --file_format=array_record     # once, needs TensorFlow
  dist-ens plan --config=configs/cifar100_wrn28_10.py --memory_gb=80   # no data needed
  dist-ens --config=configs/cifar100_wrn28_10.py --workdir=/tmp/cifar100_wrn
"""

from pathlib import Path

import ml_collections

from dist_ens import load_config


def get_config() -> ml_collections.ConfigDict:
  config = load_config(Path(__file__).with_name('cifar10_wrn28_10.py'))
  config.data.name = 'cifar100'
  # CIFAR-100's own per-channel statistics over its training images.
  config.data.mean = (0.5071, 0.4865, 0.4409)
  config.data.std = (0.2673, 0.2564, 0.2762)
  return config
