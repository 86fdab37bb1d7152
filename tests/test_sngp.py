"""SNGP (config.ensemble.method='sngp'; ensembles/sngp.py).

The math against independent numpy: the power iteration's sigma and vector against
numpy's SVD; the random features' inner products against the RBF kernel; the precision
accumulated by training applies against the closed form (the Bayesian linear model's
posterior, checked in weight space by numpy's inverse and in function space by the GP's
kernel form); the mean-field adjustment against the probit integral it approximates; the
ridge's gradient. A ResNet member against the plain ResNet's own forward on kernels
normalised in numpy: every convolution normalised, within its bound once the power
iteration has converged, BatchNorm's statistics updated as the plain ResNet's in training
and read at evaluation, the GP on the pooled features' unit vector. Then one 2-member MLP
run: its resume is exact (the state holds every kind of SNGP state: a power-iteration
vector per normalised kernel, the random features, the precision's sums and the steps),
and Ensemble.load predicts what an independent forward of the stored params and state
gives (the adjustment included) and exports the state; a CNN member and one member (the
paper's single model) step without a run; the refusals. What every method's run keeps,
one trace, predict as reported, the same on one device and export per member, is the
combination matrix's (tests/test_combinations.py, its sngp case); the ResNet run is in
the slow tier.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runs import killed_after
import support

import dist_ens
from dist_ens import Ensemble, data
from dist_ens.config import specs
from dist_ens import models
from dist_ens.ensembles import methods, sngp
from dist_ens.errors import ConfigError
from dist_ens.models.mlp import make_mlp
from dist_ens.models.spec import ModelSpec
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.report import build as report
from dist_ens.run import assemble, initial_state, mesh_layout

_SPEC = ModelSpec('mlp', '', {}, (6, 5), (4, 3), (3, 3), (2, 2), 'xla', 0.0)


def _options(**fields):
  return sngp.Options(**{'features': 16, 'norm_bound': 0.95, 'ridge': 1.0,
                         'mean_field_factor': math.pi / 8, 'cov_steps': 3, 'data_size': 12,
                         'length_scale': 1.0, 'unit_input': False, **fields})


def _numpy_power(matrix, u):
  """One power-iteration step in numpy: (sigma, u')."""
  v = matrix @ u
  v /= np.linalg.norm(v)
  u = matrix.T @ v
  u /= np.linalg.norm(u)
  return float(v @ matrix @ u), u


# Dense, dense, 1-D conv, 2-D conv (a ResNet's 3x3; read as [9 * 4, 6]).
@pytest.mark.parametrize('shape', [(20, 30), (30, 7), (3, 4, 6), (3, 3, 4, 6)])
def test_power_iteration_reaches_numpys_largest_singular_value_and_vector(shape):
  rng = np.random.default_rng(0)
  kernel = rng.normal(size=shape).astype(np.float32)
  matrix = kernel.reshape(-1, shape[-1]).astype(np.float64)
  _, singular, vt = np.linalg.svd(matrix)
  u = rng.normal(size=shape[-1])
  u = jnp.asarray(u / np.linalg.norm(u), jnp.float32)  # in numpy: eager ops compile
  # Jitted, here and in the tests below: eagerly, each op compiles a program of its own.
  power_step, normalise = jax.jit(sngp.power_step), jax.jit(sngp.normalised)
  for _ in range(300):
    sigma, u = power_step(jnp.asarray(kernel), u)
  assert float(sigma) == pytest.approx(singular[0], rel=1e-4)
  assert abs(float(np.asarray(u) @ vt[0])) == pytest.approx(1.0, abs=1e-4)
  # The normalised kernel's spectral norm is the bound, where sigma exceeds it.
  for bound in (0.95, 6.0, 100.0):
    normalised, _ = normalise(jnp.asarray(kernel), u, jnp.float32(bound))
    got = np.linalg.svd(np.asarray(normalised, np.float64).reshape(-1, shape[-1]),
                        compute_uv=False)[0]
    assert got == pytest.approx(min(bound, singular[0]), rel=1e-4)


def _drawn_init(model, x, body=None, base=None):
  """(params, state) of model.init (sngp.wrap's), with its draws made here: the structure,
  shapes and dtypes of model.init's (jax.eval_shape: nothing compiled), `body` and `base`
  the plain model's params and state (None: each kernel He-normal and each bias N(0, 0.1^2)
  in numpy, and the plain model's state, if any, zeros), and the SNGP parts drawn in numpy
  as sngp.wrap draws them (unit vectors, W_r ~ N(0, 1), b_r ~ U(0, 2 pi), beta ~ N(0, 1/D),
  no sums, no steps). The wrapped init jitted compiles each of its random draws (a second
  of a test at -O0); the random-features test checks init's own draws."""
  want = jax.eval_shape(model.init, jax.random.key(0), x)
  rng = np.random.default_rng(10)
  draw = lambda size, scale=1.0: (scale * rng.normal(size=size)).astype(np.float32)
  if body is None:
    body = jax.tree.map(lambda a: draw(a.shape, math.sqrt(2 / math.prod(a.shape[:-1]))
                                       if len(a.shape) > 1 else 0.1), want[0].body)
    base = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), want[1].base)
  d = want[1].phase.shape[0]
  params = sngp.SNGPParams(body, draw(want[0].output.shape, 1 / math.sqrt(d)))
  state = sngp.SNGPState(
      base, [(lambda v: v / np.linalg.norm(v))(draw(u.shape)) for u in want[1].vectors],
      draw(want[1].projection.shape), rng.uniform(0, 2 * math.pi, d).astype(np.float32),
      np.zeros(want[1].moment.shape, np.float32), np.zeros((), np.int32))
  assert jax.tree.structure((params, state)) == jax.tree.structure(want)
  assert [(a.shape, a.dtype) for a in jax.tree.leaves((params, state))] == [
      (a.shape, a.dtype) for a in jax.tree.leaves(want)]
  return params, state


def test_each_training_apply_is_one_power_step_on_each_hidden_kernel():
  model = sngp.wrap(make_mlp(_SPEC, 3), 'mlp', _options(), 8)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 7, 1)), jnp.float32)
  params, state = _drawn_init(model, x)
  kernels = [np.asarray(layer['w'], np.float64) for layer in params.body]
  vectors = [np.asarray(u, np.float64) for u in state.vectors]
  train = jax.jit(lambda p, s: model.apply(p, s, x, train=True, rng=jax.random.key(2)))
  for _ in range(3):
    _, state = train(params, state)
    vectors = [_numpy_power(k, u)[1] for k, u in zip(kernels, vectors)]
  for got, want in zip(state.vectors, vectors):
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
  # Evaluation reads the vectors and leaves them.
  _, after = jax.jit(lambda p, s: model.apply(p, s, x, train=False))(params, state)
  support.assert_trees_equal(after.vectors, state.vectors)
  assert int(after.steps) == 3


def test_the_random_features_approximate_the_rbf_kernel():
  # D = 2**13 features of 5-d inputs: the Monte Carlo error of phi.phi' is about
  # 1/sqrt(D) = 0.011 per pair; 4.5 sd is 0.05 (a length scale off by sqrt(2) is off by
  # up to 0.25 here).
  d = 2**13
  model = sngp.wrap(make_mlp(dataclasses.replace(_SPEC, widths=(5,)), 3), 'mlp',
                    _options(features=d), 8)
  _, state = jax.jit(model.init)(jax.random.key(3), jnp.zeros((1, 7, 1)))
  # Init's own draws (the other tests of the math draw them in numpy): no sums, no steps,
  # a unit vector per hidden kernel, and the random features' distributions.
  assert not np.asarray(state.moment).any() and int(state.steps) == 0
  for u in state.vectors:
    assert np.linalg.norm(np.asarray(u, np.float64)) == pytest.approx(1, rel=1e-5)
  projection, phase = np.asarray(state.projection), np.asarray(state.phase)
  assert projection.shape == (5, d)
  assert np.mean(projection) == pytest.approx(0, abs=0.02)
  assert np.std(projection) == pytest.approx(1, abs=0.02)
  assert phase.min() >= 0 and phase.max() <= 2 * math.pi
  assert np.mean(phase) == pytest.approx(math.pi, abs=0.05)
  h = np.random.default_rng(4).normal(size=(12, 5)) * 0.6
  phi = np.asarray(jax.jit(sngp.random_features)(jnp.asarray(h, jnp.float32), state.projection,
                                                  state.phase), np.float64)
  distances = ((h[:, None] - h[None]) ** 2).sum(-1)
  np.testing.assert_allclose(phi @ phi.T, np.exp(-distances / 2), atol=0.05)


def _numpy_features(params, state, x, bound):
  """A member's last hidden features h in numpy: its MLP's relu layers, each kernel divided
  by max(1, sigma / bound) with sigma from one power step of the stored vector."""
  h = np.asarray(x, np.float64).reshape(len(x), -1)
  vectors = []
  for layer, u in zip(params.body, state.vectors):
    kernel = np.asarray(layer['w'], np.float64)
    sigma, u = _numpy_power(kernel, np.asarray(u, np.float64))
    vectors.append(u)
    h = np.maximum(h @ (kernel / max(1.0, sigma / bound)) + np.asarray(layer['b']), 0)
  return h, vectors


def _numpy_phi(state, h, options=None):
  """phi of the features h [B, F]: the paper's sqrt(2/D) cos(h W_r + b_r) (options None or
  not unit_input), or a ResNet's cos(u W_r / l + b_r), u h's centred unit vector."""
  d = state.phase.shape[0]
  h = np.asarray(h, np.float64)
  scale = math.sqrt(2 / d)
  if options is not None and options.unit_input:
    centred = h - h.mean(-1, keepdims=True)
    h = centred / np.linalg.norm(centred, axis=-1, keepdims=True) / options.length_scale
    scale = 1.0
  return scale * np.cos(h @ np.asarray(state.projection, np.float64)
                        + np.asarray(state.phase, np.float64))


def test_the_precision_is_the_bayesian_linear_models_closed_form():
  # 5 training applies, the last cov_steps=3 in the window, 4 examples each: with N = 12
  # (the window's examples) the precision is ridge I + sum over those 12 of phi phi'.
  options = _options(ridge=0.5)
  model = sngp.wrap(make_mlp(_SPEC, 3), 'mlp', options, 5)
  rng = np.random.default_rng(5)
  batches = [rng.normal(size=(4, 7, 1)).astype(np.float32) for _ in range(5)]
  params, state = _drawn_init(model, jnp.asarray(batches[0]))
  train = jax.jit(lambda p, s, x, k: model.apply(p, s, x, train=True, rng=k))
  phis = []
  numpy_state = state
  for i, x in enumerate(batches):
    h, vectors = _numpy_features(params, numpy_state, x, options.norm_bound)
    numpy_state = numpy_state._replace(vectors=vectors)
    if i >= 2:
      phis.append(_numpy_phi(state, h))
    _, state = train(params, state, jnp.asarray(x), jax.random.key(i))
  phi = np.concatenate(phis)  # [12, D]
  want = 0.5 * np.eye(16) + phi.T @ phi
  # Jitted, here and below: eagerly, each op compiles a program of its own.
  got = np.asarray(jax.jit(sngp.precision, static_argnums=(2, 3))(state.moment, state.steps,
                                                                   options, 5))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  # The predictive variance, weight space (numpy's inverse) and function space: the GP of
  # kernel phi.phi' / ridge and unit noise, k** - k*' (K + I)^-1 k*.
  test = rng.normal(size=(6, 7, 1)).astype(np.float32)
  h, _ = _numpy_features(params, state, test, options.norm_bound)
  star = _numpy_phi(state, h)
  weight_space = np.einsum('bd,de,be->b', star, np.linalg.inv(want), star)
  k_star = star @ phi.T / 0.5
  function_space = (np.sum(star * star, -1) / 0.5
                    - np.einsum('bn,nm,bm->b', k_star, np.linalg.inv(phi @ phi.T / 0.5 + np.eye(12)),
                                k_star))
  np.testing.assert_allclose(weight_space, function_space, rtol=1e-6)
  got_var = np.asarray(jax.jit(sngp.variance)(jnp.asarray(star, jnp.float32), jnp.asarray(got)))
  np.testing.assert_allclose(got_var, weight_space, rtol=1e-3)
  # And the member's logits at prediction: phi beta / sqrt(1 + pi/8 var).
  logits, _ = jax.jit(lambda p, s, x: model.apply(p, s, x, train=False))(params, state,
                                                                          jnp.asarray(test))
  want_logits = (star @ np.asarray(params.output, np.float64)
                 / np.sqrt(1 + math.pi / 8 * weight_space)[:, None])
  np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=1e-4, atol=1e-6)


def test_before_the_window_the_precision_is_the_ridge_alone():
  options = _options(ridge=2.0)
  model = sngp.wrap(make_mlp(_SPEC, 3), 'mlp', options, 10)
  x = np.ones((4, 7, 1), np.float32)
  params, state = _drawn_init(model, x)
  train = jax.jit(lambda p, s: model.apply(p, s, x, train=True, rng=jax.random.key(1)))
  for _ in range(7):  # Steps 0..6; the window is 7..9.
    _, state = train(params, state)
  np.testing.assert_array_equal(np.asarray(state.moment), 0)
  precision = jax.jit(sngp.precision, static_argnums=(2, 3))
  np.testing.assert_array_equal(np.asarray(precision(state.moment, state.steps, options, 10)),
                                2.0 * np.eye(16))


def test_vmapped_members_add_their_batchs_mean_outer_product_only_in_their_window():
  rng = np.random.default_rng(8)
  moment = rng.normal(size=(3, 5, 5)).astype(np.float32)
  phi = rng.normal(size=(3, 4, 5)).astype(np.float32)
  vmapped, alone = jax.jit(jax.vmap(sngp.accumulate)), jax.jit(sngp.accumulate)
  for window in ([True, False, True], [False, False, False]):
    got = np.asarray(vmapped(moment, phi, jnp.asarray(window)))
    for m in range(3):
      want = moment[m] + (phi[m].T @ phi[m] / 4 if window[m] else 0)
      np.testing.assert_allclose(got[m], want, rtol=1e-5, atol=1e-6)
      single = alone(moment[m], phi[m], window[m])
      np.testing.assert_allclose(np.asarray(single), want, rtol=1e-5, atol=1e-6)


def test_the_mean_field_adjustment_approximates_the_probit_integral():
  # Two classes with logits (m, 0): softmax is sigmoid(m), and logits / sqrt(1 + pi/8 var)
  # is MacKay's approximation of E[sigmoid(m + sqrt(var) z)], z ~ N(0, 1), within 0.02
  # for these (its known worst error is about 0.02); numpy's Gauss-Hermite gives the integral.
  nodes, weights = np.polynomial.hermite_e.hermegauss(80)
  weights = weights / weights.sum()
  # Jitted: eagerly, each op compiles a program of its own.
  adjusted = jax.jit(lambda logits, var: sngp.adjusted(logits, var, math.pi / 8))
  for m, var in [(0.5, 0.3), (2.0, 1.0), (3.0, 10.0), (-1.5, 4.0), (4.0, 0.0)]:
    logits = np.asarray([[m, 0.0]], np.float32)
    out = np.asarray(adjusted(logits, np.asarray([var], np.float32)))
    np.testing.assert_allclose(out, [[m / math.sqrt(1 + math.pi / 8 * var), 0.0]], rtol=1e-6)
    sigmoid = 1 / (1 + np.exp(-(out[0, 0] - out[0, 1])))
    integral = np.sum(weights / (1 + np.exp(-(m + math.sqrt(var) * nodes))))
    assert sigmoid == pytest.approx(integral, abs=0.02)


def test_the_ridge_adds_ridge_over_n_times_beta_to_betas_gradient():
  x = jnp.asarray(np.random.default_rng(7).normal(size=(4, 7, 1)), jnp.float32)
  y = np.asarray([0, 1, 2, 1])
  # (ridge, N); the last: the ridge's share vanishes, the loss's gradient alone. The
  # options differ only in what the training apply reads (init's params serve all three).
  models_ = [sngp.wrap(make_mlp(_SPEC, 3), 'mlp', _options(ridge=ridge, data_size=n), 8)
             for ridge, n in ((1.0, 10), (3.0, 10), (3.0, 10**9))]
  params, state = _drawn_init(models_[0], x)

  def loss(model, p):
    logits, _ = model.apply(p, state, x, train=True, rng=jax.random.key(1))
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), y])

  # One program for the three gradients: eagerly or one jit each, three compiles.
  grads = jax.jit(lambda p: [jax.grad(lambda q, m=m: loss(m, q))(p).output for m in models_])
  g1, g3, g_big = (np.asarray(g, np.float64) for g in grads(params))
  beta = np.asarray(params.output, np.float64)
  np.testing.assert_allclose(g1 - g_big, beta / 10, atol=1e-6)
  np.testing.assert_allclose(g3 - g_big, 3 * beta / 10, atol=1e-6)


def _resnet(name, classes=3):
  depth = 8 if name == 'resnet' else 10
  return models.get_model(ModelSpec(name, '', {}, (), (), (), (), 'xla', 0.0, depth=depth,
                                    widen_factor=1), classes)


def _conv_paths(body):
  """Every convolution of a ResNet's params: the stem, each block's two, its projection."""
  return [('stem',)] + [('blocks', i, name) for i, block in enumerate(body['blocks'])
                        for name in ('conv1', 'conv2', 'proj') if name in block]


def _numpy_normalised(body, vectors, bound):
  """(body with each conv kernel W / max(1, sigma / bound), the vectors after one numpy
  power step from `vectors`): the kernels a member's forward uses."""
  body = jax.tree.map(np.asarray, body)
  out = []
  for path, u in zip(_conv_paths(body), vectors):
    node = body
    for key in path[:-1]:
      node = node[key]
    kernel = np.asarray(node[path[-1]], np.float64)
    sigma, u = _numpy_power(kernel.reshape(-1, kernel.shape[-1]), np.asarray(u, np.float64))
    node[path[-1]] = (kernel / max(1.0, sigma / bound)).astype(np.float32)
    out.append(u)
  return body, out


def _plain_features(plain, body, base, x, train):
  """The plain ResNet's own (pooled features, BatchNorm state) on `body`'s kernels."""
  width = body['blocks'][-1]['conv2'].shape[-1]
  full = {**body, 'head': {'w': jnp.zeros((width, 1)), 'b': jnp.zeros((1,))}}
  _, h, state = jax.jit(lambda p, s: plain.features(p, s, x, train=train))(full, base)
  return np.asarray(h, np.float64), state


def _member_init(model, plain, x):
  """_drawn_init's (params, state) of model.init, `plain` wrapped by sngp.wrap, its body
  and BatchNorm state the plain model's own init (jitted)."""
  body, base = jax.jit(plain.init)(jax.random.key(0), x)
  return _drawn_init(model, x, {k: v for k, v in body.items() if k != 'head'}, base)


# The pre-activation WRN (its BatchNorms before the convolutions, no stem BatchNorm) in the
# slow tier; the fast tier's [resnet] case checks the same wrap of models/resnet.py.
@pytest.mark.parametrize('name', ['resnet', pytest.param('wide_resnet', marks=pytest.mark.slow)])
def test_a_resnet_member_is_the_plain_resnet_on_normalised_convs_under_a_gp(name):
  # c = 0.5 acts on every He-normal kernel; no adjustment (checked on the MLP above), so
  # the logits are phi beta.
  options = _options(norm_bound=0.5, length_scale=0.5, unit_input=True, mean_field_factor=0.0)
  plain = _resnet(name)
  model = sngp.wrap(plain, name, options, 40)
  x = jnp.asarray(np.random.default_rng(9).normal(size=(6, 8, 8, 2)), jnp.float32)
  params, state = _member_init(model, plain, x)
  # The stem, 3 blocks' 2 convs each, the projections of the 2 blocks that change width.
  assert len(state.vectors) == 9 and 'head' not in params.body
  train = jax.jit(lambda p, s: model.apply(p, s, x, train=True))
  logits, after = train(params, state)
  body, vectors = _numpy_normalised(params.body, state.vectors, 0.5)
  for got, want in zip(after.vectors, vectors):
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
  h, base = _plain_features(plain, body, state.base, x, train=True)
  # Training updates BatchNorm's running statistics as the plain ResNet does.
  support.assert_trees_close(after.base, base, reduction_size=64)
  first_bn = after.base['stem_bn'] if name == 'resnet' else after.base['blocks'][0]['bn1']
  assert not np.allclose(np.asarray(first_bn['mean']), 0)
  want = _numpy_phi(state, h, options) @ np.asarray(params.output, np.float64)
  np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-4)
  # Evaluation reads the running statistics (the plain ResNet's eval on them), which
  # differ from the initial ones in what they give.
  evaluate = jax.jit(lambda p, s: model.apply(p, s, x, train=False)[0])
  body, _ = _numpy_normalised(params.body, after.vectors, 0.5)
  h_eval, _ = _plain_features(plain, body, after.base, x, train=False)
  want = _numpy_phi(state, h_eval, options) @ np.asarray(params.output, np.float64)
  np.testing.assert_allclose(np.asarray(evaluate(params, after)), want, rtol=2e-3, atol=2e-3)
  assert not np.allclose(np.asarray(evaluate(params, after)),
                         np.asarray(evaluate(params, after._replace(base=state.base))),
                         atol=1e-3)
  # Once the power iteration has converged, every kernel's spectral norm is within c: 200
  # more training applies, in one program (a loop of 200 calls was most of this test's
  # time), on one example (the vectors' steps read the kernels alone, not the batch).
  converge = jax.jit(lambda p, s: jax.lax.fori_loop(
      0, 200, lambda _, s: model.apply(p, s, x[:1], train=True)[1], s))
  after = converge(params, after)
  body, _ = _numpy_normalised(params.body, after.vectors, 0.5)
  for path in _conv_paths(body):
    kernel = body
    for key in path:
      kernel = kernel[key]
    norm = np.linalg.svd(np.asarray(kernel, np.float64).reshape(-1, kernel.shape[-1]),
                         compute_uv=False)[0]
    assert norm == pytest.approx(0.5, rel=2e-3), path


STEPS = 8


def _config(**fields):
  config = support.config({
      'ensemble.method': 'sngp', 'ensemble.sngp.features': 64, 'ensemble.sngp.cov_steps': 4,
      'ensemble.sngp.data_size': 4000, 'num_members': 2, 'model.widths': (32, 16),
      'train.steps': STEPS, 'optim.learning_rate': 1e-2, 'mesh.member': 2,
      'train.log_every': 4, 'checkpoint.every': 4})
  return support.override(config, fields)


def _train(config, workdir, actions=(), devices=2):
  return dist_ens.train(config, str(workdir), devices=jax.devices()[:devices], actions=actions)


def _preempted_and_resumed(config, workdir, step, devices=2):
  """The run of `config` in `workdir` preempted after `step` (checked), then resumed to its
  end: the resumed run's final metrics."""
  stopped = _train(config, workdir, actions=[support.PreemptAt(step)], devices=devices)
  assert stopped['preempted'] and stopped['step'] == step
  return _train(config, workdir, devices=devices)


def _named(tree):
  return {jax.tree_util.keystr(path, simple=True, separator='/'): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _member(ens, m):
  return jax.tree.map(lambda a: np.asarray(a)[m], (ens.params, ens.model_state))  # no eager slices


def _numpy_probs(ens, m, x, options):
  """Member m's predictive in numpy from its stored params and model state."""
  params, state = _member(ens, m)
  h, _ = _numpy_features(params, state, x, options.norm_bound)
  return _numpy_gp_probs(params, state, _numpy_phi(state, h), options, STEPS)


def _numpy_gp_probs(params, state, phi, options, steps):
  """The softmax of the adjusted logits phi beta / sqrt(1 + lambda phi' P^-1 phi), P from
  the stored window's sum (numpy's inverse) after `steps` training steps."""
  counted = min(max(int(state.steps) - (steps - options.cov_steps), 0), options.cov_steps)
  p = options.ridge * np.eye(len(phi[0])) + options.data_size * np.asarray(
      state.moment, np.float64) / max(counted, 1)
  var = np.einsum('bd,de,be->b', phi, np.linalg.inv(p), phi)
  logits = phi @ np.asarray(params.output, np.float64) / np.sqrt(
      1 + options.mean_field_factor * var)[:, None]
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _resume_config():
  # Calls of 2 steps, checkpoints after steps 6 and 8: step 6's, inside the precision's
  # window (steps 4-7), is where the resume test starts (no earlier checkpoint: each save
  # costs a tenth of a second and none is read).
  return _config(**{'eval.shift': 'gaussian_noise:1', 'mesh.data': 2,
                    'train.log_every': 2, 'checkpoint.every': 6})


@pytest.fixture(scope='module')
def straight_run(tmp_path_factory):
  """(workdir, final metrics) of _resume_config's run to its end, 2 members x 2 data shards:
  the resume test's reference and the report test's run."""
  workdir = tmp_path_factory.mktemp('sngp') / 'a'
  return workdir, _train(_resume_config(), workdir, devices=4)


@pytest.fixture(scope='module')
def straight_ensemble(straight_run):
  """Ensemble.load of the straight run on one device: loaded once for the load and resume
  tests."""
  return Ensemble.load(straight_run[0], devices=jax.devices()[:1])


# The straight run's checks (a test of their own, so that neither test both trains the
# straight run and resumes it: the first test of the two pays for the module's run).
def test_load_predicts_the_members_adjusted_gps_and_exports_their_state(
    tmp_path, straight_run, straight_ensemble):
  """The loaded state is each member's own; Ensemble.load predicts the mean of the
  members' numpy GPs (random features of the normalised network's features, the
  precision from the stored window, the mean-field adjustment) and exports each member's
  state by name; the run's shift and joint metrics were evaluated."""
  _, straight = straight_run
  ens = straight_ensemble
  assert straight['step'] == STEPS
  assert straight['shift']['corruptions']['gaussian_noise']['1']['ensemble']['nll'] > 0
  assert straight['joint']['ensemble'] > 0
  state = jax.tree.map(np.asarray, ens.model_state)
  assert state.steps.tolist() == [STEPS, STEPS] and state.moment.shape == (2, 64, 64)
  assert not np.array_equal(state.moment[0], state.moment[1])  # Each member its own.
  # Over the window's 4 steps each batch's mean |phi|^2 is about 1 (2/D sum cos^2).
  assert np.trace(state.moment[0]) == pytest.approx(4, rel=0.15)
  # Predict as reported, on one device too, and each member's params file: the matrix's
  # sngp case (support.check_loaded_run).
  test = data.load_dataset('mnist1d').test
  prediction = ens.predict(test.x, preprocessed=True)
  options = sngp.options_from(dict(_resume_config().ensemble.sngp), STEPS, 'mlp')
  want = np.mean([_numpy_probs(ens, m, test.x, options) for m in range(2)], 0)
  np.testing.assert_allclose(prediction.probs, want, atol=1e-5)
  paths = ens.export(tmp_path / 'members')
  for m in range(2):  # The state files hold each leaf under its name ('moment', ...).
    got = _named(dist_ens.load_member(paths[m].with_name(f'member_{m}_state.npz')))
    want = _named(ens.member_state(m))
    assert sorted(got) == sorted(want) and 'moment' in want
    for name, leaf in want.items():
      np.testing.assert_array_equal(got[name], leaf)


def test_resume_is_exact(tmp_path, straight_run, straight_ensemble):
  """Resumed from the step-6 checkpoint (inside the precision's window: its sums cross the
  checkpoint) the run ends as the straight one: its members' and ensemble's test, shift and
  joint metrics equal, its params and model state (every kind of SNGP state) bit for bit."""
  _, straight = straight_run
  # The straight run's config: its evaluation program is a read of the persistent
  # compilation cache, not a compile of its own, and the shift and joint metrics compare too.
  resumed = _train(_resume_config(), killed_after(straight_run, 6, tmp_path / 'b'), devices=4)
  assert resumed['step'] == STEPS
  for part in ('members', 'ensemble', 'shift', 'joint'):
    assert resumed[part] == straight[part], part
  resumed_ens = Ensemble.load(tmp_path / 'b', devices=jax.devices()[:1])
  support.assert_trees_equal((straight_ensemble.params, straight_ensemble.model_state),
                             (resumed_ens.params, resumed_ens.model_state))


# The report's drawing (matplotlib, 2-3 CPU s) is the same for every method; what is
# SNGP's own in it, Ensemble.load and predict of the run, is checked in the fast tier by
# the test above, and the report of a method's run with shift metrics by
# test_masksembles' load/predict/export/report check (support.check_load_predict_export)
# and test_report.
# The ResNet run's report too (resnet_run below).
@pytest.mark.slow
@pytest.mark.parametrize('run, members', [('straight_run', '2 x mlp'),
                                          ('resnet_run', '2 x resnet')])
def test_the_report_of_an_sngp_run_names_it(run, members, request):
  workdir = request.getfixturevalue(run)[0]
  assert report.make_report(workdir) == workdir / 'report'
  assert f'{members} on mnist1d' in (workdir / 'report' / 'report.md').read_text()


RESNET = {'model.name': 'resnet', 'model.depth': 8, 'train.steps': 4, 'train.log_every': 2,
          'checkpoint.every': 2, 'ensemble.sngp.cov_steps': 2}


def test_a_resnets_options_default_to_the_resnet_papers_and_an_mlps_to_the_mlp_papers():
  """sngp.options_from's model-dependent defaults (norm_bound, length_scale, unit_input):
  a ResNet's features go through the GP as a unit vector, an MLP's as they are."""
  fields = dict(_config(**RESNET).ensemble.sngp)
  options = sngp.options_from(fields, 4, 'resnet')
  assert (options.norm_bound, options.length_scale, options.unit_input) == (6.0, 1.0, True)
  options = sngp.options_from(dict(_config().ensemble.sngp), STEPS, 'mlp')
  assert (options.norm_bound, options.unit_input) == (0.95, False)


@pytest.fixture(scope='module')
def resnet_run(tmp_path_factory):
  """(workdir, final metrics) of the slow tier's SNGP ResNet run: 2 ResNet-8 members on
  MNIST-1D, 4 steps."""
  workdir = tmp_path_factory.mktemp('sngp_resnet') / 'a'
  return workdir, _train(_config(**RESNET), workdir)


# Slow; fast covers: the ResNet member's forward, train and eval, BatchNorm statistics
# included, against the plain ResNet on kernels normalised in numpy under the GP
# (test_a_resnet_member_is_the_plain_resnet_on_normalised_convs_under_a_gp[resnet]); a ResNet's
# options (test_a_resnets_options_default_to_...); an SNGP run's Ensemble.load predicting
# its members' numpy GPs from the stored state and exporting it (the MLP's
# test_load_predicts_the_members_adjusted_gps_and_exports_their_state); a method's ResNet
# BatchNorm state through a run, load and predict (test_masksembles'
# test_a_masked_resnet_predicts_its_masked_members_and_exports); predict as reported,
# on one device and export per member (test_combinations' sngp case).
@pytest.mark.slow
def test_a_resnet_run_loads_as_its_plain_resnets_under_gps(tmp_path, resnet_run):
  """Ensemble.load predicts as the plain ResNet's eval forward on the kernels normalised in
  numpy from the stored vectors and BatchNorm statistics, under the numpy GP with its
  adjustment."""
  straight_dir, straight = resnet_run
  ens = Ensemble.load(straight_dir, devices=jax.devices()[:1])
  test = data.load_dataset('mnist1d').test
  prediction = ens.predict(test.x, preprocessed=True)
  accuracy = float(np.mean(prediction.probs.argmax(-1) == test.y))
  assert accuracy == pytest.approx(straight['ensemble']['accuracy'], abs=2e-3)
  options = sngp.options_from(dict(_config(**RESNET).ensemble.sngp), 4, 'resnet')
  plain = models.get_model(ModelSpec('resnet', '', {}, (), (), (), (), 'auto', 0.0, depth=8),
                           10)
  probs = []
  for m in range(2):
    params, state = _member(ens, m)
    assert not np.allclose(state.base['stem_bn']['var'], 1)  # Training moved them.
    body, _ = _numpy_normalised(params.body, state.vectors, options.norm_bound)
    h, _ = _plain_features(plain, body, state.base, test.x, train=False)
    probs.append(_numpy_gp_probs(params, state, _numpy_phi(state, h, options), options, 4))
  np.testing.assert_allclose(prediction.probs, np.mean(probs, 0), atol=1e-5)
  paths = ens.export(tmp_path / 'members')
  got = _named(dist_ens.load_member(paths[1].with_name('member_1_state.npz')))
  want = _named(ens.member_state(1))
  assert sorted(got) == sorted(want) and 'base/stem_bn/mean' in want
  for name, leaf in want.items():
    np.testing.assert_array_equal(got[name], leaf)


# Fast cover: test_resume_is_exact (the MLP's
# state holds every kind of SNGP state this run's does: a power-iteration vector per
# normalised kernel, the random features, the precision's sums stopped inside its window,
# the steps); a ResNet's BatchNorm statistics resume bit for bit in test_adapters'
# test_linen_batchnorm_dropout_members_predict_and_resume.
@pytest.mark.slow
def test_a_resnet_run_resumes_exactly(tmp_path, resnet_run):
  """Stopped at step 2 (inside the precision's window, steps 2-3) and resumed, the run
  ends as the straight one, its params and model state (vectors, sums, BatchNorm
  statistics) bit for bit."""
  straight_dir, straight = resnet_run
  resumed = _preempted_and_resumed(_config(**RESNET), tmp_path / 'b', 2)
  assert resumed['step'] == 4 and resumed['ensemble'] == straight['ensemble']
  ens = Ensemble.load(straight_dir, devices=jax.devices()[:1])
  resumed_ens = Ensemble.load(tmp_path / 'b', devices=jax.devices()[:1])
  support.assert_trees_equal((ens.params, ens.model_state),
                             (resumed_ens.params, resumed_ens.model_state))


def test_a_cnn_member_normalises_its_convolutions_and_one_member_is_the_papers_model():
  """A 1-member SNGP CNN (the paper's single model), as a run builds it (its sharded init
  and train step, without a run): a power-iteration vector per convolution, which its
  training step moves, no head in the body, the GP on the flattened conv features."""
  config = _config(**{'model.name': 'cnn', 'model.channels': (6, 4), 'model.kernel_sizes': (3, 3),
                      'model.strides': (2, 2), 'num_members': 1, 'mesh.member': 1,
                      'train.steps': 2, 'ensemble.sngp.cov_steps': 2})
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:1]),
                               (40, 1), 10)
  state = initial_state.init_sharded(parts)
  params, born = jax.tree.map(np.asarray, (state.params, state.model_state))
  assert [u.shape for u in born.vectors] == [(1, 6), (1, 4)]
  assert 'head' not in params.body and params.output.shape == (1, 64, 10)
  # The features: 40 -> 20 -> 10 positions of 4 channels.
  assert born.projection.shape == (1, 40, 64)
  step = assemble.build_step(parts, per_member_batches=False, form=('vmap', None))
  sharding = mesh_lib.batch_sharding(parts.mesh)
  x, y = next(data.BatchIterator(data.load_dataset('mnist1d').train, 32, seed=0))
  state, metrics = step(state, parts.device_hparams(), data.to_global(x, sharding),
                        data.to_global(y, sharding))
  assert np.isfinite(np.asarray(metrics.loss)).all()
  after = jax.tree.map(np.asarray, state.model_state)
  for u, v in zip(born.vectors, after.vectors):
    assert not np.allclose(u, v)  # One power step of each convolution's vector.
  assert after.steps.tolist() == [1]


@pytest.mark.parametrize('fields, match', [
    ({'ensemble.sngp.data_size': 0}, r"sngp.data_size=0 must be the training set's size"),
    ({'ensemble.sngp.features': 0}, r'sngp.features=0 must be an int >= 1'),
    ({'ensemble.sngp.norm_bound': -1.0}, r'sngp.norm_bound=-1.0 must be a finite number >= 0'),
    ({'ensemble.sngp.ridge': -1.0}, r'sngp.ridge=-1.0 must be a finite number > 0'),
    ({'ensemble.sngp.length_scale': 0.0}, r'sngp.length_scale=0.0 must be a finite number > 0'),
    ({'ensemble.sngp.norm_bound': math.inf}, r"sngp.norm_bound=inf must be a finite number "
                                             r">= 0, e.g. 0.95, or 0 for the network's"),
    ({'ensemble.sngp.mean_field_factor': -0.1}, r'mean_field_factor=-0.1 must be a finite '
                                                r'number >= 0'),
    ({'ensemble.sngp.cov_steps': 9}, r'sngp.cov_steps=9 exceeds train.steps=8'),
])
def test_bad_fields_are_refused_naming_the_field(fields, match):
  config = _config(**fields)
  message = support.method_refusal(config)
  assert re.search(match, message), message


def test_other_models_tasks_and_shared_leaves_are_refused_before_anything(tmp_path):
  config = _config(**{'model.name': 'vit'})
  message = support.refused_before_anything(_train, config, tmp_path / 'r')
  assert "config.model.name in ['mlp', 'cnn', 'resnet', 'resnet18', 'wide_resnet'], not 'vit'" \
      in message, message
  config = _config(**{'task': 'regression'})
  message = support.refused_before_anything(_train, config, tmp_path / 'g')
  assert "not config.task='regression'" in message, message
  with pytest.raises(ConfigError, match="ensemble.own='head'"):
    methods.from_spec(specs.method_spec(_config(**{'ensemble.own': 'head'})))
