"""Epinets on one frozen base network (config.ensemble.method='epinet' with
ensemble.own='epinet', dist_ens/ensembles/epinet.py): 4 epinets trained on mesh 2x4 over
the base MLP of a deep run's member 1 (config.model.init_from='base#1'). The base is stored
once and is the source's bit for bit after training, with no optimizer state; the members'
epinets differ; Ensemble.load(workdir).predict is the mean softmax over each member's
stored indices, recomputed in numpy; resume is exact; export works (the report: slow); what
cannot work is refused in one line naming both fields."""

import logging

import jax
import numpy as np
import pytest

import dist_ens
import support
from dist_ens import data
from dist_ens.run import assemble, initial_state
from dist_ens.ensembles import own as own_lib
from dist_ens.report import build as report
from dist_ens.io.member_files import load_member
from dist_ens.io.pretrained import load_pretrained, read_orbax
from test_epinet import member_probs

M, SCALE, EVAL_SAMPLES = 4, 1.5, 5


def _config(source, **fields):
  return support.config({
      'ensemble.method': 'epinet', 'ensemble.own': 'epinet', 'model.init_from': source,
      'ensemble.epinet.index_dim': 3, 'ensemble.epinet.widths': (8,),
      'ensemble.epinet.samples': 2, 'ensemble.epinet.eval_samples': EVAL_SAMPLES,
      'ensemble.epinet.prior_scale': SCALE, 'optim.learning_rate': 0.01,
      'mesh.member': 2, 'mesh.data': 4, 'checkpoint.every': 2, 'eval.joint_tau': 0}, **fields)


@pytest.fixture(scope='module')
def runs(tmp_path_factory, tiny_run):
  """{'source': 'base#1', 'base': the source's leaves, 'straight': (workdir, final metrics)}
  of 4 steps over it. The base is member 1 of the session's shared finished run of
  support.config (tests/runs.py), read, not written."""
  root = tmp_path_factory.mktemp('epinet_frozen_base')
  source = f'{tiny_run[0]}#1'
  out = {'source': source, 'base': load_pretrained(source)}
  out['straight'] = (root / 'straight', dist_ens.train(_config(source), str(root / 'straight')))
  return out


@pytest.fixture(scope='module')
def loaded(runs):
  return {'straight': dist_ens.Ensemble.load(str(runs['straight'][0]))}


@pytest.fixture(scope='module')
def resumed(runs):
  """(final metrics, loaded ensemble) of the straight run preempted after step 2 and
  resumed to 4 (only the resume test reads it)."""
  workdir = runs['straight'][0].parent / 'resumed'
  source = runs['source']
  stopped = dist_ens.train(_config(source), str(workdir), actions=[support.PreemptAt(2)])
  assert stopped['preempted'] and stopped['step'] == 2
  return dist_ens.train(_config(source), str(workdir)), dist_ens.Ensemble.load(str(workdir))


def test_the_base_is_the_sources_bit_for_bit_stored_once_without_optimizer_state(runs, loaded):
  workdir, metrics = runs['straight']
  assert metrics['step'] == 4 and metrics['train_step_traces'] == 1
  saved = read_orbax(workdir / 'checkpoints' / '4' / 'model')
  for i, layer in enumerate(saved['params']['base']):
    for name, entry in layer.items():
      assert set(entry) == {'shared'}  # One array, no member axis...
      np.testing.assert_array_equal(entry['shared'], runs['base'][f'params/{i}/{name}'])
  for layer in saved['params']['epinet']:
    assert all(set(entry) == {'own'} and entry['own'].shape[0] == M for entry in layer.values())
  optimizer = read_orbax(workdir / 'checkpoints' / '4' / 'optimizer')
  names = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(optimizer)[0]]
  assert names and not [n for n in names if "'base'" in n]  # ...and no optimizer state.
  ens = loaded['straight']
  for m in range(M):
    for i, layer in enumerate(ens.member(m).base):
      np.testing.assert_array_equal(layer['w'], runs['base'][f'params/{i}/w'])


def test_each_member_trains_its_own_epinet_with_its_own_prior_and_indices(runs, loaded):
  ens, initial = loaded['straight'], _initial(runs)
  kernels = [ens.member(m).epinet[0]['w'] for m in range(M)]
  assert not np.allclose(kernels[0], kernels[1])
  assert not np.allclose(kernels[0], initial.params.epinet[0]['w']['own'][0])  # trained
  states = [ens.member_state(m) for m in range(M)]
  assert not np.allclose(states[0].prior[0]['w'], states[1].prior[0]['w'])
  assert not np.allclose(states[0].indices, states[1].indices)
  assert states[0].indices.shape == (EVAL_SAMPLES, 3)
  support.assert_trees_equal(ens.model_state.prior, initial.model_state.prior)  # frozen


def _initial(runs):
  source = runs['source']
  parts = assemble.build_run(_config(source)).parts
  return jax.tree.map(np.asarray, initial_state.init_sharded(parts))


def test_resume_ends_bit_for_bit_where_an_uninterrupted_run_ends(runs, loaded, resumed):
  strip = lambda d: {k: strip(v) if isinstance(v, dict) else v for k, v in d.items()
                     if not k.endswith('_seconds')}
  metrics, ens = resumed
  assert strip(metrics) == strip(runs['straight'][1])
  for m in range(M):
    support.assert_trees_equal(loaded['straight'].member(m), ens.member(m))
    support.assert_trees_equal(loaded['straight'].member_state(m), ens.member_state(m))


def test_predict_is_the_mean_softmax_over_the_members_indices_on_the_frozen_base(loaded):
  ens = loaded['straight']
  x = np.asarray(data.load_dataset('mnist1d').test.x[:6], np.float64)
  probs = ens.predict(x.astype(np.float32)).member_probs
  as64 = lambda tree: jax.tree.map(lambda a: np.asarray(a, np.float64), tree)
  for m in range(M):
    params, state = as64(ens.member(m)), as64(ens.member_state(m))
    np.testing.assert_allclose(probs[m], member_probs(params, state, x, SCALE)[0], rtol=1e-4,
                               atol=1e-6)


def test_export_copies_the_base_into_every_members_file(runs, loaded, tmp_path):
  paths = loaded['straight'].export(tmp_path / 'members')
  member = load_member(paths[2])  # Plain arrays: the base copied into every member's file.
  np.testing.assert_array_equal(member['base'][0]['w'], runs['base']['params/0/w'])
  np.testing.assert_array_equal(member['epinet'][0]['w'],
                                loaded['straight'].member(2).epinet[0]['w'])


# Slow: the report's drawing (matplotlib) is every method's, and its own part here is
# Ensemble.load and predict of the run. Fast covers: this run's load and predict
# (test_predict_is_the_mean_softmax_over_the_members_indices_on_the_frozen_base, against
# numpy), test_report (every figure drawn), and test_masksembles' report of a method's run.
@pytest.mark.slow
def test_the_report_of_a_frozen_base_run(runs):
  out = report.make_report(runs['straight'][0])
  assert (out / 'report.md').is_file()


def test_own_all_and_head_read_the_base_from_a_deep_run_and_start_the_rest_per_member(runs):
  """own='all' (each member its own base, trained) and 'head' start the base network from
  the deep run's file; the epinets, priors and indices start per member, even from an
  epinet run's file (whose member 0's would make every member alike)."""
  root = runs['straight'][0].parent
  for own, source in (('all', runs['source']), ('head', f'{root / "straight"}#0')):
    parts = assemble.build_run(_config(source, ensemble__own=own)).parts
    state = jax.tree.map(np.asarray, initial_state.init_sharded(parts))
    body = state.params.base[0]['w']
    body = body if own == 'all' else body['shared']
    np.testing.assert_array_equal(body, np.broadcast_to(runs['base']['params/0/w'], body.shape))
    epinet = state.params.epinet[0]['w'] if own == 'all' else state.params.epinet[0]['w']['own']
    assert not np.allclose(epinet[0], epinet[1])
    assert not np.allclose(state.model_state.prior[0]['w'][0], state.model_state.prior[0]['w'][1])
    assert not np.allclose(state.model_state.indices[0], state.model_state.indices[1])


def test_train_shared_trains_the_one_base_by_the_members_summed_gradient(runs, tmp_path):
  source = runs['source']
  config = _config(source, ensemble__train_shared=True, train__steps=2, checkpoint__every=2)
  dist_ens.train(config, str(tmp_path / 'w'))
  saved = read_orbax(tmp_path / 'w' / 'checkpoints' / '2' / 'model')
  kernel = saved['params']['base'][0]['w']['shared']  # Still one array...
  assert kernel.shape == runs['base']['params/0/w'].shape
  assert not np.array_equal(kernel, runs['base']['params/0/w'])  # ...that trained.


def test_a_random_frozen_base_is_said_in_one_warning(tmp_path, caplog):
  """own='epinet' with no model.init_from trains epinets on the seed's random base: legal
  (a random-features baseline), and said, once, at the start (it once went unsaid)."""
  caplog.set_level(logging.WARNING, logger='absl')
  dist_ens.train(_config('', train__steps=2, checkpoint__every=2), str(tmp_path / 'w'))
  said = [r.getMessage() for r in caplog.records if 'random initialisation' in r.getMessage()]
  assert len(said) == 1 and "own='epinet' shares every leaf" in said[0], said
  assert own_lib.random_frozen_base('epinet', 'base#1', False) is None  # a file gives it
  assert own_lib.random_frozen_base('epinet', '', True) is None  # the members train it
  assert own_lib.random_frozen_base('all', '', False) is None  # nothing is shared
  assert "own='head' shares every leaf" in own_lib.random_frozen_base('head', '', False)


@pytest.mark.parametrize('fields, names', [
    ({'ensemble.method': 'deep'}, ('config.ensemble.own', 'ensemble.method')),
    ({'ensemble.method': 'prior'}, ('config.ensemble.own', 'ensemble.method')),
    ({'ensemble.own': 'batchensemble'}, ('config.ensemble.own', 'ensemble.method')),
    ({'pbt.enabled': True, 'data.validation_size': 64}, ('pbt.enabled', 'ensemble.own')),
    ({'ensemble.groups': ({'count': 2}, {'count': 2})}, ('ensemble.groups', 'epinet')),
])
def test_what_cannot_work_is_refused_in_one_line_naming_both_fields(fields, names, tmp_path):
  config = _config('')
  config.update_from_flattened_dict(fields)
  message = support.one_line_refusal(lambda: dist_ens.train(config, str(tmp_path / 'w')))
  assert all(name in message for name in names), message
  assert not (tmp_path / 'w').exists()
