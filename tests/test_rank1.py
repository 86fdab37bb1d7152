"""Rank-1 BNNs (config.ensemble.method='rank1').

The math against independent arithmetic: both KLs against numerical integration of the
densities (scipy), the KL term's gradient against its derivative by hand, the annealing by
hand, the factorised forward ((h o s) W) o r + b (the model's own apply on layers.Factored
kernels: MLP, CNN, LeNet, ResNets) against its apply on the formed kernels W o (s r^T),
one draw for the batch and (ResNets) one per example, and a member's training outputs
(each example its own draws) and evaluation (the mean over its fixed draws) against a
numpy forward. Then a 2-member run: one shared W per kernel, factors and biases per
member, exact resume, Ensemble.load predicts the numpy mixture (mean over members and
their fixed draws of the softmaxes) and exports each member's draws; the refusals. What
every method's run keeps, one trace, predict as reported, the same on one device and
export per member, is the combination matrix's (tests/test_combinations.py, its rank1
case); a 2-member rank-1 ResNet-8 that loads as its members' formed networks, its resume
and its report are in the slow tier.
"""

import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate, stats

from runs import killed_after
import support

import dist_ens
from dist_ens import Ensemble, data
from dist_ens.core.step import BatchResult
from dist_ens.ensembles import rank1
from dist_ens import models
from dist_ens.models import mlp
from dist_ens.models.spec import ModelSpec
from dist_ens.report import build as report

OPTIONS = rank1.Options(prior='gaussian', prior_mean=1.0, prior_scale=0.1, init='random_sign',
                        init_scale=0.0316, train_samples=2, eval_samples=3, kl_annealing=0.5,
                        data_size=100)


def _kl_by_integration(q, p):
  """KL(q || p) = int q log(q / p), over the real line (t = tan(u) spreads the tails)."""
  f = lambda u: (lambda t: q.pdf(t) * (q.logpdf(t) - p.logpdf(t)) / math.cos(u)**2)(math.tan(u))
  return integrate.quad(f, -math.pi / 2 + 1e-9, math.pi / 2 - 1e-9, limit=400)[0]


@pytest.mark.parametrize('loc, scale, prior_loc, prior_scale', [
    (1.0, 0.1, 1.0, 0.1), (-1.0, 0.03, 1.0, 0.1), (0.7, 0.5, 1.0, 0.2), (2.0, 0.05, -0.5, 1.0)])
def test_both_kls_are_their_densities_integrated(loc, scale, prior_loc, prior_scale):
  gauss = float(rank1.kl_gaussian(loc, scale, prior_loc, prior_scale))
  cauchy = float(rank1.kl_cauchy(loc, scale, prior_loc, prior_scale))
  assert gauss == pytest.approx(_kl_by_integration(stats.norm(loc, scale),
                                                   stats.norm(prior_loc, prior_scale)),
                                rel=1e-4, abs=1e-6)
  assert cauchy == pytest.approx(_kl_by_integration(stats.cauchy(loc, scale),
                                                    stats.cauchy(prior_loc, prior_scale)),
                                 rel=1e-4, abs=1e-6)


def _factors(rng, sizes):
  return [{'s_loc': rng.normal(1, 0.5, a).astype(np.float32),
           's_rho': rng.normal(-3, 0.5, a).astype(np.float32),
           'r_loc': rng.normal(1, 0.5, b).astype(np.float32),
           'r_rho': rng.normal(-3, 0.5, b).astype(np.float32)} for a, b in sizes]


def _softplus(x):
  return np.log1p(np.exp(x))


def test_the_kl_term_and_its_gradient_are_added_to_the_loss_by_hand():
  rng = np.random.default_rng(0)
  factors = _factors(rng, [(5, 4), (4, 3)])
  params = rank1.Rank1Params(base=[], factors=factors)
  zero = jax.tree.map(np.zeros_like, params)
  results = lambda *args: BatchResult(jnp.float32(2.0), {}, zero, {})
  step, total = 9, 40  # weight min(1, 10 / (0.5 * 40)) = 0.5, over N = 100
  # Jitted, here and below: eagerly, each op compiles a program of its own.
  with_kl = rank1.with_kl(results, OPTIONS, total)
  out = jax.jit(lambda p, k: with_kl(p, {}, {}, 0, k, None))(params, jnp.int32(step))
  weight = 0.5 / 100
  kl, grads = 0.0, []
  for f in factors:
    g = {}
    for side in ('s', 'r'):
      m, rho = f[f'{side}_loc'].astype(np.float64), f[f'{side}_rho'].astype(np.float64)
      s = _softplus(rho)
      kl += np.sum(np.log(0.1 / s) + (s**2 + (m - 1)**2) / (2 * 0.01) - 0.5)
      g[f'{side}_loc'] = weight * (m - 1) / 0.01
      g[f'{side}_rho'] = weight * (s / 0.01 - 1 / s) / (1 + np.exp(-rho))
    grads.append(g)
  assert float(out.loss) == pytest.approx(2.0 + weight * kl, rel=1e-5)
  for got, want in zip(out.grads.factors, grads):
    for key in want:
      np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-7)
  kl_weight = jax.jit(rank1.kl_weight, static_argnums=(1, 2))
  weights = [float(kl_weight(jnp.int32(k), OPTIONS, total)) for k in (0, 9, 19, 30)]
  assert weights == pytest.approx([1 / 20, 10 / 20, 1.0, 1.0])
  full = OPTIONS._replace(kl_annealing=0.0)
  assert float(kl_weight(jnp.int32(0), full, total)) == 1.0


def _relu(x):
  return np.maximum(x, 0)


def _numpy_forward(base, values, x):
  """The factorised MLP: h <- relu(((h o s) W) o r + b), the last layer without relu."""
  h = x.reshape(len(x), -1).astype(np.float64)
  for i, (layer, v) in enumerate(zip(base, values)):
    h = ((h * v['s']) @ layer['w']) * v['r'] + layer['b']
    h = _relu(h) if i < len(base) - 1 else h
  return h


def _log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _draw(f, n):
  return {side: np.clip(f[f'{side}_loc'] + _softplus(f[f'{side}_rho']) * n[side], -10, 10)
          for side in ('s', 'r')}


def test_a_member_predicts_the_factorised_forward_under_its_draws_each_example_its_own():
  # One hidden layer: the numpy forward chains any number of them; each layer's factors are
  # a few random draws of init, which compile (at -O0) to most of this test's time.
  spec = ModelSpec(name='mlp', factory='', kwargs={}, widths=(8,), channels=(),
                   kernel_sizes=(), strides=(), conv_impl='auto', dropout=0.0)
  model = mlp.make_mlp(spec, 4)
  combine = lambda outputs, mask: jax.nn.logsumexp(jax.nn.log_softmax(outputs), 0) - math.log(
      outputs.shape[0])
  wrapped = rank1.wrap(model, OPTIONS, combine)
  x = np.random.default_rng(1).normal(size=(5, 7)).astype(np.float32)
  key = jax.random.key(7)

  def init_and_apply(x):
    """Init, evaluation, training under `key` and the draws training reads from it (one
    program: eagerly each op compiles one; separately jitted, four programs compiled)."""
    params, state = wrapped.init(jax.random.key(3), x)
    noise = rank1._draws(  # pylint: disable=protected-access
        jax.random.fold_in(key, rank1._DRAW_STREAM), params.factors,  # pylint: disable=protected-access
        (len(x) * OPTIONS.train_samples,), 'gaussian')
    return (params, state, wrapped.apply(params, state, x, train=False)[0],
            wrapped.apply(params, state, x, train=True, rng=key)[0], noise)

  init_and_apply = jax.jit(init_and_apply)
  params, state, got, out, noise = jax.tree.map(np.asarray, init_and_apply(x))
  assert [f['s_loc'].shape + f['r_loc'].shape for f in params.factors] == [(7, 8), (8, 4)]
  assert set(np.unique(np.concatenate([f['s_loc'] for f in params.factors]))) == {-1.0, 1.0}
  assert state.noise[0]['s'].shape == (3, 7)  # eval_samples fixed draws per factor
  # Evaluation: the log of the mean softmax over the member's 3 fixed draws.
  probs = [np.exp(_log_softmax(_numpy_forward(
      params.base, [_draw(f, {k: n[k][e] for k in n}) for f, n in zip(params.factors, state.noise)],
      x))) for e in range(3)]
  np.testing.assert_allclose(np.exp(got), np.mean(probs, 0), rtol=1e-4, atol=1e-6)
  # Training: [B, train_samples, C], example b's sample j under its own draws.
  assert out.shape == (5, 2, 4)
  for b in range(5):
    for j in range(2):  # Example b's sample j: row b * 2 + j of the draws.
      values = [_draw(f, {k: n[k][b * 2 + j] for k in n}) for f, n in zip(params.factors, noise)]
      np.testing.assert_allclose(out[b, j], _numpy_forward(params.base, values, x[b:b + 1])[0],
                                 rtol=1e-4, atol=1e-5)
  same = np.repeat(x[:1], 5, 0)  # The same example 5 times: 5 different draws.
  same_params, _, _, outs, _ = init_and_apply(same)  # The same program: same shapes.
  support.assert_trees_equal(same_params, params)  # Init reads x's shape alone.
  outs = np.asarray(outs)[:, 0]
  assert len({row.tobytes() for row in outs}) == 5


def _spec(**fields):
  base = dict(name='mlp', factory='', kwargs={}, widths=(8, 6), channels=(5, 4),
              kernel_sizes=(3, 3), strides=(2, 2), conv_impl='auto', dropout=0.0, depth=8,
              widen_factor=1)
  return ModelSpec(**{**base, **fields})


def _drawn_like_init(model, x, rng):
  """(params, state) of `model` on inputs like `x`, drawn in numpy on the structure of its
  init (traced by jax.eval_shape, not compiled): He-scaled normal kernels (ndim >= 2),
  scales and running variances in [0.8, 1.2], biases and running means N(0, 0.1^2): near
  init's values, none of them init's 1s and 0s."""
  def leaf(path, shape):
    assert shape.dtype == np.float32, (path, shape)
    if len(shape.shape) >= 2:
      drawn = rng.normal(size=shape.shape) * np.sqrt(2 / np.prod(shape.shape[:-1]))
    elif re.search(r'scale|var', jax.tree_util.keystr(path)):
      drawn = rng.uniform(0.8, 1.2, shape.shape)
    else:
      drawn = rng.normal(0, 0.1, shape.shape)
    return drawn.astype(np.float32)
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)
  return jax.tree_util.tree_map_with_path(leaf, shapes)


def _kernel_values(base, rng, rows=None):
  """Per kernel of `base` a draw {'s': [in], 'r': [out]} (rows: [rows, in], [rows, out])."""
  lead = () if rows is None else (rows,)
  return [{'s': rng.normal(1, 0.5, (*lead, k.shape[-2])).astype(np.float32),
           'r': rng.normal(1, 0.5, (*lead, k.shape[-1])).astype(np.float32)}
          for k in jax.tree.leaves(base) if k.ndim >= 2]


@pytest.mark.parametrize('fields, input_shape', [
    ({'name': 'mlp', 'dropout': 0.3}, (7,)),
    ({'name': 'cnn', 'dropout': 0.2, 'conv_impl': 'patches'}, (12, 1)),
    ({'name': 'cnn', 'conv_impl': 'xla'}, (6, 6, 2)),
    ({'name': 'lenet5'}, (12, 12, 1)),
    ({'name': 'resnet', 'dropout': 0.2}, (8, 1)),
    ({'name': 'resnet', 'conv_impl': 'xla'}, (6, 6, 3)),
    ({'name': 'wide_resnet', 'depth': 10, 'dropout': 0.2}, (6, 6, 1)),
])
def test_the_factorised_forward_is_the_models_own_on_the_formed_kernels(fields, input_shape):
  """One draw for every example: the model's own apply on layers.Factored kernels, ((h o s)
  W) o r layer by layer, equals it on the kernels W o (s r^T), in training (dropout, and
  the ResNets' BatchNorm on the batch's statistics, which it returns). On the 1-D ResNet
  and the WRN (dropout 0.2, which evaluation does not apply), different draws per example
  too: _check_each_example_reads_its_own_kernels, on the same parameters and state. Both
  drawn in numpy on the structure of the model's init (_drawn_like_init): what is checked
  holds for any values, and compiling each model's init was a fifth of these cases' time."""
  spec = _spec(**fields)
  model = models.get_model(spec, 4)
  x = np.random.default_rng(2).normal(size=(3, *input_shape)).astype(np.float32)
  base, state = _drawn_like_init(model, x, np.random.default_rng(4))
  values = _kernel_values(base, np.random.default_rng(5))
  key = jax.random.key(9)
  train = lambda p: model.apply(p, state, x, train=True, rng=key)
  rows = [{k: np.repeat(v[k][None], 3, 0) for k in v} for v in values]
  # One program for both applies and the formed kernels (jitted apart: three).
  got, want, formed = jax.jit(lambda base, values, rows: (
      train(rank1.factored(base, rows)), train(rank1.formed(base, values)),
      rank1.formed(base, values)))(base, values, rows)
  np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), got[1],
               want[1])
  # By hand for every kernel: W o (s r^T) is W with row i times s_i, column j times r_j
  # (over a convolution's spatial axes alike); every other leaf is the base's.
  kernels = iter(values)
  for w, got_leaf in zip(jax.tree.leaves(base), jax.tree.leaves(formed)):
    if w.ndim >= 2:
      v = next(kernels)
      np.testing.assert_allclose(got_leaf, w * v['s'][:, None] * v['r'], rtol=1e-6)
    else:
      np.testing.assert_array_equal(got_leaf, w)
  assert next(kernels, None) is None
  if fields['name'] in ('resnet', 'wide_resnet') and 'dropout' in fields:
    _check_each_example_reads_its_own_kernels(model, base, state, input_shape)


def _check_each_example_reads_its_own_kernels(model, base, state, input_shape):
  """Different draws per example (BatchNorm on its running statistics, so examples do not
  mix): row b of the apply on factored kernels is the apply on example b alone with its
  own formed kernels W o (s_b r_b^T)."""
  x = np.random.default_rng(3).normal(size=(4, *input_shape)).astype(np.float32)
  # The drawn running statistics are not (0, 1): evaluation's BatchNorm is not the identity.
  rows = _kernel_values(base, np.random.default_rng(6), rows=4)
  apply = jax.jit(lambda p, x: model.apply(p, state, x, train=False)[0])
  formed_of = jax.jit(rank1.formed)
  got = np.asarray(apply(rank1.factored(base, rows), x))
  for b in range(4):
    formed = formed_of(base, [{k: v[k][b] for k in v} for v in rows])
    np.testing.assert_allclose(got[b], np.asarray(apply(formed, x[b:b + 1]))[0], rtol=2e-5,
                               atol=2e-5)
  assert not np.allclose(got[0], np.asarray(apply(formed_of(
      base, [{k: v[k][1] for k in v} for v in rows]), x[:1]))[0], atol=1e-3)


STEPS = 8


def _config(**fields):
  config = support.config({
      'ensemble.method': 'rank1', 'num_members': 2, 'model.widths': (32, 16),
      'train.steps': STEPS, 'optim.learning_rate': 1e-2, 'mesh.member': 2,
      'train.log_every': 4, 'checkpoint.every': 4, 'ensemble.rank1.data_size': 3500})
  return support.override(config, fields)


def _train(config, workdir, actions=(), dataset=None):
  return dist_ens.train(config, str(workdir), devices=jax.devices()[:2], actions=actions,
                        dataset=dataset)


def _mnist1d_part():
  """MNIST-1D's first 256 training and 64 test examples, as load_dataset gives them: the
  ResNet runs' data (evaluating all 1,000 test examples through ResNet-8 members and their
  draws was most of a run's time)."""
  full = data.load_dataset('mnist1d')
  return data.from_arrays(full.train.x[:256], full.train.y[:256], full.test.x[:64],
                          full.test.y[:64], name='mnist1d', num_classes=10)


def _stored(ens):
  return jax.device_get(ens._stored)  # pylint: disable=protected-access


# The runs' one hidden layer of 16 (not _config's two): one shared W per kernel holds on
# two kernels as on three, and the init and predict programs compile faster.
def _run_config():
  return _config(**{'ensemble.rank1.prior': 'cauchy', 'eval.shift': 'gaussian_noise:1',
                    'model.widths': (16,)})


_LAYERS = ((40, 16), (16, 10))


@pytest.fixture(scope='module')
def straight_run(tmp_path_factory):
  """(workdir, final metrics) of a straight 8-step Cauchy run with shift: the load/predict
  test reads it; the resume test resumes a copy of it killed after its step-4 checkpoint."""
  workdir = tmp_path_factory.mktemp('rank1') / 'a'
  return workdir, _train(_run_config(), workdir)


@pytest.fixture(scope='module')
def trained(straight_run):
  """The straight run loaded on one device, once for both tests that read it."""
  return Ensemble.load(straight_run[0], devices=jax.devices()[:1])


def test_ensemble_load_predicts_the_mixture_of_the_members_fixed_draws_and_exports(
    straight_run, trained, tmp_path):
  result = straight_run[1]
  assert result['shift']['corruptions']['gaussian_noise']['1']['ensemble']['nll'] > 0
  assert result['joint']['ensemble'] > 0
  ens = trained
  # Predict as reported, on one device too, and each member's params file: the matrix's
  # rank1 case (support.check_loaded_run).
  test = data.load_dataset('mnist1d').test
  prediction = ens.predict(test.x, preprocessed=True)
  probs = []
  for m in range(2):
    params, state = ens.member(m), ens.member_state(m)
    for e in range(4):  # eval_samples' default
      values = [_draw(f, {k: n[k][e] for k in n}) for f, n in zip(params.factors, state.noise)]
      probs.append(np.exp(_log_softmax(_numpy_forward(params.base, values, test.x))))
  np.testing.assert_allclose(prediction.probs, np.mean(probs, 0), atol=2e-5)
  paths = ens.export(tmp_path / 'members')
  for m in range(2):  # Each member's draws (its posterior, W, factors and biases: the matrix).
    jax.tree.map(np.testing.assert_array_equal,
                 dist_ens.load_member(paths[m].with_name(f'member_{m}_state.npz')),
                 {'noise': ens.member_state(m).noise})


def test_one_shared_w_per_kernel_factors_per_member_and_resume_is_exact(straight_run, trained,
                                                                        tmp_path, caplog):
  caplog.set_level(logging.INFO, logger='absl')
  # The straight run's config, shift and joint log-loss included: its evaluation program
  # (clean and corrupted splits in one) is then a cache read, where a resume evaluating the
  # clean split alone compiled one of its own, and the shift and joint metrics are compared
  # too.
  resumed = _train(_run_config(), killed_after(straight_run, 4, tmp_path / 'b'))
  # From the step-4 checkpoint, not trained again from the start (which ends alike).
  assert 'resuming from the checkpoint at step 4' in caplog.text
  assert resumed['step'] == STEPS
  for key in ('members', 'ensemble', 'shift', 'joint'):
    assert resumed[key] == straight_run[1][key], key
  support.assert_trees_equal(_stored(trained),
                             _stored(Ensemble.load(tmp_path / 'b', devices=jax.devices()[:1])))
  p = _stored(trained)
  assert len(p.base) == len(p.factors) == len(_LAYERS)
  for layer, (n_in, n_out) in zip(p.base, _LAYERS):
    assert set(layer['w']) == {'shared'} and layer['w']['shared'].shape == (n_in, n_out)
    assert layer['b']['own'].shape == (2, n_out)
  for f, (n_in, n_out) in zip(p.factors, _LAYERS):
    assert f['s_loc']['own'].shape == (2, n_in) and f['r_rho']['own'].shape == (2, n_out)
    assert not np.array_equal(f['s_loc']['own'][0], f['s_loc']['own'][1])


@pytest.mark.slow  # The CNN's factorised forward is checked above without training.
def test_the_cnns_convolutions_and_head_carry_factors(tmp_path):
  config = _config(**{'model.name': 'cnn', 'model.channels': (6, 6), 'model.kernel_sizes': (3, 3),
                      'model.strides': (2, 2), 'train.steps': 2, 'checkpoint.every': 2,
                      'train.log_every': 2})
  result = _train(config, tmp_path)
  assert result['step'] == 2 and math.isfinite(result['ensemble']['nll'])
  p = _stored(Ensemble.load(tmp_path, devices=jax.devices()[:1]))
  assert [c['w']['shared'].shape for c in p.base['convs']] == [(3, 1, 6), (3, 6, 6)]
  assert [f['s_loc']['own'].shape[1:] + f['r_loc']['own'].shape[1:] for f in p.factors] == [
      (1, 6), (6, 6), (p.base['head']['w']['shared'].shape[0], 10)]


RESNET = {'model.name': 'resnet', 'model.depth': 8, 'train.steps': 4, 'train.log_every': 2,
          'checkpoint.every': 2}


@pytest.fixture(scope='module')
def resnet_run(tmp_path_factory):
  """A 2-member rank-1 ResNet-8 on part of MNIST-1D, 4 steps (the slow tier's)."""
  root = tmp_path_factory.mktemp('rank1_resnet')
  return root, _train(_config(**RESNET), root / 'a', dataset=_mnist1d_part())


# Slow (its run compiles for ~25 s at -O0: the fast tier's costliest test); fast covers:
# the Factored forward against the formed kernels on the ResNets, train-mode BatchNorm
# statistics included, and each example's draws against its formed ResNet (above); rank-1's
# load, predict and export on the MLP (test_one_shared_w_per_kernel_...); a ResNet's
# BatchNorm state through a shared-weight method's run and load (test_masksembles' ResNet
# run) and test_combinations' rank1 case.
@pytest.mark.slow
def test_a_rank1_resnet_trains_and_loads_as_its_members_formed_networks(resnet_run):
  """Shared conv and head kernels, BatchNorm per member (its scale, bias and running
  statistics, which training moved), and Ensemble.load predicting the run's evaluation as
  the mean over members and their fixed draws of the ResNet's own eval-mode apply on the
  formed kernels W o (s r^T)."""
  root, result = resnet_run
  assert result['step'] == 4 and math.isfinite(result['ensemble']['nll'])
  ens = Ensemble.load(root / 'a', devices=jax.devices()[:1])
  p = _stored(ens)
  assert set(p.base['stem']) == {'shared'} and p.base['stem']['shared'].shape == (3, 1, 16)
  assert p.base['blocks'][1]['proj']['shared'].shape == (1, 16, 32)
  assert p.base['stem_bn']['scale']['own'].shape == (2, 16)
  assert p.base['head']['w']['shared'].shape == (64, 10)
  assert len(p.factors) == 1 + 3 * 2 + 2 + 1  # stem, 3 blocks' 2 convs, 2 projections, head
  states = [ens.member_state(m).base['stem_bn'] for m in range(2)]
  assert not np.allclose(states[0]['mean'], 0) and not np.allclose(states[0]['mean'],
                                                                    states[1]['mean'])
  test = _mnist1d_part().test
  prediction = ens.predict(test.x, preprocessed=True)
  model = models.get_model(_spec(name='resnet', depth=8), 10)
  apply = jax.jit(lambda p, s: model.apply(p, s, test.x, train=False)[0])
  probs = []
  for m in range(2):
    params, state = ens.member(m), ens.member_state(m)
    for e in range(4):  # eval_samples' default
      values = [_draw(f, {k: n[k][e] for k in n}) for f, n in zip(params.factors, state.noise)]
      probs.append(jax.nn.softmax(apply(jax.jit(rank1.formed)(params.base, values), state.base)))
  np.testing.assert_allclose(prediction.probs, np.mean(probs, 0), atol=2e-5)
  accuracy = float(np.mean(prediction.probs.argmax(-1) == test.y))
  assert accuracy == pytest.approx(result['ensemble']['accuracy'], abs=2e-3)
  nll = -float(np.mean(np.log(prediction.probs[np.arange(len(test.y)), test.y])))
  assert nll == pytest.approx(result['ensemble']['nll'], rel=1e-3)
  paths = ens.export(root / 'members')
  jax.tree.map(np.testing.assert_array_equal,
               dist_ens.load_member(paths[1].with_name('member_1_state.npz')),
               ens.member_state(1)._asdict())


# Resume with model state (BatchNorm's statistics) through rank-1's shared-W update, from
# a copy of the straight run killed after its step-2 checkpoint (one training, not a
# preempted run and its resume: the MLP's resume test above does the same; a preempted run
# saving and resuming is the combination matrix's, rank1 included); the fast tier checks
# resume on the MLP (test_one_shared_w_per_kernel_...: the shared W and each member's
# factors) and a ResNet's BatchNorm statistics resumed bit for bit in test_adapters'
# test_linen_batchnorm_dropout_members_predict_and_resume.
@pytest.mark.slow
def test_a_rank1_resnet_resumes_exactly(resnet_run, tmp_path, caplog):
  caplog.set_level(logging.INFO, logger='absl')
  root, straight = resnet_run
  resumed = _train(_config(**RESNET), killed_after(root / 'a', 2, tmp_path / 'b'),
                   dataset=_mnist1d_part())
  # From the step-2 checkpoint, not trained again from the start (which ends alike).
  assert 'resuming from the checkpoint at step 2' in caplog.text
  assert resumed['step'] == 4 and resumed['ensemble'] == straight['ensemble']
  support.assert_trees_equal(
      _stored(Ensemble.load(root / 'a', devices=jax.devices()[:1])),
      _stored(Ensemble.load(tmp_path / 'b', devices=jax.devices()[:1])))


# A rank-1 run's report, drawn from the ResNet run (slow). The drawing (matplotlib, 2-3 CPU
# s) is the same for every method; what is rank-1's own in it, Ensemble.load and predict of
# the run, is checked in the fast tier by the MLP run's load test above, and the report of a
# method's run with shift metrics (as the MLP run here has) by test_masksembles'
# load/predict/export/report check (support.check_load_predict_export) and test_report.
# The MLP run's own report test went: it trained that run in the slow tier for it alone.
@pytest.mark.slow
def test_the_report_of_a_rank1_resnet_run_names_it(resnet_run):
  root = resnet_run[0] / 'a'
  assert report.make_report(root) == root / 'report'
  assert '2 x resnet on mnist1d' in (root / 'report' / 'report.md').read_text()


@pytest.mark.parametrize('fields, match', [
    ({'ensemble.rank1.prior': 'laplace'}, r"rank1.prior='laplace'; use one of \['gaussian'"),
    ({'ensemble.rank1.data_size': 0}, r"rank1.data_size=0 must be the training set's size"),
    ({'ensemble.rank1.eval_samples': 0}, r'rank1.eval_samples=0 must be an int >= 1'),
    ({'ensemble.rank1.kl_annealing': 1.5}, r'rank1.kl_annealing=1.5 must be a number in \[0, 1\]'),
    ({'ensemble.rank1.prior_scale': 0.0}, r'rank1.prior_scale=0.0 must be a number > 0'),
    ({'reproducible': True}, "reproducible=True with config.ensemble.method='rank1'"),
])
def test_bad_fields_are_refused_naming_the_field(fields, match):
  config = _config(**fields)
  message = support.method_refusal(config)
  assert re.search(match, message), message


def test_other_models_are_refused_before_anything(tmp_path):
  config = _config(**{'model.name': 'vit', 'model.patch_size': 4})
  message = support.refused_before_anything(_train, config, tmp_path / 'r')
  assert "in config.model.name one of ['mlp', 'cnn', 'lenet5', 'resnet'" in message
  assert "not 'vit'" in message
