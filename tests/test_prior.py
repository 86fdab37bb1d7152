"""Randomized prior functions (config.ensemble.method='prior', dist_ens/ensembles/prior.py):
the prior is each member's own, drawn from (seed, member) alone, never trained, kept through
checkpoints, resume, Ensemble.load and export, and added to the trained network's output."""

import json
import logging

import jax
import numpy as np
import pytest

from runs import killed_after
import support

import dist_ens
from dist_ens.config import specs
from dist_ens import data, models
from dist_ens.run import assemble, initial_state
from dist_ens.core import rng
from dist_ens.ensembles import prior as prior_lib
from dist_ens.errors import ConfigError
from dist_ens import load_member
from dist_ens.parallel import mesh as mesh_lib

M, SCALE, WIDTHS, PRIOR_WIDTHS = 8, 2.5, (8,), (4,)


def _toy(n, seed):
  r = np.random.default_rng(seed)
  x = r.normal(size=(n, 8, 1)).astype(np.float32)
  return x, ((x[:, 0, 0] > 0).astype(np.int32) + (x[:, 1, 0] > 0)).astype(np.int32)


DATASET = data.from_arrays(*_toy(128, 0), *_toy(32, 1), name='classes')


def _config(member=8, data_size=1, method='prior', **prior):
  """support.config's run on DATASET with randomized priors (scale SCALE, widths
  PRIOR_WIDTHS unless `prior` says), 4 steps saved every 2 (a preempted run resumes from
  step 2), on a member x data mesh. Kept: M = 8 members of a (8,) MLP (8 x 1 puts one
  member on each device; DATASET's 3 classes make these programs this file's own at any
  size), batch 16 and eval batch 64 (DATASET's 128 and 32 examples), bootstrap member
  orders (each member reads its own batches through resume)."""
  return support.config({
      'num_members': M, 'model.widths': WIDTHS, 'data.batch_size': 16,
      'eval.batch_size': 64, 'data.member_order': 'bootstrap', 'train.steps': 4,
      'train.log_every': 4, 'checkpoint.every': 2, 'eval.joint_tau': 0,
      'mesh.member': member, 'mesh.data': data_size, 'ensemble.method': method,
      'ensemble.prior.scale': prior.get('scale', SCALE),
      'ensemble.prior.widths': prior.get('widths', PRIOR_WIDTHS)})


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """Workdirs and final metrics: 'straight' (mesh 8x1) and 'resumed' (8x1, resumed from
  what a kill after the straight run's step-2 checkpoint leaves: a resume from that
  checkpoint for one run; the matrix's prior case preempts one)."""
  root, out = tmp_path_factory.mktemp('prior'), {}
  out['straight'] = (root / 'straight',
                     dist_ens.train(_config(), str(root / 'straight'), dataset=DATASET))
  resumed = killed_after(root / 'straight', 2, root / 'resumed')
  out['resumed'] = (resumed, dist_ens.train(_config(), str(resumed), dataset=DATASET))
  return out


@pytest.fixture(scope='module')
def loaded(runs):
  return {name: dist_ens.Ensemble.load(str(workdir)) for name, (workdir, _) in runs.items()}


def _stepped(config, steps=3):
  """(initial, final) train state after `steps` compiled steps on a shared toy batch."""
  parts = assemble.build_run(config, shapes=((8, 1), 3)).parts
  step = assemble.build_step(parts, per_member_batches=False, form=('vmap', None))
  sharding = mesh_lib.batch_sharding(parts.mesh)
  x, y = (data.to_global(a[:config.data.batch_size], sharding) for a in DATASET.train[:2])
  initial = jax.tree.map(np.asarray, initial_state.init_sharded(parts))
  state = initial_state.init_sharded(parts)
  for _ in range(steps):
    state, _ = step(state, parts.device_hparams(), x, y)
  return initial, jax.tree.map(np.asarray, state)


def _micro_batched(method):
  """Mesh 2x4, 8 micro-batches: a mean of 8 copies of a float, summed in order, rounds
  for about 4 values in 10 (of 2 or 4 copies, never). Scale 0 (a deep ensemble's
  training); the prior's widths are the file's, so its draw is _config()'s on mesh 8x1
  (scale is no part of the draw)."""
  config = _config(2, 4, method, scale=0.0)
  config.data.batch_size, config.train.micro_batches = 32, 8
  return config


@pytest.fixture(scope='module')
def micro_batched():
  return {method: _stepped(_micro_batched(method)) for method in ('deep', 'prior')}


def _drawn_priors(config):
  """Every member's prior as drawn from (seed, member) alone: one member at a time, by
  the network's own init (jitted once), not the run's sharded init program."""
  widths = tuple(config.ensemble.prior.widths) or tuple(config.model.widths)
  config = _config()
  config.model.widths = widths
  net = models.get_model(specs.model_spec(config), 3)
  sample = np.zeros((1, 8, 1), np.float32)

  @jax.jit  # one compile for the M draws, keys included, not one an operation
  def draw(member):
    key = rng.member_keys(config.seed, member[None])[0]
    return net.init(jax.random.fold_in(key, prior_lib._PRIOR_STREAM), sample)[0]  # pylint: disable=protected-access

  return [draw(np.uint32(m)) for m in range(M)]


def _initial_priors(config):
  """The priors of the run's own initial state (its init program, on its mesh)."""
  state = initial_state.init_sharded(assemble.build_run(config, shapes=((8, 1), 3)).parts)
  return jax.tree.map(np.asarray, state.model_state.prior_params)


@pytest.fixture(scope='module')
def initial():
  """The priors of _config()'s initial state (mesh 8x1), for both tests of them."""
  return _initial_priors(_config())


# The property "drawn per member, never changed on any mesh" is checked by the next two
# tests: the run and its resume (mesh 8x1), then mesh 2x4 (micro-batched). Two
# tests, not one, so each holds one half of the module's fixtures (the runs, then the
# micro-batched steps): one test held both, 15 s of CI's fast tier.
def test_priors_are_drawn_per_member_and_never_change_through_a_run_or_its_resume(
    loaded, initial):
  drawn = _drawn_priors(_config())
  assert not np.allclose(drawn[0][0]['w'], drawn[1][0]['w'])  # each member its own
  for m in range(M):  # The init program's draw is (seed, m)'s (its erf_inv rounds apart).
    for got, want in zip(jax.tree.leaves(initial), jax.tree.leaves(drawn[m])):
      np.testing.assert_allclose(got[m], want, rtol=1e-6, atol=1e-7)
  for name in ('straight', 'resumed'):  # 4 steps on mesh 8x1, bootstrap member orders
    support.assert_trees_equal(loaded[name].model_state.prior_params, initial)


def test_priors_never_change_on_other_meshes_or_through_micro_batches(initial, micro_batched):
  # Mesh 2x4 (members and data split), 8 micro-batches: mesh 8x1's draw bit for bit, and
  # kept through 3 steps, the micro-batches' mean of the model state included, while what
  # trains moved.
  start, end = micro_batched['prior']
  support.assert_trees_equal(start.model_state.prior_params, initial)
  support.assert_trees_equal(end.model_state.prior_params, initial)
  assert not np.allclose(start.params[0]['w'], end.params[0]['w'])  # what trains moved


def test_no_optimizer_state_or_gradient_reaches_the_prior():
  parts = assemble.build_run(_config(), shapes=((8, 1), 3)).parts
  state = parts.abstract_state
  assert isinstance(state.model_state, prior_lib.PriorState)
  prior_shapes = {leaf.shape for leaf in jax.tree.leaves(state.model_state.prior_params)}
  assert prior_shapes == {(M, 8, 4), (M, 4), (M, 4, 3), (M, 3)}
  opt_shapes = {leaf.shape for leaf in jax.tree.leaves(state.opt_state)}
  assert not {(M, 8, 4), (M, 4, 3)} & opt_shapes, opt_shapes  # the kernels: distinct shapes
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      (state.params, state.opt_state))[0]]
  assert not [n for n in names if 'prior' in n], names


def _forward(params, x):
  h = x.reshape(x.shape[0], -1).astype(np.float64)
  for layer in params[:-1]:
    h = np.maximum(h @ layer['w'] + layer['b'], 0)
  return h @ params[-1]['w'] + params[-1]['b']


def test_members_predict_trained_output_plus_scaled_prior_from_exported_files(loaded, tmp_path):
  ens = loaded['straight']
  paths = ens.export(tmp_path / 'members')
  assert json.loads((tmp_path / 'members' / 'ensemble.json').read_text())['model_state_files']
  x = DATASET.test.x[:6]
  probs = ens.predict(x).member_probs
  for m in (0, 5):
    state = load_member(tmp_path / 'members' / f'member_{m}_state.npz')
    logits = (_forward(load_member(paths[m]), x)
              + SCALE * _forward(state['prior_params'], x))
    want = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(probs[m], want / want.sum(-1, keepdims=True), rtol=1e-4,
                               atol=1e-6)
    trained_only = np.exp(_forward(load_member(paths[m]), x))
    assert not np.allclose(probs[m], trained_only / trained_only.sum(-1, keepdims=True),
                           atol=1e-3)


def test_resume_ends_where_an_uninterrupted_run_ends(runs, loaded):
  straight, resumed = runs['straight'][1], runs['resumed'][1]
  strip = lambda d: {k: strip(v) if isinstance(v, dict) else v for k, v in d.items()
                     if not k.endswith('_seconds')}
  assert strip(resumed) == strip(straight)
  support.assert_trees_equal(loaded['straight'].params, loaded['resumed'].params)
  support.assert_trees_equal(loaded['straight'].model_state, loaded['resumed'].model_state)


def test_scale_zero_trains_exactly_as_a_deep_ensemble(micro_batched):
  (deep_start, deep), (prior_start, prior) = micro_batched['deep'], micro_batched['prior']
  # The prior's key is a stream apart.
  support.assert_trees_equal(deep_start.params, prior_start.params)
  support.assert_trees_equal(deep.params, prior.params)
  support.assert_trees_equal(deep.opt_state, prior.opt_state)


@pytest.mark.parametrize('field, value, match', [
    ('ensemble.prior.scale', -1.0, r'config\.ensemble\.prior\.scale=-1\.0'),
    ('ensemble.prior.scale', float('nan'), r'config\.ensemble\.prior\.scale=nan'),
    ('ensemble.prior.widths', ('4',), r"config\.ensemble\.prior\.widths=\('4',\)"),
    ('ensemble.prior.widths', (0,), r'config\.ensemble\.prior\.widths=\(0,\)'),
    ('model.name', 'lenet5', r'config\.ensemble\.prior\.widths=\(4,\).*'
                             r"config\.model\.name='lenet5'"),
])
def test_bad_fields_are_refused_in_one_line_naming_them(field, value, match, tmp_path,
                                                         caplog):
  caplog.set_level(logging.INFO)
  config = _config()
  config.update_from_flattened_dict({field: value})
  with pytest.raises(ConfigError, match=match) as refused:
    dist_ens.train(config, str(tmp_path / 'w'), dataset=DATASET)
  assert '\n' not in str(refused.value)
  assert not (tmp_path / 'w').exists()
