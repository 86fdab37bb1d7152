"""Evaluation and Ensemble.load read a shared backbone once (config.ensemble.own,
batchensemble): each member's params are formed inside the evaluation's vmap, never
stacked M times, and predict the same as the M formed members through the plain model.
"""

import jax
import numpy as np
import pytest

import dist_ens
from dist_ens import Ensemble, data
from dist_ens.run import assemble
from dist_ens.parallel import sharding_rules
from test_own import _backbone_file, _own_config

WIDE = 512  # A backbone big enough that one copy per member would show.


def _wide_backbone(tmp_path):
  r = np.random.default_rng(5)
  body = {'0/w': r.normal(size=(40, WIDE)).astype(np.float32) * 0.05,
          '0/b': np.zeros((WIDE,), np.float32)}
  np.savez(tmp_path / 'wide.npz', **body)
  return str(tmp_path / 'wide.npz'), sum(v.nbytes for v in body.values())


def _eval_bytes_per_device(config):
  """Bytes of the params evaluation reads, per device, from the arrays' shardings."""
  devices = jax.devices()[:config.mesh.member * config.mesh.data]
  run = assemble.build_run(config, devices=devices, shapes=((40, 1), 10))
  params = run.evaluator().view(run.parts.abstract_state).params
  return sum(leaf.dtype.itemsize * int(np.prod(leaf.sharding.shard_shape(leaf.shape)))
             for leaf in jax.tree.leaves(params))


@pytest.mark.parametrize('own', ['head', 'lora'])
def test_evaluation_reads_the_backbone_once_whatever_m(tmp_path, own):
  source, backbone = _wide_backbone(tmp_path)
  config = lambda m: _own_config(source, own=own, members=m, **{
      'model.widths': (WIDE,), 'ensemble.lora_rank': 2})
  read2, read8 = (_eval_bytes_per_device(config(m)) for m in (2, 8))
  # 2 devices on 'member': 1 then 4 members each. 3 more members per device add 3 heads
  # (and LoRA factors), 60-75 KB; formed before the step, as evaluation did, every
  # member's backbone would be read too ([M, 40, 512]): 3 x 82 KB more. (LoRA's merged
  # kernels are formed per member inside the step, as in training: transient, not stored.)
  assert read8 - read2 < backbone


@pytest.mark.parametrize('own', ['head', 'batchensemble'])
def test_ensemble_load_predicts_as_its_formed_members(tmp_path, own):
  source, body = _backbone_file(tmp_path)
  config = _own_config(source, own=own, members=4)
  config.train.steps, config.train.log_every, config.train.eval_every = 12, 12, 0
  config.checkpoint.every, config.mesh.data = 12, 1
  final = dist_ens.train(config, str(tmp_path / 'run'), devices=jax.devices()[:2])
  ens = Ensemble.load(tmp_path / 'run', devices=jax.devices()[:2])
  shared = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(ens._stored)[0]
            if 'shared' in sharding_rules.path_names(path)]
  assert body['0/w'].shape in {leaf.shape for leaf in shared}  # once: no member axis
  # The same members through the plain model, their params formed [M, ...] first.
  plain = Ensemble(ens.config, ens.model, ens.params, ens.frozen, ens.step, ens.input_shape,
                   ens.num_classes, ens.mesh, model_state=ens.model_state)
  assert jax.tree.leaves(ens.params)[0].shape[0] == 4
  test = data.load_dataset('mnist1d').test
  got = ens.predict(test.x, preprocessed=True)
  want = plain.predict(test.x, preprocessed=True)
  np.testing.assert_allclose(got.member_probs, want.member_probs, rtol=1e-5, atol=1e-6)
  accuracy = float(np.mean(got.probs.argmax(-1) == test.y))
  assert accuracy == pytest.approx(final['ensemble']['accuracy'], abs=2e-3)
  for m in range(4):  # member(i) forms one member: the formed stack's row i.
    jax.tree.map(np.testing.assert_array_equal, ens.member(m),
                 jax.tree.map(lambda a, i=m: np.asarray(a)[i], ens.params))
