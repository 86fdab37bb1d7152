"""Masksembles (config.ensemble.method='masksembles').

The masks against the paper's definition, worked out here by hand and by an independent
numpy draw of the paper's procedure: m = int(c / (s (1 - (1 - 1/s)^M))) ones per mask,
every unit used, two masks sharing about m/s units, fixed, distinct and drawn from the
seed. Then a 2-member run: members differ only through their masks (one shared W and
bias per layer, member m's kernel W * mask_m), resume is exact, and Ensemble.load
predicts what the run evaluated, exports and reports; the refusals. On the ResNets: masks
on the inputs of every block conv and of the head (torch-uncertainty's MaskedConv2d /
MaskedLinear), none on the stem; a channel of a block's input masked out for a member
does not reach that member's conv, while the identity shortcut carries it; a tiny 2-member
depth-8 ResNet run predicts as an independent forward of the masked kernels and exports
them (its resume in the slow tier: the MLP's resume above holds every kind of state a
masked run has, the shared entries and each member's fixed masks). One trace and the
same prediction on one device are the combination matrix's (tests/test_combinations.py,
its masksembles case).
"""

import re

import jax
import numpy as np
import pytest

from runs import killed_after
import support

import dist_ens
from dist_ens import Ensemble
from dist_ens.ensembles import batchensemble, masksembles, stored
from dist_ens.models import layers, resnet
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.run import assemble, initial_state, mesh_layout


def _draw(width, count, scale, seed):
  return masksembles.generate(width, count, scale, np.random.default_rng(seed))


def _overlap(masks):
  """The mean number of units two masks of a set share."""
  n = len(masks)
  return np.mean([masks[i] @ masks[j] for i in range(n) for j in range(i + 1, n)])


def _paper(width, count, scale, rng):
  """The paper's own procedure (its code's generation_wrapper): m ones per mask among
  int(m * s) positions for s near `scale`, drawn until exactly `width` positions are used
  (and, as dist_ens asks, the masks differ); the unused positions dropped."""
  m = int(width / (scale * (1 - (1 - 1 / scale) ** count)))
  while True:
    for s in np.linspace(0.8 * scale, 1.2 * scale, 41):
      if int(m * s) < width:
        continue
      masks = rng.random((count, int(m * s))).argsort(-1).argsort(-1) < m
      used = masks.any(0)
      if used.sum() == width and len({row.tobytes() for row in masks}) == count:
        return masks[:, used].astype(np.float32)


# (scale, m): 64 / (2 (1 - 1/2^4)) = 64 / 1.875 = 34.1; 64 / (3 (1 - (2/3)^4)) =
# 64 / (3 * 65/81) = 26.6; 64 / (4 (1 - (3/4)^4)) = 64 / (4 * 175/256) = 23.4.
@pytest.mark.parametrize('scale, ones', [(2.0, 34), (3.0, 26), (4.0, 23)])
def test_each_mask_has_the_papers_number_of_ones_and_together_they_use_every_unit(scale, ones):
  for seed in range(5):
    masks = _draw(64, 4, scale, seed)
    assert masks.shape == (4, 64) and set(np.unique(masks)) == {0.0, 1.0}
    np.testing.assert_array_equal(masks.sum(1), [ones] * 4)
    assert masks.any(0).all()
  assert masksembles.ones_per_mask(64, 4, scale) == ones


def test_two_masks_share_about_m_over_scale_units_as_the_papers_draw_does():
  rng = np.random.default_rng(123)
  overlaps = []
  for scale, ones in ((1.5, 43), (2.0, 34), (4.0, 23)):  # 64 / (1.5 (1 - 3^-4)) = 43.2
    ours = np.mean([_overlap(_draw(64, 4, scale, seed)) for seed in range(200)])
    paper = np.mean([_overlap(_paper(64, 4, scale, rng)) for _ in range(200)])
    # Two independent m-subsets of m*s positions share m^2 / (m s) = m/s on average; the
    # draws' spread is about 0.6 units, 0.04 over 200 draws.
    assert ours == pytest.approx(ones / scale, rel=0.06)
    assert abs(ours - paper) < 0.25, (scale, ours, paper)
    overlaps.append(ours / ones)
  assert overlaps == sorted(overlaps, reverse=True)  # A larger scale, less overlap.


def test_masks_are_fixed_by_the_seed_distinct_and_refused_where_they_cannot_cover():
  np.testing.assert_array_equal(_draw(32, 4, 2.0, 7), _draw(32, 4, 2.0, 7))
  assert not np.array_equal(_draw(32, 4, 2.0, 7), _draw(32, 4, 2.0, 8))
  for seed in range(20):  # 8 units, 4 masks of 4 ones (8 / 1.875 = 4.3): few sets.
    masks = _draw(8, 4, 2.0, seed)
    assert len({row.tobytes() for row in masks}) == 4 and masks.any(0).all()
  np.testing.assert_array_equal(masksembles.layer_masks(0, 1, 32, 4, 2.0),
                                masksembles.layer_masks(0, 1, 32, 4, 2.0))
  assert not np.array_equal(masksembles.layer_masks(0, 0, 32, 4, 2.0),
                            masksembles.layer_masks(0, 1, 32, 4, 2.0))
  # 3 units, 4 masks: int(3 / 1.875) = 1 one each, 4 distinct masks of 1 of 3 units: none.
  message = support.one_line_refusal(lambda: _draw(3, 4, 2.0, 0))
  assert 'masksembles.scale=2.0' in message and '3 units' in message


STEPS = 8


def _config(**fields):
  config = support.config({
      'ensemble.method': 'masksembles', 'num_members': 2, 'model.widths': (32, 16),
      'train.steps': STEPS, 'optim.learning_rate': 1e-2, 'mesh.member': 2,
      'train.log_every': 4, 'checkpoint.every': 4})
  return support.override(config, fields)


def _stored(ens):
  """The params as the run stores them: BatchEnsemble's entries."""
  return jax.device_get(ens._stored)  # pylint: disable=protected-access


def _train(config, workdir, actions=(), dataset=None):
  return dist_ens.train(config, str(workdir), devices=jax.devices()[:2], actions=actions,
                        dataset=dataset)


def _preempted_and_resumed(config, workdir, step, dataset=None):
  """(stopped, resumed): the final metrics of the run of `config` (on `dataset`) in
  `workdir` preempted after `step`, and of its resume to the end."""
  stopped = _train(config, workdir, actions=[support.PreemptAt(step)], dataset=dataset)
  return stopped, _train(config, workdir, dataset=dataset)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """The 2-member run trained straight ('a', evaluated on a shift too), and resumed from
  what a kill after its step-4 checkpoint leaves ('b'); (root, straight, resumed, born
  params)."""
  root = tmp_path_factory.mktemp('masksembles')
  config = _config()
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:2]),
                               (40, 1), 10)
  born = jax.tree.map(np.asarray, jax.jit(lambda s: s.params, out_shardings=mesh_lib.replicated(
      parts.mesh))(initial_state.init_sharded(parts)))
  straight = _train(_config(**{'eval.shift': 'gaussian_noise:1'}), root / 'a')
  # Evaluated on the clean test split only: eval.* may change on resume
  # (io/checkpoint.ALWAYS_COMPATIBLE), and the straight run's shift and joint metrics are
  # the ones checked, so the resume does not evaluate them again.
  resumed = _train(_config(**{'eval.joint_tau': 0}),
                   killed_after(root / 'a', 4, root / 'b'))
  return root, straight, resumed, born


def test_members_differ_only_through_their_masks_and_resume_is_exact(runs):
  root, straight, resumed, born = runs
  assert resumed['step'] == STEPS
  assert resumed['ensemble'] == straight['ensemble']
  trained = Ensemble.load(root / 'a', devices=jax.devices()[:1])
  support.assert_trees_equal(_stored(trained),
                             _stored(Ensemble.load(root / 'b', devices=jax.devices()[:1])))

  params = _stored(trained)
  # One W and one bias per layer (no member axis), the masks per member, unchanged.
  assert params[0] == {'w': {'shared': params[0]['w']['shared']},
                       'b': {'shared': params[0]['b']['shared']}}
  for i, width in ((1, 32), (2, 16)):
    w = params[i]['w']
    assert w['shared'].shape == (width, (16, 10)[i - 1]) and w['r'].shape == (2, width)
    np.testing.assert_array_equal(w['r'], born[i]['w']['r'])
    np.testing.assert_array_equal(w['s'], np.ones((2, w['shared'].shape[1])))
    assert set(np.unique(w['r'])) == {0.0, 1.0} and w['r'].any(0).all()
    assert not np.array_equal(w['r'][0], w['r'][1])
  assert not np.array_equal(params[1]['w']['shared'], born[1]['w']['shared'])  # It trained.
  # Each member's own params: the shared W with its input rows masked, the same biases.
  members = jax.tree.map(np.asarray, trained.params)
  for m in range(2):
    np.testing.assert_array_equal(members[0]['w'][m], params[0]['w']['shared'])
    for i in (1, 2):
      np.testing.assert_array_equal(members[i]['w'][m], params[i]['w']['shared']
                                    * params[i]['w']['r'][m][:, None])
      np.testing.assert_array_equal(members[i]['b'][m], params[i]['b']['shared'])


def _masked_logits(ens, m, x):
  """Member m's MLP in numpy: the shared kernels with its masks on the hidden units."""
  p, h = _stored(ens), x.reshape(len(x), -1)
  for i in range(3):
    w = p[i]['w']['shared'] * (p[i]['w']['r'][m][:, None] if 'r' in p[i]['w'] else 1)
    h = h @ w + p[i]['b']['shared']
    h = np.maximum(h, 0) if i < 2 else h
  return h


def test_ensemble_load_predicts_the_members_mean_of_their_masked_networks_and_exports(runs):
  result = runs[1]
  assert result['shift']['corruptions']['gaussian_noise']['1']['ensemble']['nll'] > 0  # Shift,
  assert result['joint']['ensemble'] > 0  # and jointly (eval.joint_tau's dyadic batches).
  # (Its export and report go into the straight run's workdir: nothing else reads them.)
  ens = support.check_load_predict_export(runs[0] / 'a', result, _masked_logits)
  # Each member exported as its own plain MLP, its masks in its kernels.
  p = _stored(ens)
  for m in range(2):
    exported = dist_ens.load_member(runs[0] / 'a' / 'members' / f'member_{m}.npz')
    np.testing.assert_array_equal(exported[1]['w'],
                                  p[1]['w']['shared'] * p[1]['w']['r'][m][:, None])


def test_the_cnns_channels_are_masked_and_its_head_reads_them_per_position():
  config = _config(**{'model.name': 'cnn', 'model.channels': (12, 12), 'model.kernel_sizes': (3, 3),
                      'model.strides': (2, 2), 'mesh.member': 1})
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:1]),
                               (40, 1), 10)
  params = jax.tree.map(np.asarray, initial_state.init_sharded(parts).params)
  assert 'r' not in params['convs'][0]['w']
  conv, head = params['convs'][1]['w'], params['head']['w']
  assert conv['r'].shape == (2, 12) and head['r'].shape == (2, head['shared'].shape[0])
  last = masksembles.layer_masks(config.seed, 1, 12, 2, 2.0)
  # [positions, channels] flattened: feature p * 12 + c reads channel c.
  np.testing.assert_array_equal(head['r'], np.tile(last, (1, head['r'].shape[1] // 12)))
  assert stored.stored_axes(params)['head']['w'] == {'shared': None, 'r': 0, 's': 0}


@pytest.mark.parametrize('fields, match', [
    ({'ensemble.masksembles.scale': 1.0}, r'masksembles.scale=1.0 must be a number in \(1, 6\]'),
    ({'ensemble.masksembles.scale': 7.0}, r'masksembles.scale=7.0 must be a number in \(1, 6\]'),
    ({'ensemble.masksembles.scale': 0.5}, r'masksembles.scale=0.5 must be a number in'),
    ({'reproducible': True}, "reproducible=True with config.ensemble.method='masksembles'"),
])
def test_bad_fields_are_refused_naming_the_field(fields, match):
  config = _config(**fields)
  message = support.method_refusal(config)
  assert re.search(match, message), message


def test_other_models_and_narrow_layers_are_refused_before_anything(tmp_path):
  config = _config(**{'model.name': 'vit', 'model.depth': 1, 'model.hidden': 8,
                      'model.heads': 2, 'model.mlp_dim': 8, 'model.patch_size': 4})
  message = support.refused_before_anything(_train, config, tmp_path / 'r')
  assert "config.model.name in ('mlp', 'cnn', 'resnet', 'resnet18', 'wide_resnet'), not " \
         "'vit'" in message, message
  # 2 members, a 3-unit layer: int(3 / (6 (1 - (5/6)^2))) = int(1.6) = 1 one each.
  config = _config(**{'model.widths': (3,), 'ensemble.masksembles.scale': 6.0})
  message = support.refused_before_anything(_train, config, tmp_path / 'n')
  assert 'masksembles.scale=6.0' in message and '3 units' in message


# ResNets ---------------------------------------------------------------------------------


def _resnet_config(**fields):
  return _config(**{'model.name': 'resnet', 'model.depth': 8, 'train.steps': 4,
                    'train.log_every': 2, 'checkpoint.every': 2, **fields})


def _init_entries(config):
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:1]),
                               (40, 1), 10)
  state = initial_state.init_sharded(parts)
  return jax.tree.map(np.asarray, (state.params, state.model_state))


def test_a_resnets_block_convs_and_head_read_masked_inputs_and_the_stem_does_not():
  config = _resnet_config(**{'mesh.member': 1})
  params, _ = _init_entries(config)
  assert set(params['stem']) == {'shared'}  # The stem reads the input whole.
  assert all(set(bn[k]) == {'shared'} for bn in [params['stem_bn']] for k in bn)
  layer = 0  # Each masked kernel its own masks, blocks in order, then the head.
  for block, (c_in, c_out) in zip(params['blocks'], [(16, 16), (16, 32), (32, 64)]):
    for name in ('conv1', 'conv2', 'proj'):
      if name not in block:
        continue
      width = c_in if name != 'conv2' else c_out
      np.testing.assert_array_equal(block[name]['r'], masksembles.layer_masks(
          config.seed, layer, width, 2, 2.0))
      assert block[name]['s'].shape == (2, c_out)
      layer += 1
    assert all(set(entry) == {'shared'} for k in block if k.endswith(('bn1', 'bn2', 'proj_bn'))
               for entry in block[k].values())  # BatchNorms: shared scales and biases.
  assert 'proj' not in params['blocks'][0] and layer == 8
  np.testing.assert_array_equal(params['head']['w']['r'],
                                masksembles.layer_masks(config.seed, 8, 64, 2, 2.0))


def test_a_masked_channel_of_a_blocks_input_reaches_the_member_only_by_the_identity():
  config = _resnet_config(**{'mesh.member': 1})
  params, state = _init_entries(config)
  block = params['blocks'][0]  # 16 -> 16: identity shortcut.
  block_state = jax.tree.map(lambda a: a[0], state['blocks'][0])
  mask = block['conv1']['r']
  m = 0
  c = int(np.flatnonzero(mask[m] == 0)[0])  # Out of member 0's mask, in member 1's.
  assert mask[1, c] == 1
  conv = layers.conv_for('xla')
  block_apply = resnet._basic_apply  # pylint: disable=protected-access

  # Jitted, one program for both members and inputs: eagerly, each op compiles its own.
  @jax.jit
  def forward(member_block, x):
    """(member_block's first conv on x, the block's own forward (models/resnet.py) in
    evaluation mode) of one member's entries."""
    p = batchensemble.member_params(member_block)
    return conv(x, p['conv1'], 1), block_apply(conv, p, block_state, x, 1, False)[0]

  x = np.random.default_rng(0).normal(size=(4, 10, 16)).astype(np.float32)
  moved = x.copy()
  moved[..., c] += 3.0
  one = lambda tree, i: jax.tree.map(lambda a: a[i] if a.shape[:1] == (2,) else a, tree)
  for member, reaches_conv in ((0, False), (1, True)):
    (h, y), (h_moved, y_moved) = (forward(one(block, member), v) for v in (x, moved))
    assert np.allclose(h, h_moved) is not reaches_conv
    changed = np.flatnonzero(np.abs(np.asarray(y_moved) - np.asarray(y)).max((0, 1)) > 1e-6)
    if reaches_conv:
      assert len(changed) > 1
    else:  # Only channel c changed: the identity carried it, the convs never saw it.
      assert list(changed) == [c]


def _conv1d(x, w, stride):
  """x [B, L, C] convolved by w [K, C, O] in numpy, 'SAME' as XLA pads it (the extra
  position, if any, after the input)."""
  k, length = w.shape[0], -(-x.shape[1] // stride)
  pad = max((length - 1) * stride + k - x.shape[1], 0)
  x = np.pad(x, ((0, 0), (pad // 2, pad - pad // 2), (0, 0)))
  windows = np.stack([x[:, i * stride:i * stride + k] for i in range(length)], 1)
  return np.einsum('blkc,kco->blo', windows, w)


def _masked_resnet_logits(stored_params, state, m, x):
  """Member m's ResNet-8 (1-D) in evaluation mode, written independently of
  models/resnet.py, in numpy (float64): each shared kernel with member m's mask on its
  input channels."""
  stored_params, state = (jax.tree.map(lambda a: np.asarray(a, np.float64), tree)
                          for tree in (stored_params, state))
  def w(entry):
    return entry['shared'] * (entry['r'][m][:, None] if 'r' in entry else 1)
  bn = lambda p, s, h: ((h - s['mean']) / np.sqrt(s['var'] + 1e-5) * w(p['scale'])
                        + w(p['bias']))
  relu = lambda h: np.maximum(h, 0)
  h = relu(bn(stored_params['stem_bn'], state['stem_bn'],
              _conv1d(np.asarray(x, np.float64), w(stored_params['stem']), 1)))
  for i, (p, s) in enumerate(zip(stored_params['blocks'], state['blocks'])):
    stride = 1 if i == 0 else 2
    out = relu(bn(p['bn1'], s['bn1'], _conv1d(h, w(p['conv1']), stride)))
    out = bn(p['bn2'], s['bn2'], _conv1d(out, w(p['conv2']), 1))
    short = (bn(p['proj_bn'], s['proj_bn'], _conv1d(h, w(p['proj']), stride))
             if 'proj' in p else h)
    h = relu(out + short)
  head = stored_params['head']
  return h.mean(1) @ w(head['w']) + w(head['b'])


def _softmax(logits):
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _mnist1d_part():
  """MNIST-1D's first 256 training and 64 test examples, as load_dataset gives them: the
  ResNet runs' data (the test below predicts those 64; evaluating all 1,000 test examples
  through ResNet-8 members was 0.5 of the run's 6 CPU s)."""
  full = dist_ens.data.load_dataset('mnist1d')
  return dist_ens.data.from_arrays(full.train.x[:256], full.train.y[:256], full.test.x[:64],
                                   full.test.y[:64], name='mnist1d', num_classes=10)


@pytest.fixture(scope='module')
def resnet_run(tmp_path_factory):
  """(workdir, final metrics) of the fast tier's one masked ResNet run: 2 ResNet-8 members
  on part of MNIST-1D (_mnist1d_part), 4 steps; the slow tier's resume test ends where it
  does."""
  workdir = tmp_path_factory.mktemp('masksembles_resnet') / 'a'
  return workdir, _train(_resnet_config(), workdir, dataset=_mnist1d_part())


def test_a_masked_resnet_predicts_its_masked_members_and_exports(resnet_run, tmp_path):
  ens = Ensemble.load(resnet_run[0], devices=jax.devices()[:1])
  x = _mnist1d_part().test.x
  # BatchNorm running statistics are each member's own (the module doc says why).
  probs = [_softmax(_masked_resnet_logits(_stored(ens), ens.member_state(m), m,
                                         x.reshape(len(x), -1, 1))) for m in range(2)]
  np.testing.assert_allclose(ens.predict(x, preprocessed=True).probs, np.mean(probs, 0),
                             atol=1e-5)
  exported = dist_ens.load_member(ens.export(tmp_path / 'members')[1])
  np.testing.assert_array_equal(exported['blocks'][1]['proj'],
                                _stored(ens)['blocks'][1]['proj']['shared']
                                * _stored(ens)['blocks'][1]['proj']['r'][1][:, None])


# Fast cover: test_members_differ_only_through_their_masks_and_resume_is_exact (a masked
# run's state is its shared entries and each member's fixed masks, on the MLP as here); a
# ResNet's BatchNorm statistics resume bit for bit in test_adapters'
# test_linen_batchnorm_dropout_members_predict_and_resume.
@pytest.mark.slow
def test_a_masked_resnet_resumes_exactly(resnet_run, tmp_path):
  straight_dir, straight = resnet_run
  stopped, resumed = _preempted_and_resumed(_resnet_config(), tmp_path / 'b', 2,
                                            dataset=_mnist1d_part())
  assert stopped['preempted'] and stopped['step'] == 2
  assert resumed['step'] == 4 and resumed['ensemble'] == straight['ensemble']
  support.assert_trees_equal(_stored(Ensemble.load(straight_dir, devices=jax.devices()[:1])),
                             _stored(Ensemble.load(tmp_path / 'b', devices=jax.devices()[:1])))


# Fast cover: test_a_masked_resnet_predicts_its_masked_members_and_exports.
@pytest.mark.slow
def test_a_masked_wide_resnet_trains_and_loads(tmp_path):
  config = _resnet_config(**{'model.name': 'wide_resnet', 'model.depth': 10,
                             'model.widen_factor': 1, 'train.steps': 2})
  result = _train(config, tmp_path)
  ens = Ensemble.load(tmp_path, devices=jax.devices()[:1])
  block = _stored(ens)['blocks'][1]  # 16 -> 32: both convs and the projection masked.
  assert {k: block[k]['r'].shape for k in ('conv1', 'conv2', 'proj')} == {
      'conv1': (2, 16), 'conv2': (2, 32), 'proj': (2, 16)}
  test = dist_ens.data.load_dataset('mnist1d').test
  accuracy = np.mean(ens.predict(test.x, preprocessed=True).probs.argmax(-1) == test.y)
  assert abs(accuracy - result['ensemble']['accuracy']) <= 2e-3
