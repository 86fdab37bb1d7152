"""Epinets (config.ensemble.method='epinet', dist_ens/ensembles/epinet.py): 4 members, each
its base MLP with an epinet and a frozen prior epinet, trained on mesh 2x4 (members and
data both split); resume is exact, the prior and the evaluation indices never change, and
Ensemble.predict is the mean softmax over the member's indices, recomputed here in numpy."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dist_ens
from runs import killed_after
import support
from dist_ens.config import specs
from dist_ens import data, models
from dist_ens.run import assemble, initial_state
from dist_ens.ensembles import epinet as epinet_lib
from dist_ens.errors import ConfigError

M, SCALE, INDEX_DIM, EVAL_SAMPLES = 4, 1.5, 3, 5


def _config(**fields):
  return support.config({
      'ensemble.method': 'epinet', 'ensemble.epinet.index_dim': INDEX_DIM,
      'ensemble.epinet.widths': (8,), 'ensemble.epinet.samples': 2,
      'ensemble.epinet.eval_samples': EVAL_SAMPLES, 'ensemble.epinet.prior_scale': SCALE,
      'mesh.member': 2, 'mesh.data': 4, 'checkpoint.every': 2, 'eval.joint_tau': 0}, **fields)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """{name: (workdir, final metrics)}: 'straight' (4 steps) and 'resumed' (resumed to 4
  from what a kill after the straight run's step-2 checkpoint leaves: a resume from that
  checkpoint for one run, not a preempted run and its resume; the matrix's slow epinet
  cases preempt one)."""
  root, out = tmp_path_factory.mktemp('epinet'), {}
  out['straight'] = (root / 'straight', dist_ens.train(_config(), str(root / 'straight')))
  resumed = killed_after(root / 'straight', 2, root / 'resumed')
  out['resumed'] = (resumed, dist_ens.train(_config(), str(resumed)))
  return out


@pytest.fixture(scope='module')
def loaded(runs):
  return {name: dist_ens.Ensemble.load(str(workdir)) for name, (workdir, _) in runs.items()}


def test_resume_ends_bit_for_bit_where_an_uninterrupted_run_ends(runs, loaded):
  straight, resumed = runs['straight'][1], runs['resumed'][1]
  strip = lambda d: {k: strip(v) if isinstance(v, dict) else v for k, v in d.items()
                     if not k.endswith('_seconds')}
  assert strip(resumed) == strip(straight)
  support.assert_trees_equal(loaded['straight'].params, loaded['resumed'].params)
  support.assert_trees_equal(loaded['straight'].model_state, loaded['resumed'].model_state)


def test_final_metrics_have_the_usual_sections(runs):
  workdir, returned = runs['straight']
  metrics = json.loads((workdir / 'final_metrics.json').read_text())
  assert metrics['ensemble'] == returned['ensemble']
  assert {'members', 'ensemble', 'frozen_members', 'step', 'selective',
          'train_step_traces'} <= set(metrics)
  assert metrics['train_step_traces'] == 1
  assert metrics['step'] == 4 and metrics['frozen_members'] == []
  assert len(metrics['members']['nll']) == M
  assert np.isfinite(metrics['ensemble']['nll']) and 0 <= metrics['ensemble']['accuracy'] <= 1


def test_the_prior_epinet_and_the_indices_never_change_and_get_no_optimizer_state(loaded):
  parts = assemble.build_run(_config()).parts
  initial = jax.tree.map(np.asarray, initial_state.init_sharded(parts))
  assert isinstance(initial.model_state, epinet_lib.EpinetState)
  end = loaded['straight']
  support.assert_trees_equal(end.model_state.prior, initial.model_state.prior)
  support.assert_trees_equal(end.model_state.indices, initial.model_state.indices)
  assert end.model_state.indices.shape == (M, EVAL_SAMPLES, INDEX_DIM)
  assert not np.allclose(end.params.epinet[0]['w'], initial.params.epinet[0]['w'])  # trains
  assert not np.allclose(end.params.base[0]['w'], initial.params.base[0]['w'])
  prior_kernel = initial.model_state.prior[0]['w']
  assert not np.allclose(prior_kernel[0], prior_kernel[1])  # each member its own prior
  assert not np.allclose(initial.model_state.indices[0], initial.model_state.indices[1])
  opt_shapes = {leaf.shape for leaf in jax.tree.leaves(initial.opt_state)}
  params_shapes = {leaf.shape for leaf in jax.tree.leaves(initial.params)}
  prior_shapes = {leaf.shape for leaf in jax.tree.leaves(initial.model_state.prior)}
  assert prior_shapes <= params_shapes  # the prior has the trained epinet's shapes...
  assert params_shapes <= opt_shapes  # ...which Adam keeps moments of, by params' paths
  names = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(initial.opt_state)[0]]
  assert not [n for n in names if 'prior' in n or 'indices' in n], names


def _mlp(layers, h):
  for layer in layers[:-1]:
    h = np.maximum(h @ layer['w'] + layer['b'], 0)
  return h, h @ layers[-1]['w'] + layers[-1]['b']


def _epinet(layers, inputs, z):
  """mlp([inputs, z]) as [C, k], times z: [B, C] (float64)."""
  _, out = _mlp(layers, np.concatenate([inputs, np.broadcast_to(z, (len(inputs), len(z)))], 1))
  return out.reshape(len(inputs), -1, len(z)) @ z


def _softmax(logits):
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def member_probs(params, state, x, scale=SCALE):
  """One member's predictive recomputed in float64 numpy from its stored params and
  state: the mean softmax over its stored indices, and its base network's alone."""
  features, logits = _mlp(params.base, x.reshape(len(x), -1))
  inputs = np.concatenate([features, x.reshape(len(x), -1)], 1)
  want = np.mean([_softmax(logits + _epinet(params.epinet, inputs, z)
                           + scale * _epinet(state.prior, inputs, z))
                  for z in state.indices], axis=0)
  return want, _softmax(logits)


def test_predict_is_the_mean_softmax_over_the_members_indices(loaded):
  ens = loaded['straight']
  x = np.asarray(data.load_dataset('mnist1d').test.x[:6], np.float64)
  probs = ens.predict(x.astype(np.float32)).member_probs
  member = lambda tree, m: jax.tree.map(lambda a: np.asarray(a, np.float64)[m], tree)
  for m in range(M):
    params, state = member(ens.params, m), member(ens.model_state, m)
    want, base_alone = member_probs(params, state, x)
    np.testing.assert_allclose(probs[m], want, rtol=1e-4, atol=1e-6)
    assert not np.allclose(probs[m], base_alone, atol=1e-3)  # not the base alone


def test_the_base_network_learns_from_its_logits_only_and_the_loss_averages_the_indices():
  spec = specs.model_spec(support.config(model__widths=(4,)))
  options = epinet_lib.Options(index_dim=2, widths=(3,), samples=4, eval_samples=2,
                               prior_scale=2.0)
  base = models.get_model(spec, 3)
  model = epinet_lib.wrap(base, options, lambda o, mask: o.mean(0))
  x = np.random.default_rng(1).normal(size=(5, 6)).astype(np.float32)
  squared = lambda o, y, hp: jnp.mean((o - y[:, None]) ** 2)

  @jax.jit  # One program: eagerly, each operation (and the loss's) compiled one of its own.
  def run(init_key, key):
    params, state = model.init(init_key, x)
    apply = lambda p: model.apply(p, state, x, train=True, rng=key)[0]
    outputs = apply(params)
    grad = jax.grad(lambda p: apply(p).sum())(params)
    want = jax.grad(lambda b: 4 * base.apply(b, {}, x)[0].sum())(params.base)
    return outputs, grad, want, epinet_lib.index_mean_loss(squared)(
        outputs, jnp.arange(5.0), {})

  outputs, grad, want, loss = run(jax.random.key(0), jax.random.key(2))
  assert outputs.shape == (5, 4, 3)
  # d/d(base) of the sum over the 4 samples = 4 x that of the base logits: no gradient
  # reaches the base network through the features the epinet reads.
  for g, w in zip(jax.tree.leaves(grad.base), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(loss, np.mean((np.asarray(outputs) - np.arange(5.0)[:, None, None])
                                           ** 2), rtol=1e-6)


@pytest.mark.parametrize('field, value, match', [
    ('ensemble.epinet.index_dim', 0, r'config\.ensemble\.epinet\.index_dim=0'),
    ('ensemble.epinet.samples', 0, r'config\.ensemble\.epinet\.samples=0'),
    ('ensemble.epinet.eval_samples', -1, r'config\.ensemble\.epinet\.eval_samples=-1'),
    ('ensemble.epinet.widths', ('4',), r"config\.ensemble\.epinet\.widths=\('4',\)"),
    ('ensemble.epinet.prior_scale', -1.0, r'config\.ensemble\.epinet\.prior_scale=-1\.0'),
    ('model.name', 'lenet5', r"config\.ensemble\.method='epinet'.*config\.model.*'mlp'"),
])
def test_bad_fields_are_refused_in_one_line_naming_them(field, value, match, tmp_path):
  config = _config()
  config.update_from_flattened_dict({field: value})
  with pytest.raises(ConfigError, match=match) as refused:
    dist_ens.train(config, str(tmp_path / 'w'))
  assert '\n' not in str(refused.value)
  assert not (tmp_path / 'w').exists()


@pytest.mark.parametrize('fields, x_shape', [
    ({'model.name': 'mlp', 'model.widths': (6,)}, (3, 8, 1)),
    ({'model.name': 'cnn', 'model.channels': (2,), 'model.kernel_sizes': (3,),
      'model.strides': (2,)}, (3, 8, 1)),
    ({'model.name': 'resnet', 'model.depth': 8}, (2, 8, 1)),
    ({'model.name': 'wide_resnet', 'model.depth': 10, 'model.widen_factor': 1}, (2, 8, 1)),
    ({'model.name': 'vit', 'model.patch_size': 4, 'model.hidden': 8, 'model.depth': 1,
      'model.heads': 2, 'model.mlp_dim': 16}, (2, 8, 1)),
])
def test_built_in_models_expose_the_features_their_logits_are_linear_in(fields, x_shape):
  model = models.get_model(specs.model_spec(support.config(fields)), 4)
  x = np.random.default_rng(1).normal(size=x_shape).astype(np.float32)

  # init, features and apply in one program (eagerly each op compiled one of its own: a
  # ResNet's forward was 8 s of compiles; init and the forward apart, two programs each);
  # apply's logits bit for bit.
  @jax.jit
  def run(key):
    params, state = model.init(key, x)
    logits, features, _ = model.features(params, state, x, train=False)
    return params, logits, features, model.apply(params, state, x, train=False)[0]

  params, logits, features, applied = run(jax.random.key(0))
  head = params[-1] if isinstance(params, list) else params['head']
  assert features.shape == (x_shape[0], head['w'].shape[0])
  # The head in float64 numpy (eager jax: one matmul and add program per model).
  linear = (np.asarray(features, np.float64) @ np.asarray(head['w'], np.float64)
            + np.asarray(head['b'], np.float64))
  np.testing.assert_allclose(logits, linear, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(logits, applied)
