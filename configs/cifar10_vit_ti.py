"""4 ViT-Ti members on CIFAR-10: the ViT-Ti/16 shape with 4x4 patches for 32x32 inputs.

ViT-Ti (Touvron et al. 2021's DeiT-Ti; width 192, 12 pre-norm blocks of 3 heads, MLP
768) over 64 tokens of 4x4 pixels, mean pooling: 5.4M parameters per member. Trained
from scratch the way small-data ViT recipes do: AdamW (weight decay 0.05), 10 epochs
of linear warm-up then cosine decay, batch 256, gradient clipping at 1.0, label
smoothing 0.1, random crop and flip. Not yet measured: the development machine cannot
download CIFAR-10, and ViTs from scratch need far more epochs than a ResNet to match it.

Members this size fit one device; it is the model of issue 34's 'model' mesh axis
at a scale that tests can build: models.vit.VIT_RULES (tensor parallel, by whole heads
where the axis divides 3) or FSDP by size split each member's leaves.

  tfds build cifar10 --file_format=array_record     # once, needs TensorFlow
  dist-ens --config=configs/cifar10_vit_ti.py --workdir=/tmp/cifar10_vit_ti
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
  config.data.batch_size = 256
  config.data.augment = 'crop_flip'
  config.data.member_order = 'shuffled'  # each member its own data order, as separate runs
  config.model.name = 'vit'
  config.model.patch_size = 4
  config.model.hidden = 192
  config.model.depth = 12
  config.model.heads = 3
  config.model.mlp_dim = 768
  config.model.pool = 'mean'
  config.model.dropout = 0.0
  config.optim.name = 'adam'
  config.optim.learning_rate = 1e-3
  config.optim.weight_decay = 0.05
  config.optim.schedule = 'cosine'
  config.optim.warmup_epochs = 10.0
  config.optim.grad_clip_norm = 1.0
  config.train.label_smoothing = 0.1
  config.train.epochs = 200  # 39,000 steps of 256
  config.train.log_every = 195
  config.train.eval_every = 1950
  config.checkpoint.every = 975
  config.eval.batch_size = 500
  return config
