"""A diverse ensemble on scikit-learn's 8x8 digits: a pool of ResNet-20, CNN, ViT and MLP
members (4 seeds each) trained as one program, and the 4 best-together members picked
from it by greedy selection on validation (the recipe in docs/groups.md).

Each group is one of the repository's recipes, its model and optimizer fields as the
config that defines them sets them (docs/groups.md: a group overrides config.model and
config.optim):
  resnet20: configs/digits_resnet20.py (SGD, Nesterov, step decay, weight decay on all);
  cnn:      configs/fashion_mnist_cnn.py's 2-D CNN and AdamW (its 500 warm-up steps, 3.5%
            of 30 Fashion-MNIST epochs, left out: they outlast this run's warm-up need);
  vit:      configs/digits_vit.py (AdamW, warm-up and cosine decay, clipping, dropout);
  mlp:      configs/mnist_mlp.py's 512-512 MLP and AdamW with cosine decay.
Every member trains the same steps on the same batches (train.steps is the ensemble's):
50 epochs of the 1,137 images left beside the 300 of validation, digits_vit.py's length;
digits_resnet20.py's 10 epochs would leave the ViT far from trained.

select.method='greedy' then adds, with replacement, the member that most lowers the
validation NLL of the averaged probabilities, up to 4 picks over all 16 members (Caruana
et al. 2004; over architectures, the selection step of neural ensemble search, Zaidi et
al. 2021); final_metrics.json's 'greedy' has the picks and their test metrics, 'groups'
each architecture's own 4-member deep ensemble. benchmarks/groups_digits.py compares them.

  dist-ens --config=configs/digits_groups.py --workdir=/tmp/digits_groups
"""

from pathlib import Path

import ml_collections

from dist_ens import load_config

SEEDS = 4  # members per architecture


def get_config() -> ml_collections.ConfigDict:
  config = load_config(Path(__file__).with_name('default.py'))
  config.data.name = 'digits'
  config.data.batch_size = 128
  config.data.validation_size = 300  # what greedy selection and the group ranking read
  config.ensemble.groups = (
      {'name': 'resnet20', 'count': SEEDS,
       'model': {'name': 'resnet', 'depth': 20},
       'optim': {'name': 'sgd', 'momentum': 0.9, 'nesterov': True, 'learning_rate': 0.1,
                 'weight_decay': 5e-3, 'decay_mask': 'all', 'schedule': 'step',
                 'decay_boundaries': (0.3, 0.6, 0.8), 'decay_factor': 0.2}},
      {'name': 'cnn', 'count': SEEDS,
       'model': {'name': 'cnn', 'channels': (32, 64, 128), 'kernel_sizes': (3, 3, 3),
                 'strides': (2, 2, 2)},
       'optim': {'learning_rate': 1e-3, 'weight_decay': 1e-4, 'schedule': 'cosine'}},
      {'name': 'vit', 'count': SEEDS,
       'model': {'name': 'vit', 'patch_size': 2, 'hidden': 64, 'depth': 4, 'heads': 4,
                 'mlp_dim': 128, 'pool': 'mean', 'dropout': 0.1},
       'optim': {'learning_rate': 1e-3, 'weight_decay': 0.05, 'schedule': 'cosine',
                 'warmup_steps': 55, 'grad_clip_norm': 1.0}},
      {'name': 'mlp', 'count': SEEDS,
       'model': {'name': 'mlp', 'widths': (512, 512)},
       'optim': {'learning_rate': 1e-3, 'weight_decay': 1e-4, 'schedule': 'cosine'}},
  )
  config.num_members = SEEDS * len(config.ensemble.groups)
  config.select.method = 'greedy'
  config.select.greedy_size = SEEDS  # K picks: the size of one architecture's ensemble
  config.train.epochs = 50
  config.train.log_every = 50
  config.train.eval_every = 0
  config.checkpoint.every = 400  # 50 epochs of 8 batches: the end
  return config
