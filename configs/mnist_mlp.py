"""10 MLP members on MNIST (TFDS 'mnist', prepared once as ArrayRecord; see README).

The uncertainty-baselines MNIST deep ensemble is 10 members (published with LeNet-5:
single 99.1% / NLL 0.037, ensemble 99.4% / 0.016); this is the same ensemble size and
training length with the MLP of our model zoo (784-512-512-10).

  tfds build mnist --file_format=array_record     # once, needs TensorFlow
  dist-ens --config=configs/mnist_mlp.py --workdir=/tmp/mnist_mlp
On 8 devices, 10 members need e.g. --config.mesh.member=2 --config.mesh.data=4.
"""

from pathlib import Path

import ml_collections

from dist_ens import load_config


def get_config() -> ml_collections.ConfigDict:
  config = load_config(Path(__file__).with_name('default.py'))
  config.num_members = 10
  config.data.name = 'mnist'
  config.data.mean = (0.1307,)
  config.data.std = (0.3081,)
  config.data.batch_size = 128
  config.model.name = 'mlp'
  config.model.widths = (512, 512)
  config.optim.learning_rate = 1e-3
  config.optim.weight_decay = 1e-4
  config.optim.schedule = 'cosine'
  config.train.steps = 9380  # 20 epochs of 60,000
  config.train.log_every = 500
  config.train.eval_every = 2345  # every 5 epochs
  config.checkpoint.every = 2345
  return config
