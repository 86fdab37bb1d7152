"""Every built-in model family keeps the run's contract (issue 64 item 2), generated from
the registry: each name of dist_ens.models.MODELS, at a tiny size, trains 4 members (2 of
the one-size ResNet-18) for 2 steps, is preempted after step 1 and resumes, tracing its
train step once; loaded, it predicts the accuracy the run reported and the same on one
device, and exports each member (support.check_loaded_run). A family added to MODELS
without a size here fails the fast test below.

The runs are the slow tier's: the fast tier trains the MLP and the token transformer
through every option of the combination matrix (tests/test_combinations.py), and the
others end to end in their own files (test_packed, test_sngp and test_masksembles the
ResNets, test_vit the ViT, test_architectures LeNet-5).
"""

import logging

import numpy as np
import pytest

import combinations_table as table
import support
import test_combinations as matrix

import dist_ens
from dist_ens import data, models

# Each family at a size that compiles in seconds, on the data it reads.
SIZES = {
    'mlp': {'model.widths': (8,)},
    'cnn': {'model.channels': (4, 4, 4)},
    'lenet5': {},
    'resnet': {'model.depth': 8},
    'resnet18': {},
    'wide_resnet': {'model.depth': 10, 'model.widen_factor': 1},
    'vit': {'model.patch_size': 4, 'model.hidden': 16, 'model.depth': 1, 'model.heads': 2,
            'model.mlp_dim': 16},
    # The matrix's token task: its option's model and its data set.
    'token_transformer': table.OPTIONS['token_classification'].overrides,
}
# ResNet-18 has one size (11.2M parameters a member): its run trains 2 members, not 4, as
# its cost beyond compiling is per member (Adam's state saved at steps 1 and 2, restored,
# loaded twice, exported and read back: a 727 MB workdir at 4 members). Two members still
# make a member axis, split over 2 devices.
MEMBERS = {'resnet18': 2}


def _images(n, seed):
  """8x8 one-channel images in 3 classes (two half-image means' signs)."""
  x = np.random.default_rng(seed).normal(size=(n, 8, 8, 1)).astype(np.float32)
  return x, ((x[:, :4].mean((1, 2, 3)) > 0).astype(np.int32)
             + (x[:, :, :4].mean((1, 2, 3)) > 0))


def _signals(n, seed):
  x = np.random.default_rng(seed).normal(size=(n, 16, 1)).astype(np.float32)
  return x, (x[:, :8, 0].mean(1) > 0).astype(np.int32)


def _dataset(name):
  if name == 'token_transformer':
    return matrix.DATASETS['tokens']
  make = _signals if name in ('mlp', 'cnn') else _images
  return data.from_arrays(*make(64, 0), *make(32, 1), name='toy')


def test_every_registered_model_has_a_contract_case():
  assert set(SIZES) == set(models.MODELS)


@pytest.mark.slow  # Fast cover: the module doc.
@pytest.mark.parametrize('name', sorted(models.MODELS))
def test_a_model_family_trains_resumes_loads_predicts_and_exports(name, tmp_path, caplog):
  caplog.set_level(logging.INFO, logger='absl')
  config = support.config(SIZES[name], model__name=name, num_members=MEMBERS.get(name, 4),
                          train__steps=2, train__log_every=2, checkpoint__every=1,
                          checkpoint__keep=2)
  config.data.prefetch, config.eval.batch_size, config.data.batch_size = 0, 64, 16
  dataset, workdir = _dataset(name), tmp_path / 'w'
  stopped = dist_ens.train(config, str(workdir), dataset=dataset,
                           actions=[support.PreemptAt(1)])
  assert stopped['preempted'] and stopped['step'] == 1, stopped
  caplog.clear()
  resumed = dist_ens.train(config, str(workdir), dataset=dataset)
  assert 'resuming from the checkpoint at step 1' in caplog.text
  assert resumed['step'] == 2 and resumed['train_step_traces'] == 1, resumed
  support.check_loaded_run(workdir, dataset, resumed)
