"""4 small ViT members on scikit-learn's 8x8 digits: the transformer built-in, run here.

A ViT (dist_ens/models/vit.py) of 2x2 patches (16 tokens of 4 pixels), width 64,
4 pre-norm blocks of 4 heads, MLP 128, mean pooling: 0.14M parameters, small enough
that a laptop CPU trains the 4 members in minutes on 1,437 training images. AdamW
with a short warm-up and cosine decay, light dropout: transformers lack a CNN's
locality prior and overfit a data set this small without it. No augmentation
(digits must not be mirrored). Not yet measured.

mesh.rules names models.vit.VIT_RULES, so with a 'model' mesh axis
(--config.mesh.model=2) each member's blocks split tensor-parallel (attention by whole
heads, the MLP Megatron-style) rather than by FSDP's size rule; on the default mesh
(model=1) the rules are unused and every member is whole on its device, as it fits.

  dist-ens --config=configs/digits_vit.py --workdir=/tmp/digits_vit
"""

from pathlib import Path

import ml_collections

from dist_ens import load_config


def get_config() -> ml_collections.ConfigDict:
  config = load_config(Path(__file__).with_name('default.py'))
  config.num_members = 4
  config.data.name = 'digits'
  config.data.batch_size = 128
  config.model.name = 'vit'
  config.model.patch_size = 2
  config.model.hidden = 64
  config.model.depth = 4
  config.model.heads = 4
  config.model.mlp_dim = 128
  config.model.pool = 'mean'
  config.model.dropout = 0.1
  config.mesh.rules = 'dist_ens.models.vit:VIT_RULES'
  config.optim.name = 'adam'
  config.optim.learning_rate = 1e-3
  config.optim.weight_decay = 0.05
  config.optim.schedule = 'cosine'
  config.optim.warmup_steps = 55  # 5 epochs of 11 batches
  config.optim.grad_clip_norm = 1.0
  config.train.steps = 550  # 50 epochs
  config.train.log_every = 55
  config.train.eval_every = 0
  config.checkpoint.every = 550
  return config
