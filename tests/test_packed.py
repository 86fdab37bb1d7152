"""Packed-Ensembles (config.ensemble.method='packed'; ensembles/packed.py).

The width and group arithmetic against the paper's (torch-uncertainty's) formula worked
out here by hand; a grouped layer is the block-diagonal dense (and conv) layer numpy
builds, so groups never mix; the parameter count is the paper's per-layer formula; then a
2-member run: resume is exact, Ensemble.load predicts what a numpy forward of the stored
grouped kernels gives; a CNN's grouped convolutions, built and stepped without a run; the
refusals. On the ResNets: the factories' widths build today's network by default and a
thinner one by the hand count; a packed ResNet's forward is an independent one of XLA's
grouped convolutions (feature_group_count, so a group reads its own inputs only), its
count the paper's formula. What every method's run keeps, one trace, predict as reported,
the same on one device and export per member, is the combination matrix's
(tests/test_combinations.py, its packed case); the ResNet runs are in the slow tier.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runs import killed_after
import support

import dist_ens
from dist_ens import Ensemble
from dist_ens.config import specs
from dist_ens.ensembles import methods, packed
from dist_ens.errors import ConfigError
from dist_ens.models import resnet
from dist_ens.models.spec import ModelSpec
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.report import build as report
from dist_ens.run import assemble, initial_state, mesh_layout


@pytest.mark.parametrize('width, members, alpha, gamma, want', [
    (256, 4, 2.0, 1, 128),  # int(512) / 4
    (256, 4, 2.0, 2, 128),  # 512 % (4 * 2) == 0
    (25, 2, 2.0, 5, 25),  # int(50) / 2; 50 % 10 == 0
    (25, 2, 2.5, 1, 31),  # int(62.5) = 62 (rounded down, as int() does), / 2
    (32, 1, 1.0, 4, 32),  # one member: the model itself in 4 groups
    (10, 3, 3.0, 1, 10),  # int(30) / 3
])
def test_a_members_width_is_int_alpha_c_over_m(width, members, alpha, gamma, want):
  assert packed.member_width(width, members, alpha, gamma) == want


@pytest.mark.parametrize('width, members, alpha, gamma, total, groups', [
    (25, 2, 2.0, 2, 50, 4),  # 50 % 4 != 0
    (25, 4, 1.0, 1, 25, 4),
    (3, 4, 1.0, 1, 3, 4),  # fewer units than groups
])
def test_a_width_the_groups_do_not_divide_is_refused_naming_the_fields(
    width, members, alpha, gamma, total, groups):
  message = support.one_line_refusal(
      lambda: packed.member_width(width, members, alpha, gamma, 'config.model.widths[0]=25'))
  assert 'config.ensemble.packed.alpha' in message and f'= {total} units' in message
  assert f'num_members * gamma = {groups}' in message and 'widths[0]' in message


def _block_diag_numpy(blocks):
  """scipy.linalg.block_diag by hand: [g, a, b] -> [g a, g b]."""
  g, a, b = blocks.shape
  out = np.zeros((g * a, g * b), blocks.dtype)
  for i in range(g):
    out[i * a:(i + 1) * a, i * b:(i + 1) * b] = blocks[i]
  return out


def test_a_grouped_dense_layer_is_the_block_diagonal_layer_and_groups_never_mix():
  rng = np.random.default_rng(0)
  kernel = rng.normal(size=(3, 4, 5)).astype(np.float32)  # 3 groups, 4 -> 5 units each
  full = np.asarray(packed.block_diagonal(jnp.asarray(kernel)))
  np.testing.assert_array_equal(full, _block_diag_numpy(kernel))
  x = rng.normal(size=(6, 12)).astype(np.float32)
  y = x @ full
  for g in range(3):  # Group g's outputs: group g's inputs times its own block.
    np.testing.assert_allclose(y[:, g * 5:(g + 1) * 5], x[:, g * 4:(g + 1) * 4] @ kernel[g],
                               rtol=1e-5, atol=1e-5)
  changed = x.copy()
  changed[:, :4] += 1.0  # Group 0's inputs only: the other groups' outputs stay.
  np.testing.assert_array_equal((changed @ full)[:, 5:], y[:, 5:])
  assert not np.allclose((changed @ full)[:, :5], y[:, :5])
  # grouped() is its inverse on the diagonal blocks (times sqrt(gamma): the group's fan-in).
  np.testing.assert_allclose(np.asarray(packed.grouped(jnp.asarray(full), 3)),
                             kernel * math.sqrt(3), rtol=1e-6)


def test_a_grouped_conv_is_xlas_grouped_convolution():
  rng = np.random.default_rng(1)
  kernel = rng.normal(size=(2, 3, 4, 6)).astype(np.float32)  # 2 groups, k=3, 4 -> 6 each
  x = rng.normal(size=(5, 10, 8)).astype(np.float32)  # [B, L, 2 * 4]
  full = packed.block_diagonal(jnp.asarray(kernel))  # [3, 8, 12]
  dense = jax.lax.conv_general_dilated(x, full, (1,), 'SAME',
                                       dimension_numbers=('NWC', 'WIO', 'NWC'))
  # XLA's grouped kernel: [k, in / groups, out], the groups' outputs side by side.
  grouped = jax.lax.conv_general_dilated(
      x, jnp.concatenate(list(kernel), axis=-1), (1,), 'SAME',
      dimension_numbers=('NWC', 'WIO', 'NWC'), feature_group_count=2)
  np.testing.assert_allclose(np.asarray(dense), np.asarray(grouped), rtol=1e-5, atol=1e-5)


STEPS = 8


def _config(**fields):
  config = support.config({
      'ensemble.method': 'packed', 'ensemble.packed.alpha': 2.0, 'ensemble.packed.gamma': 2,
      'num_members': 2, 'model.widths': (64, 32), 'train.steps': STEPS,
      'optim.learning_rate': 1e-2, 'mesh.member': 2, 'train.log_every': 4,
      'checkpoint.every': 4})
  return support.override(config, fields)


def _init_params(config, devices=1):
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:devices]),
                               (40, 1), 10)
  return jax.tree.map(np.asarray, initial_state.init_sharded(parts).params)


def _papers_layer_params(c_in: int, c_out: int, members: int, alpha: float, gamma: int,
                          first: bool = False, last: bool = False, window: int = 1,
                          bias: bool = True) -> int:
  """The paper's parameter count of one packed layer (all M members; torch-uncertainty's
  PackedLinear/PackedConv with first/last): int(alpha C_in) * int(alpha C_out) * window /
  (M gamma) weights plus int(alpha C_out) biases (none where `bias` is False: a ResNet's
  convs); the first layer reads C_in ungrouped, the output layer writes C_out per member
  (here: each member's ungrouped head)."""
  ext_in = c_in if first else int(alpha * c_in)
  ext_out = c_out * members if last else int(alpha * c_out)
  groups = 1 if first else members * (1 if last else gamma)
  return ext_in * ext_out * window // groups + (ext_out if bias else 0)


def test_the_parameter_count_is_the_papers_formula():
  # MNIST-1D's 40 inputs, widths (64, 32), 10 classes, M=2, alpha=2, gamma=2. By hand, the
  # packed network (all members): first layer 40 x int(2*64)=128 ungrouped + 128 biases =
  # 5248; hidden 128 x 64 / (M gamma = 4) + 64 = 2112; output 64 x 10 per member: 64 x 20
  # / 2 + 20 = 660; 8020 in all. A deep ensemble of 2 of the base model: 2 x (40*64 + 64 +
  # 64*32 + 32 + 32*10 + 10) = 9796.
  config = _config(**{'mesh.member': 1})
  params = _init_params(config)
  count = sum(leaf.size for leaf in jax.tree.leaves(params))
  formula = (_papers_layer_params(40, 64, 2, 2.0, 2, first=True)
             + _papers_layer_params(64, 32, 2, 2.0, 2)
             + _papers_layer_params(32, 10, 2, 2.0, 2, last=True))
  assert count == formula == 5248 + 2112 + 660
  # Each member: [40, 64], grouped [2, 32, 16], head [32, 10].
  assert params[0]['w'].shape == (2, 40, 64)
  assert params[1]['w'].shape == (2, 2, 32, 16) and params[1]['b'].shape == (2, 32)
  assert params[2]['w'].shape == (2, 32, 10)
  # A grouped kernel starts He-normal at its group's fan-in (32): std sqrt(2 / 32).
  assert np.std(params[1]['w']) == pytest.approx(math.sqrt(2 / 32), rel=0.1)


def _logits(ens, m, x):
  """Member m's packed MLP in numpy: grouped kernels as their block-diagonal matrices."""
  h = x.reshape(len(x), -1)
  params = jax.tree.map(np.asarray, ens.params)
  for i, layer in enumerate(params):
    w = layer['w'][m]
    w = _block_diag_numpy(w) if w.ndim == 3 else w
    h = h @ w + layer['b'][m]
    h = np.maximum(h, 0) if i < len(params) - 1 else h
  return h


def _train(config, workdir, actions=()):
  return dist_ens.train(config, str(workdir), devices=jax.devices()[:2], actions=actions)


def _preempted_and_resumed(config, workdir, step):
  """The run of `config` in `workdir` preempted after `step` (checked), then resumed to its
  end: the resumed run's final metrics."""
  stopped = _train(config, workdir, actions=[support.PreemptAt(step)])
  assert stopped['preempted'] and stopped['step'] == step
  return _train(config, workdir)


def test_resume_is_exact_and_load_predicts_the_members_grouped_networks(tmp_path):
  """Resumed from what a kill after the step-4 checkpoint leaves, the run ends as the
  straight one, its params bit for bit; Ensemble.load predicts the mean softmax of the
  members' numpy forwards through the block-diagonal matrices of their stored grouped
  kernels."""
  config = lambda: _config(**{'eval.shift': 'gaussian_noise:1'})
  straight = _train(config(), tmp_path / 'a')
  resumed = _train(config(), killed_after(tmp_path / 'a', 4, tmp_path / 'b'))
  assert resumed['step'] == STEPS and resumed['ensemble'] == straight['ensemble']
  assert straight['shift']['corruptions']['gaussian_noise']['1']['ensemble']['nll'] > 0
  assert straight['joint']['ensemble'] > 0
  ens = Ensemble.load(tmp_path / 'a', devices=jax.devices()[:1])
  support.assert_trees_equal(ens.params, Ensemble.load(tmp_path / 'b',
                                                       devices=jax.devices()[:1]).params)
  assert np.asarray(ens.params[1]['w']).shape == (2, 2, 32, 16)  # Stored grouped.
  # The same on one device as on the run's mesh, and export per member: the matrix's
  # packed case (support.check_loaded_run), a regression run; here the classifier's
  # accuracy as reported.
  test = dist_ens.data.load_dataset('mnist1d').test
  prediction = ens.predict(test.x, preprocessed=True)
  accuracy = float(np.mean(prediction.probs.argmax(-1) == test.y))
  assert accuracy == pytest.approx(straight['ensemble']['accuracy'], abs=2e-3)
  probs = [np.exp(z - z.max(-1, keepdims=True)) for z in (_logits(ens, m, test.x)
                                                           for m in range(2))]
  np.testing.assert_allclose(prediction.probs,
                             np.mean([p / p.sum(-1, keepdims=True) for p in probs], 0),
                             atol=1e-5)


def test_the_cnns_convolutions_after_the_first_are_grouped():
  """A packed CNN as a run builds it (its sharded init and one train step, without a
  run): the first conv reads the input whole, the second is grouped, and it steps."""
  config = _config(**{'model.name': 'cnn', 'model.channels': (12, 8), 'model.kernel_sizes': (3, 3),
                      'model.strides': (2, 2), 'mesh.member': 1})
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:1]),
                               (40, 1), 10)
  state = initial_state.init_sharded(parts)
  params = jax.tree.map(np.asarray, state.params)
  convs, head = params['convs'], params['head']['w']
  # int(2 * 12) / 2 = 12 and int(2 * 8) / 2 = 8 channels per member; the first conv reads
  # the input whole, the second is 2 groups of 6 -> 4 channels, the head reads 8 per position.
  assert convs[0]['w'].shape == (2, 3, 1, 12)
  assert convs[1]['w'].shape == (2, 2, 3, 6, 4) and convs[1]['b'].shape == (2, 8)
  assert head.shape == (2, 10 * 8, 10)  # 40 -> 20 -> 10 positions, 8 channels.
  step = assemble.build_step(parts, per_member_batches=False, form=('vmap', None))
  sharding = mesh_lib.batch_sharding(parts.mesh)
  x, y = next(dist_ens.data.BatchIterator(dist_ens.data.load_dataset('mnist1d').train, 32,
                                          seed=0))
  state, metrics = step(state, parts.device_hparams(), dist_ens.data.to_global(x, sharding),
                        dist_ens.data.to_global(y, sharding))
  assert np.isfinite(np.asarray(metrics.loss)).all()
  moved = jax.tree.map(np.asarray, state.params)['convs'][1]['w']
  assert not np.allclose(moved, convs[1]['w'])  # The grouped kernel trained.


@pytest.mark.parametrize('fields, match', [
    ({'ensemble.packed.alpha': 0.0}, r'packed.alpha=0.0 must be a finite number > 0'),
    ({'ensemble.packed.alpha': -2.0}, r'packed.alpha=-2.0 must be a finite number > 0'),
    ({'ensemble.packed.alpha': float('inf')}, r'packed.alpha=inf must be a finite number'),
    ({'ensemble.packed.gamma': 0}, r'packed.gamma=0 must be an int >= 1'),
])
def test_bad_fields_are_refused_naming_the_field(fields, match):
  config = _config(**fields)
  message = support.method_refusal(config)
  assert re.search(match, message), message


def test_other_models_and_undivided_widths_are_refused_before_anything(tmp_path):
  config = _config(**{'model.name': 'vit', 'model.depth': 1, 'model.hidden': 8,
                      'model.heads': 2, 'model.mlp_dim': 8, 'model.patch_size': 4})
  message = support.refused_before_anything(_train, config, tmp_path / 'r')
  assert "config.model.name in ('mlp', 'cnn', 'resnet', 'resnet18', 'wide_resnet'), not " \
         "'vit'" in message, message
  # ResNet-8's stem: int(1.5 * 16) = 24 channels, 2 members * 8 groups = 16.
  config = _config(**{'model.name': 'resnet', 'model.depth': 8, 'ensemble.packed.gamma': 8,
                      'ensemble.packed.alpha': 1.5})
  message = support.refused_before_anything(_train, config, tmp_path / 's')
  assert "config.model.name='resnet''s stem (16 channels)" in message, message
  assert 'gamma = 16' in message, message
  # int(2 * 25) = 50 units, 2 members * 4 groups = 8.
  config = _config(**{'model.widths': (64, 25), 'ensemble.packed.gamma': 4})
  message = support.refused_before_anything(_train, config, tmp_path / 'n')
  assert 'config.model.widths[1]=25' in message and 'gamma = 8' in message, message
  with pytest.raises(ConfigError, match="ensemble.own='head'"):
    methods.from_spec(specs.method_spec(_config(**{'ensemble.own': 'head'})))


# ResNets ---------------------------------------------------------------------------------


def _resnet_spec(name='resnet', depth=8, **fields):
  return ModelSpec(name=name, factory='', kwargs={}, widths=(), channels=(), kernel_sizes=(),
                   strides=(), conv_impl='auto', dropout=0.0, depth=depth, **fields)


def test_resnet_widths_build_todays_network_by_default_and_a_thinner_one_by_hand():
  x = jnp.zeros((1, 12, 1))
  for name, depth, fields in [('resnet', 8, {}), ('resnet18', None, {}),
                              ('wide_resnet', 10, {'widen_factor': 2})]:
    spec = _resnet_spec(name, depth, **fields)
    default = resnet.MAKERS[name](spec, 10)
    explicit = resnet.MAKERS[name](spec, 10, resnet.default_widths(spec))
    # Same tree, same bits (ResNet-18's 11M weights: its shapes; its code is resnet's).
    init = jax.eval_shape if name == 'resnet18' else lambda f, *a: jax.jit(f)(*a)
    a, b = (init(m.init, jax.random.key(3), x) for m in (default, explicit))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(
        *((u.shape, v.shape) if name == 'resnet18' else (u, v))), a, b)
  # ResNet-8 (1 block per stage) at widths (8, 4, 6, 10) on 1 input channel, kernels 3
  # (1-D), 10 classes; convs carry no bias, each BatchNorm a scale and a bias.
  stem = 1 * 8 * 3 + 2 * 8
  block1 = 8 * 4 * 3 + 4 * 4 * 3 + 8 * 4 + 3 * 2 * 4  # conv1, conv2, 1x1 proj, 3 BNs.
  block2 = 4 * 6 * 3 + 6 * 6 * 3 + 4 * 6 + 3 * 2 * 6
  block3 = 6 * 10 * 3 + 10 * 10 * 3 + 6 * 10 + 3 * 2 * 10
  head = 10 * 10 + 10
  params, _ = jax.eval_shape(resnet.make_resnet(_resnet_spec(), 10, (8, 4, 6, 10)).init,
                             jax.random.key(0), x)
  assert sum(p.size for p in jax.tree.leaves(params)) == stem + block1 + block2 + block3 + head
  with pytest.raises(ValueError, match=r'widths of the stem and its 3 stages'):
    resnet.make_resnet(_resnet_spec(), 10, (8, 4, 6))


def _conv(x, w, stride):
  """A conv of x [B, L, C] by a plain kernel [k, in, out] or a grouped one [g, k, in / g,
  out / g], as XLA's grouped convolution: group g's outputs read group g's inputs only."""
  groups = 1 if w.ndim == 3 else w.shape[0]
  if groups > 1:
    w = jnp.concatenate(list(w), axis=-1)  # XLA's [k, in / g, out], groups side by side.
  return jax.lax.conv_general_dilated(x, w, (stride,), 'SAME', feature_group_count=groups,
                                      dimension_numbers=('NWC', 'WIO', 'NWC'))


def _bn(p, s, x):
  return (x - s['mean']) / np.sqrt(s['var'] + 1e-5) * p['scale'] + p['bias']


def _packed_resnet_logits(name, params, state, x):
  """One member's packed ResNet-8 / WRN-10 (1-D), evaluation mode, written independently
  of models/resnet.py: grouped kernels go through _conv's feature groups."""
  relu = lambda h: np.maximum(h, 0)
  h = _conv(x, params['stem'], 1)
  if name == 'resnet':
    h = relu(_bn(params['stem_bn'], state['stem_bn'], h))
  for i, (p, s) in enumerate(zip(params['blocks'], state['blocks'])):
    stride = 1 if i == 0 else 2
    if name == 'resnet':
      out = relu(_bn(p['bn1'], s['bn1'], _conv(h, p['conv1'], stride)))
      out = _bn(p['bn2'], s['bn2'], _conv(out, p['conv2'], 1))
      short = _bn(p['proj_bn'], s['proj_bn'], _conv(h, p['proj'], stride)) if 'proj' in p else h
      h = relu(out + short)
    else:  # Pre-activation; a projection reads the normalised input.
      a = relu(_bn(p['bn1'], s['bn1'], h))
      out = relu(_bn(p['bn2'], s['bn2'], _conv(a, p['conv1'], stride)))
      h = _conv(out, p['conv2'], 1) + (_conv(a, p['proj'], stride) if 'proj' in p else h)
  if name == 'wide_resnet':
    h = relu(_bn(params['final_bn'], state['final_bn'], h))
  return np.asarray(h).mean(1) @ params['head']['w'] + params['head']['b']


@pytest.mark.parametrize('name, depth, grouped', [
    ('resnet', 8, {'conv2', 'proj'}),  # A basic block's first conv: M groups only.
    ('wide_resnet', 10, {'conv1', 'conv2', 'proj'}),
])
def test_a_packed_resnet_is_xlas_grouped_convolutions(name, depth, grouped):
  spec = _resnet_spec(name, depth, widen_factor=1)
  member = resnet.MAKERS[name](spec, 5, (8, 8, 12, 16))
  model = packed.wrap(member, name, gamma=2)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(6, 12, 1)), jnp.float32)
  params, state = jax.jit(model.init)(jax.random.key(0), x)  # one program, not one an op
  for p in params['blocks']:
    convs = {k for k in ('conv1', 'conv2', 'proj') if k in p}
    assert {k for k in convs if p[k].ndim == 4} == grouped & convs
  assert params['stem'].ndim == 3  # The stem reads the input whole.
  # Non-trivial BatchNorms: random scales, biases and running statistics.
  params = jax.tree.map(lambda a: a if a.ndim > 1 else jnp.asarray(
      rng.uniform(0.5, 1.5, a.shape), a.dtype), params)
  state = jax.tree.map(lambda a: jnp.asarray(rng.uniform(0.5, 1.5, a.shape), a.dtype), state)
  logits, _ = jax.jit(lambda p, s: model.apply(p, s, x, train=False))(params, state)
  want = _packed_resnet_logits(name, params, state, x)
  np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-4)


def test_a_packed_resnets_parameter_count_is_the_papers_formula():
  # ResNet-8 on MNIST-1D (1-D kernels 3, 1 input channel), 10 classes, M=2, alpha=2,
  # gamma=2: channels (16, 16, 32, 64), int(2 C) / 2 = C per member. Per conv the paper's
  # count without bias (torch-uncertainty's bias=False); each BatchNorm 2 x int(alpha C).
  config = _config(**{'model.name': 'resnet', 'model.depth': 8, 'mesh.member': 1})
  params = _init_params(config)
  count = lambda c_in, c_out, window=3, gamma=2, **kw: _papers_layer_params(
      c_in, c_out, 2, 2.0, gamma, window=window, bias=False, **kw)
  bn = lambda c: 2 * int(2.0 * c)
  formula = count(1, 16, first=True) + bn(16)  # The stem.
  for c_in, c_out in [(16, 16), (16, 32), (32, 64)]:
    formula += count(c_in, c_out, gamma=1) + count(c_out, c_out) + 2 * bn(c_out)
    if c_in != c_out:
      formula += count(c_in, c_out, window=1) + bn(c_out)
  formula += _papers_layer_params(64, 10, 2, 2.0, 2, last=True)
  assert sum(leaf.size for leaf in jax.tree.leaves(params)) == formula
  block = params['blocks'][2]
  assert block['conv1'].shape == (2, 3, 32, 64)  # [M, k, in, out]: ungrouped per member.
  assert block['conv2'].shape == (2, 2, 3, 32, 32)  # [M, gamma, k, in / 2, out / 2].
  assert block['proj'].shape == (2, 2, 1, 16, 32)
  assert params['head']['w'].shape == (2, 64, 10)


def _resnet_run_config(**fields):
  return _config(**{'model.name': 'resnet', 'model.depth': 8, 'train.steps': 4,
                    'train.log_every': 2, 'checkpoint.every': 2, **fields})


@pytest.fixture(scope='module')
def resnet_run(tmp_path_factory):
  """(workdir, final metrics) of the slow tier's packed ResNet run: 2 ResNet-8 members on
  MNIST-1D, 4 steps; the resume test ends where it does."""
  workdir = tmp_path_factory.mktemp('packed_resnet') / 'a'
  return workdir, _train(_resnet_run_config(), workdir)


# Slow; fast covers: a packed ResNet-8's forward against XLA's grouped convolutions, with
# non-trivial BatchNorm statistics (test_a_packed_resnet_is_xlas_grouped_convolutions[resnet]);
# a packed run's Ensemble.load predicting its members' grouped networks (the MLP's
# test_resume_is_exact_and_load_predicts_the_members_grouped_networks); a method's ResNet
# BatchNorm state through a run, load and predict (test_masksembles'
# test_a_masked_resnet_predicts_its_masked_members_and_exports); export per member and
# predict as reported (test_combinations' packed case); a method's report (test_masksembles'
# test_ensemble_load_predicts_the_members_mean_of_their_masked_networks_and_exports, test_report).
@pytest.mark.slow
def test_a_packed_resnet_run_loads_predicts_and_exports(resnet_run, tmp_path):
  straight_dir, _ = resnet_run
  ens = Ensemble.load(straight_dir, devices=jax.devices()[:1])
  test = dist_ens.data.load_dataset('mnist1d').test
  x = test.x[:64]
  probs = []
  for m in range(2):
    logits = _packed_resnet_logits('resnet', ens.member(m), ens.member_state(m),
                                   jnp.asarray(x).reshape(len(x), -1, 1))
    probs.append(np.asarray(jax.nn.softmax(logits)))
  np.testing.assert_allclose(ens.predict(x, preprocessed=True).probs, np.mean(probs, 0),
                             atol=1e-5)
  paths = ens.export(tmp_path / 'members')
  jax.tree.map(np.testing.assert_array_equal, dist_ens.load_member(paths[1]), ens.member(1))
  assert report.make_report(straight_dir) == straight_dir / 'report'


# Fast cover: test_resume_is_exact_and_load_predicts_the_members_grouped_networks (a packed
# run's state is its members' own params, grouped kernels included, on the MLP as here); a
# ResNet's BatchNorm statistics resume bit for bit in test_adapters'
# test_linen_batchnorm_dropout_members_predict_and_resume.
@pytest.mark.slow
def test_a_packed_resnet_resumes_exactly(resnet_run, tmp_path):
  straight_dir, straight = resnet_run
  resumed = _preempted_and_resumed(_resnet_run_config(), tmp_path / 'b', 2)
  assert resumed['step'] == 4 and resumed['ensemble'] == straight['ensemble']
  support.assert_trees_equal(Ensemble.load(straight_dir, devices=jax.devices()[:1]).params,
                             Ensemble.load(tmp_path / 'b', devices=jax.devices()[:1]).params)


# Fast cover: test_a_packed_resnet_is_xlas_grouped_convolutions[wide_resnet].
@pytest.mark.slow
def test_a_packed_wide_resnet_trains_and_loads(tmp_path):
  config = _resnet_run_config(**{'model.name': 'wide_resnet', 'model.depth': 10,
                                 'model.widen_factor': 1, 'train.steps': 2})
  result = _train(config, tmp_path)
  ens = Ensemble.load(tmp_path, devices=jax.devices()[:1])
  assert ens.member(0)['blocks'][1]['conv1'].shape == (2, 3, 8, 16)  # Grouped, gamma 2.
  test = dist_ens.data.load_dataset('mnist1d').test
  accuracy = np.mean(ens.predict(test.x, preprocessed=True).probs.argmax(-1) == test.y)
  assert abs(accuracy - result['ensemble']['accuracy']) <= 2e-3
