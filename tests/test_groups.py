"""Member groups (config.ensemble.groups): members of different architectures trained as
one program. The key property: a group's members are the same members, bit for bit in
reproducible mode, as the members of the same ids in a run without groups whose model
and optimizer are the group's."""

import json
import logging
import shutil

import jax
import numpy as np
import pytest

import runs
import support

import dist_ens
from dist_ens import data, models
from dist_ens.config import groups as member_groups
from dist_ens.config import specs
from dist_ens.core import hparams as hparams_lib
from dist_ens.data import load_dataset
from dist_ens.ensembles import pbt as pbt_lib, stored as stored_lib
from dist_ens import load_member

# Two groups of two members: ids 0-1 an MLP of one hidden layer, ids 2-3 one of two with
# its own learning rate. A tiny run (support.config: 4 steps, batch 32).
GROUPS = ({'count': 2, 'model': {'widths': (16,)}},
          {'count': 2, 'model': {'widths': (8, 8)}, 'optim': {'learning_rate': 3e-3},
           'name': 'deep'})


# The shared run's members train with dropout, are also scored with 2 MC dropout samples
# each (eval.mc_samples) and fit a last-layer Laplace with 3 weight draws each
# (eval.laplace: each group's head has its own width, so its own fit), every draw keyed
# by the member's id.
POSTHOC = {'model__dropout': 0.1, 'eval__mc_samples': 2, 'eval__laplace': 'last_layer_kron',
           'eval__laplace_samples': 3}

# The shared grouped run also distils every group's members into the user's own student
# after its last step (test_the_grouped_run_distils_all_groups_into_the_users_own_student):
# in the run itself, not in a rerun of its finished copy, which would build and evaluate
# the whole run again (MC dropout, Laplace) for one property. A rerun that distils a
# finished run is tests/test_distill.py's (the same for every method and for groups).
DISTILL = {'distill__student': 'support:linear_student', 'distill__steps': 20}


def _config(groups=GROUPS, **fields):
  config = support.config(**{'reproducible': True, **fields})
  config.ensemble.groups = groups
  return config


def _single(group, **fields):
  """The run without groups whose model and optimizer are `group`'s: its members of the
  group's ids are the group's members. Its num_members (support.config's 4 unless `fields`
  set it) need only reach the group's last id: the first group's members (ids 0-1) are
  those of a 2-member run too, which runs on the grouped run's member axis (2) and reads
  most of its programs from the persistent cache where the grouped run compiled them (half
  the time of a 4-member run, bit for bit the same members)."""
  config = support.config(**{'reproducible': True, **fields})
  for key in ('model', 'optim'):
    for field, value in group.get(key, {}).items():
      config[key][field] = value
  return config


def _stored(workdir_or_ensemble):
  """The stored params (on the host) of a workdir's run, or of a loaded Ensemble."""
  ensemble = workdir_or_ensemble
  if not isinstance(ensemble, dist_ens.Ensemble):
    ensemble = dist_ens.Ensemble.load(workdir_or_ensemble)
  return jax.device_get(ensemble._stored)  # pylint: disable=protected-access


@pytest.fixture(scope='module')
def preempted(tmp_path_factory):
  """The shared grouped run (_config(**POSTHOC, **DISTILL)) preempted after step 2:
  (workdir, the session's results). `grouped` resumes it."""
  workdir = tmp_path_factory.mktemp('grouped')
  return workdir, dist_ens.train(_config(**POSTHOC, **DISTILL), str(workdir),
                                 actions=[support.PreemptAt(2)])


@pytest.fixture(scope='module')
def grouped(preempted):
  """The shared grouped run, `preempted` resumed to the end: (workdir, the resumed
  session's results). test_a_groups_members_equal_... compares it bit for bit with runs
  without groups that were never interrupted (`singles`), so it proves too that an
  interrupted grouped run resumes to the uninterrupted state."""
  workdir, _ = preempted
  return workdir, dist_ens.train(_config(**POSTHOC, **DISTILL), str(workdir))


@pytest.fixture(scope='module')
def grouped_loaded(grouped):
  """The shared grouped run loaded once (Ensemble.load) for the tests that read the loaded
  run without changing it (six in the fast tier): a restore compiles and costs about as
  much as a short evaluation, and the Ensemble keeps its compiled forwards for the next."""
  return dist_ens.Ensemble.load(grouped[0])


@pytest.fixture(scope='module')
def plain_grouped(tmp_path_factory):
  """The shared run's training alone: _config with POSTHOC's dropout, uninterrupted, with
  no post-hoc step (its members are `grouped`'s, whose resume test_a_groups_members_equal_...
  proves to equal runs never interrupted). The slow tier's readers of a finished grouped
  run (the FSDP layout's reference, the rendered report) read it: `grouped` (a preempted
  session, its resume, MC dropout, Laplace and distillation) would be built in that tier
  for them alone. (workdir, results)."""
  workdir = tmp_path_factory.mktemp('plain_grouped')
  return workdir, dist_ens.train(_config(model__dropout=POSTHOC['model__dropout']),
                                 str(workdir))


# The first test to read `preempted` (it trains the preempted session); the next, the first
# to read `grouped`, pays for the resume.
def test_a_preempted_grouped_run_stops_at_its_step_before_any_post_hoc_step(preempted):
  _, stopped = preempted
  assert stopped['preempted'] and stopped['step'] == 2 and 'distill' not in stopped


@pytest.fixture(scope='module')
def singles(tmp_path_factory):
  """For each of GROUPS, the shared run's config without groups whose model and optimizer
  are the group's (_single): singles(g) is group g's (workdir, results), trained the first
  time a test asks for it, so that each case of test_a_groups_members_equal_... pays for
  its own group's run. Also the pretrained sources of
  test_each_group_adapts_its_own_pretrained_backbone (a (16,) and an (8, 8) run)."""
  built = {}

  def single(g):
    if g not in built:
      workdir = tmp_path_factory.mktemp(f'single{g}')
      # Members 0 to the group's last: 2 members for the first group, 4 for the second.
      last = sum(group['count'] for group in GROUPS[:g + 1])
      built[g] = workdir, dist_ens.train(_single(GROUPS[g], num_members=last, **POSTHOC),
                                         str(workdir))
    return built[g]

  return single


@pytest.fixture(scope='module')
def loaded_singles(singles):
  """loaded_singles(g): singles(g)'s run loaded once (Ensemble.load), for the tests that
  read it (the comparison with group g and, for g=1, the pretrained source's member)."""
  built = {}

  def loaded(g):
    if g not in built:
      built[g] = dist_ens.Ensemble.load(singles(g)[0])
    return built[g]

  return loaded


# The first test to read `grouped` (it resumes the preempted run): before the comparison
# with `singles`, whose cases train a run each.
def test_results_hold_every_member_the_ensemble_and_each_groups_ensemble(grouped):
  workdir, results = grouped
  assert results['num_members'] == 4 and len(results['members']['nll']) == 4
  assert results['train_step_traces'] == 1
  assert list(results['groups']) == ['group0', 'deep']
  assert results['groups']['deep']['members'] == [2, 3]
  assert results['groups']['deep']['model'] == {'widths': (8, 8)}
  # The second group's learning rate, per member, beside the first group's default.
  assert results['hyperparameters']['optim.learning_rate'] == [1e-3, 1e-3, 3e-3, 3e-3]
  nll = [results['groups'][g]['ensemble']['nll'] for g in ('group0', 'deep')]
  assert results['ensemble']['nll'] not in nll and all(np.isfinite(nll))
  saved = json.loads((workdir / 'final_metrics.json').read_text())
  assert saved['groups']['deep']['ensemble'] == pytest.approx(
      results['groups']['deep']['ensemble'])


@pytest.mark.parametrize('g', range(len(GROUPS)), ids=['group0', 'deep'])
def test_a_groups_members_equal_the_same_members_without_groups(grouped, grouped_loaded,
                                                               singles, loaded_singles, g):
  """Group g's members are those of the same ids in `singles`(g), a run without groups of
  the group's model and optimizer that was never interrupted: on the grouped run's member
  axis (group0's 2 members) and on another (deep's: 4 members on 4 member devices)."""
  _, results = grouped
  stored = _stored(grouped_loaded)
  assert isinstance(stored, tuple) and len(stored) == 2
  first = sum(group['count'] for group in GROUPS[:g])
  ids = slice(first, first + GROUPS[g]['count'])
  _, single = singles(g)
  # Bit for bit: parameters, and the test metrics computed from them.
  support.assert_trees_equal(stored[g], jax.tree.map(lambda a: a[ids],
                                                     _stored(loaded_singles(g))))
  for metric in ('nll', 'accuracy'):
    assert results['members'][metric][ids] == single['members'][metric][ids]
    # MC dropout: each group's model samples its members' dropout, keyed by their ids.
    assert (results['mc_dropout']['members'][metric][ids]
            == single['mc_dropout']['members'][metric][ids])
    assert results['mc_dropout']['members'][metric][ids] != results['members'][metric][ids]
    # Laplace: each group's fit is that of the same members without groups.
    assert (results['laplace']['members'][metric][ids]
            == single['laplace']['members'][metric][ids])
  assert (results['laplace']['prior_precision'][ids]
          == single['laplace']['prior_precision'][ids])


def test_load_and_predict_combine_every_group(grouped, grouped_loaded):
  workdir, _ = grouped
  ensemble = grouped_loaded
  test = load_dataset('mnist1d').test
  out = ensemble.predict(test.x[:50])
  assert out.probs.shape == (50, 10) and out.member_probs.shape == (4, 50, 10)
  # On the host: an op on a device array compiles a program of its own.
  probs, member_probs = np.asarray(out.probs), np.asarray(out.member_probs)
  np.testing.assert_allclose(probs, member_probs.mean(0), rtol=1e-5, atol=1e-6)
  accuracy = (member_probs.argmax(-1) == test.y[:50]).mean(-1)
  assert accuracy.shape == (4,)
  # Each member on its own: its group's row, exported with its architecture, and that
  # architecture applied to its files gives predict's member probabilities.
  stored = _stored(ensemble)
  paths = ensemble.export(workdir / 'members')
  meta = json.loads((workdir / 'members' / 'ensemble.json').read_text())
  assert [g['members'] for g in meta['groups']] == [[0, 1], [2, 3]]
  assert [list(g['model']['widths']) for g in meta['groups']] == [[16], [8, 8]]
  x = ensemble.preprocess(test.x[:50])
  member_probs_of = {}  # per group: its architecture's probabilities, one program each
  for i, (g, row) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
    params = load_member(paths[i])
    support.assert_trees_equal(params, jax.tree.map(lambda a, r=row: a[r], stored[g]))
    support.assert_trees_equal(params, ensemble.member(i))
    if g not in member_probs_of:
      model = models.get_model(specs.model_spec(ensemble.member_config(i)), 10)
      member_probs_of[g] = jax.jit(
          lambda p, s, x, m=model: jax.nn.softmax(m.apply(p, s, x, train=False)[0]))
    np.testing.assert_allclose(member_probs_of[g](params, ensemble.member_state(i), x),
                               member_probs[i], rtol=1e-5, atol=1e-6)
  # Loaded onto one device it predicts the same: the matrix's groups cases
  # (support.check_loaded_run, tests/test_combinations.py) check that.
  # PEFT adapters are one architecture's: a grouped run's are refused in one line.
  message = support.one_line_refusal(lambda: ensemble.export_adapters(workdir / 'peft'))
  assert 'export_adapters' in message and 'member groups' in message, message
  assert not (workdir / 'peft').exists()


def test_laplace_fits_each_group_and_a_loaded_run_predicts_what_it_reported(grouped,
                                                                            grouped_loaded):
  """eval.laplace with groups: one fit per group in laplace.npz (its head's own feature
  width), each group's Laplace ensemble reported, and Ensemble.load(...).predict(x,
  laplace=True) reproducing the reported members' NLL from the file."""
  workdir, results = grouped
  with np.load(workdir / 'laplace.npz') as saved:
    assert int(saved['groups']) == 2
    # K-FAC's input factor: the features + 1 of each group's head, per member.
    assert saved['group0/q_a'].shape == (2, 17, 17) and saved['group1/q_a'].shape == (2, 9, 9)
    assert int(saved['group1/first_member']) == 2
  laplace = results['laplace']
  assert laplace['groups']['deep']['members'] == [2, 3]
  plain = results['groups']['deep']['ensemble']['nll']
  assert np.isfinite(plain) and laplace['groups']['deep']['ensemble']['nll'] != plain
  ensemble = grouped_loaded
  test = load_dataset(ensemble.config.data.name, specs.data_spec(ensemble.config)).test
  probs = np.asarray(ensemble.predict(test.x, preprocessed=True, laplace=True).member_probs)
  nll = -np.log(probs.astype(np.float64)[:, np.arange(len(test.y)), test.y]).mean(1)
  np.testing.assert_allclose(nll, laplace['members']['nll'], rtol=1e-5)
  draws = np.asarray(ensemble.laplace_samples(test.x[:16], preprocessed=True))
  assert draws.shape == (4, 3, 16, 10)
  np.testing.assert_allclose(draws.mean(1), probs[:, :16], rtol=1e-5, atol=1e-7)


def test_selection_and_post_hoc_steps_range_over_every_groups_members(vit_run):
  """Top-k selection chooses among all members (across architectures: the
  neural-ensemble-search baseline), temperature scaling fits a temperature per member of
  every group, and shift evaluation scores the combined ensemble (the MLP and ViT groups'
  run, `vit_run`; greedy selection: the next test)."""
  _, final, _ = vit_run
  val_nll = np.array(final['validation']['members']['nll'])
  assert len(val_nll) == 4
  assert final['selected']['members'] == sorted(np.argsort(val_nll)[:2].tolist())
  assert len(final['temperature_scaling']['member_temperatures']) == 4
  assert final['temperature_scaling']['after']['ensemble']['nll'] <= (
      final['temperature_scaling']['before']['ensemble']['nll'] + 1e-6)
  shifted = final['shift']['corruptions']['gaussian_noise']['1']
  assert final['shift']['pairs'] == 1 and len(shifted['members']['nll']) == 4
  assert np.isfinite(shifted['ensemble']['nll'])


def test_greedy_selection_picks_among_every_groups_members(pbt_run):
  """Greedy selection chooses among all members (the grouped PBT run's, `pbt_run`:
  selection ranks the members a run ends with). Its own test, not the one above's: each
  of the two pays for its own module run."""
  _, final, _ = pbt_run
  [member] = final['greedy']['picks']
  # One pick from either group: the greedy ensemble is that member.
  assert final['greedy']['ensemble']['nll'] == pytest.approx(final['members']['nll'][member],
                                                             rel=1e-4)
  assert member == int(np.argmin(final['validation']['members']['nll']))


def _pbt_config():
  """A grouped PBT run of 6 steps, rounds at 2 and 4, ending in a greedy selection of one
  member (test_greedy_selection_picks_among_every_groups_members reads it). Its
  three checkpoints are kept: the resume test starts from a copy holding step 2's."""
  return _config(pbt__enabled=True, pbt__interval=2, pbt__resample_probability=0.0,
                 data__validation_size=200, train__steps=6, checkpoint__every=2,
                 checkpoint__keep=3,
                 optim__learning_rate='loguniform(1e-4,3e-2)', select__method='greedy',
                 select__greedy_size=1)


@pytest.fixture(scope='module')
def pbt_run(tmp_path_factory):
  """The straight run of _pbt_config(): (workdir, results, (state, hyperparameters, pbt
  results) right after step 2's round)."""
  from test_pbt import _Capture  # pylint: disable=g-import-not-at-top
  workdir, capture = tmp_path_factory.mktemp('pbt'), _Capture(2)
  results = dist_ens.train(_pbt_config(), str(workdir), actions=[capture])
  return workdir, results, capture.seen


def test_pbt_copies_within_each_group_bit_for_bit_and_resumes_exactly(pbt_run, tmp_path):
  """Each group is its own population: a round's decisions are pbt.decide's on the group's
  logged validation values (drawn by member id), a copy takes a member of its own group
  bit for bit, and a run killed between rounds resumes to the same rounds and members.
  (The kill is runs.killed_after's copy of the straight run after step 2's checkpoint: one
  training, not a faulted run and its resume. It checks too that the step-2 checkpoint's
  meta holds PBT's rounds as they were at step 2, not step 4's round added after it, which
  a resume would list twice: Checkpointer.save copies its meta.)"""
  workdir, straight, (state, _, _) = pbt_run
  spec = specs.pbt_spec(_pbt_config())
  hp = hparams_lib.resolve(specs.hparams_spec(_pbt_config()))
  hp['optim.learning_rate'][2:] = 3e-3  # the second group's own value
  events = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text()
            .splitlines()]
  rounds = [e['pbt'] for e in events if e['split'] == 'pbt']
  assert len(rounds) == 2  # steps 2 and 4, not the last
  for logged in rounds:
    values = np.array([np.nan if v is None else v for v in logged['values']])
    for g, first in enumerate((0, 2)):
      ids = slice(first, first + 2)
      one = pbt_lib.decide(spec, logged['round'], list(values[ids]),
                           {f: v[ids] for f, v in hp.items()}, first_member=first)
      assert logged['sources'][ids] == (one.sources + first).tolist()
      assert sum(s != i for i, s in enumerate(one.sources)) == 1  # one copy per group
    hp = {f: np.float32(v) for f, v in logged['hparams'].items()}
  for dst, src in enumerate(rounds[0]['sources']):  # Copied at step 2, bit for bit.
    g, first = (0, 0) if dst < 2 else (1, 2)
    for leaf in jax.tree.leaves((state.params[g], state.opt_state[g], state.model_state[g])):
      np.testing.assert_array_equal(np.asarray(leaf)[dst - first], np.asarray(leaf)[src - first])
  killed = runs.killed_after(pbt_run, 2, tmp_path / 'killed')  # Between the two rounds.
  resumed = dist_ens.train(_pbt_config(), str(killed))
  assert resumed['pbt'] == straight['pbt'] and resumed['members'] == straight['members']
  support.assert_trees_equal(_stored(killed), _stored(workdir))


# data.member_split with groups, on a regression curve (per-split target statistics):
# kfold:4 over 96 examples, batch 16.
MEMBER_SPLIT = {'task': 'regression', 'data__member_split': 'kfold:4', 'data__batch_size': 16,
                'eval__joint_tau': 0}  # No joint log-loss: nothing here reads it.


@pytest.fixture(scope='module')
def member_split_run(tmp_path_factory):
  """The grouped run of MEMBER_SPLIT: (workdir, results, its dataset, the inputs x, the run
  loaded)."""
  rng = np.random.default_rng(0)
  x = rng.uniform(-1, 1, (96, 1)).astype(np.float32)
  y = (3 * np.sin(3 * x[:, 0]) + 5 + 0.3 * rng.standard_normal(96)).astype(np.float32)
  dataset = data.from_arrays(x, y, x[:8], y[:8], name='curve')
  workdir = tmp_path_factory.mktemp('member_split')
  results = dist_ens.train(_config(**MEMBER_SPLIT), str(workdir), dataset=dataset)
  return workdir, results, dataset, x, dist_ens.Ensemble.load(workdir)


def test_a_grouped_member_split_run_predicts_each_member_in_its_splits_units(
    member_split_run):
  """data.member_split with groups: one member per split, and predictions in target units,
  each member converted back with its own split's statistics. (The first test to read
  `member_split_run`, which trains it; the next compares it with a run without groups.)"""
  _, results, _, x, ensemble = member_split_run
  assert results['member_split']['members_per_split'] == 1
  assert len(ensemble.split_scales) == 4
  out = ensemble.predict(x[:8])
  assert np.all(np.isfinite(out.member_mean)) and abs(float(np.mean(out.mean)) - 5) < 3


def test_member_splits_cross_groups_and_each_member_keeps_its_splits_statistics(
    member_split_run, tmp_path):
  """data.member_split with groups: member i trains on split i // per_split whatever its
  group (here each group spans two of four splits), standardised with that split's own
  statistics (regression), and is the member of the same id in a run without groups, bit
  for bit, its held-out metrics too (to evaluation's rounding)."""
  _, grouped, dataset, _, loaded = member_split_run
  # The second group (ids 2-3, splits 2-3): a group whose first member is not member 0,
  # where a split keyed by the index within the group would go wrong. (The first group's
  # ids start at 0 as without groups; test_a_groups_members_equal_... checks that case.)
  group, ids = GROUPS[1], slice(2, 4)
  single = dist_ens.train(_single(group, **MEMBER_SPLIT), str(tmp_path / 'single'),
                          dataset=dataset)
  support.assert_trees_equal(_stored(loaded)[1], jax.tree.map(
      lambda a: a[ids], _stored(tmp_path / 'single')))
  # The held-out metrics of the same parameters: evaluation runs on this run's mesh
  # (member=2 for the groups' counts, 4 without), where rounding may differ by ~1e-7
  # (reproducible mode covers training; README, Limitations).
  for metric in ('rmse', 'nll'):
    np.testing.assert_allclose(grouped['member_split']['members'][metric][ids],
                               single['member_split']['members'][metric][ids], rtol=1e-6)


# Group-level methods: a group sharing its hidden layer (own='head'; the shared leaves are
# the group's first member's init, so member 0's here as without groups) and a group of
# members with a frozen randomized prior network each, in reproducible mode.
METHOD_GROUPS = ({'count': 2, 'model': {'widths': (16,)}, 'ensemble': {'own': 'head'},
                  'name': 'shared'},
                 {'count': 2, 'model': {'widths': (8, 8)},
                  'ensemble': {'method': 'prior', 'prior': {'scale': 2.0}}})


def _rows(tree, ids):
  """Members `ids` of stored params: the rows of stacked leaves, shared leaves whole."""
  return jax.tree.map(lambda a, axis: a if axis is None else a[ids], tree,
                      stored_lib.stored_axes(tree))


def _test_inputs():
  """20 MNIST-1D test inputs."""
  return load_dataset('mnist1d').test.x[:20]


@pytest.fixture(scope='module')
def method_run(tmp_path_factory):
  """The grouped run of METHOD_GROUPS: (workdir, results, the loaded run, its member
  probabilities on 20 test inputs). Each case of the next test reads it beside its own
  group's run without groups."""
  workdir = tmp_path_factory.mktemp('method_groups')
  results = dist_ens.train(_config(METHOD_GROUPS), str(workdir))
  grouped = dist_ens.Ensemble.load(workdir)
  return workdir, results, grouped, grouped.predict(_test_inputs()).member_probs


@pytest.mark.parametrize('g', range(len(METHOD_GROUPS)), ids=['own=head', 'prior'])
def test_a_group_with_its_own_method_equals_that_method_without_groups(method_run, g,
                                                                       tmp_path):
  """Each group's members (params, the prior's frozen network, test metrics, loaded
  predictions, member(i) with shared leaves formed) equal the members of the same ids in
  a run without groups whose model and method are the group's (members 0 to the group's
  last: 2 for the first group, 4 for the second)."""
  _, results, grouped, member_probs = method_run
  group = METHOD_GROUPS[g]
  first = sum(other['count'] for other in METHOD_GROUPS[:g])
  ids = slice(first, first + group['count'])
  summary = results['groups'][group.get('name', f'group{g}')]
  single_config = _single(group, num_members=ids.stop)
  for field, value in group['ensemble'].items():
    if isinstance(value, dict):
      single_config.ensemble[field].update(value)
    else:  # own='head' of the first group, method='prior' of the second
      assert summary[field] == value
      single_config.ensemble[field] = value
  single = dist_ens.train(single_config, str(tmp_path / 'single'))
  loaded = dist_ens.Ensemble.load(tmp_path / 'single')
  # pylint: disable=protected-access
  support.assert_trees_equal(jax.device_get(grouped._stored[g]),
                             _rows(jax.device_get(loaded._stored), ids))
  support.assert_trees_equal(jax.device_get(grouped.model_state[g]),
                             jax.tree.map(lambda a: a[ids], jax.device_get(loaded.model_state)))
  assert results['members']['nll'][ids] == single['members']['nll'][ids]
  np.testing.assert_allclose(np.asarray(member_probs)[ids],
                             np.asarray(loaded.predict(_test_inputs()).member_probs)[ids],
                             rtol=1e-6, atol=1e-7)
  for i in range(ids.start, ids.stop):
    support.assert_trees_equal(grouped.member(i), loaded.member(i))
  assert len(grouped.export(tmp_path / 'members')) == 4


@pytest.mark.parametrize('field, value', [
    ('ensemble.method', 'epinet'),
    ('task', 'regression_homoscedastic'),
])
def test_what_groups_do_not_support_yet_is_refused_in_one_line(field, value, tmp_path):
  config = _config(**{field.replace('.', '__'): value})
  message = support.one_line_refusal(lambda: dist_ens.train(config, str(tmp_path)))
  assert 'config.ensemble.groups' in message and field in message, message
  assert not any(tmp_path.iterdir())  # refused before anything is written


def _adapting_groups(singles):
  """model.init_from per group: group 0 LoRA factors over member 0 of a (16,) run, group 1
  its own heads over member 1 of an (8, 8) run (the finished runs without groups of
  `singles`)."""
  (a, _), (b, _) = singles(0), singles(1)
  lora = {'count': 2, 'model': {'widths': (16,), 'init_from': f'{a}#0'},
          'ensemble': {'own': 'lora', 'lora_rank': 2}}
  heads = {'count': 2, 'model': {'widths': (8, 8), 'init_from': f'{b}#1'},
           'ensemble': {'own': 'head'}}
  return lora, heads


@pytest.fixture(scope='module')
def adapted(singles, tmp_path_factory):
  """The grouped run of _adapting_groups, loaded (Ensemble.load). Its first reader trains
  it, the next test its LoRA group's run without groups."""
  workdir = tmp_path_factory.mktemp('adapted')
  dist_ens.train(_config(_adapting_groups(singles)), str(workdir))
  return dist_ens.Ensemble.load(workdir)


def test_each_group_adapts_its_own_pretrained_backbone(adapted, loaded_singles):
  """model.init_from per group (_adapting_groups): group 1's backbone is its source's bit
  for bit after training, its heads its own (and group 0's members are the same LoRA run's
  without groups: the next test)."""
  grouped = adapted
  base = jax.tree.leaves(loaded_singles(1).member(1))
  for i in (2, 3):  # own='head': every leaf but the head's (b, w) is the source's
    leaves = jax.tree.leaves(grouped.member(i))
    for mine, theirs in zip(leaves[:-2], base[:-2]):
      np.testing.assert_array_equal(mine, theirs)
    assert not np.array_equal(leaves[-1], base[-1])  # its own head, trained


def test_a_lora_group_over_a_pretrained_backbone_equals_that_lora_run_without_groups(
    adapted, singles, tmp_path):
  """Group 0 of _adapting_groups (LoRA factors over member 0 of a (16,) run): members 0-1
  of the same LoRA run without groups, and their predictions, bit for bit (reproducible
  mode)."""
  lora, _ = _adapting_groups(singles)
  single = _single(lora, num_members=2, ensemble__own='lora', ensemble__lora_rank=2)
  dist_ens.train(single, str(tmp_path / 'single'))
  grouped, alone = adapted, dist_ens.Ensemble.load(tmp_path / 'single')
  for i in (0, 1):
    support.assert_trees_equal(grouped.member(i), alone.member(i))
  x = _test_inputs()
  np.testing.assert_array_equal(np.asarray(grouped.predict(x).member_probs)[:2],
                                alone.predict(x).member_probs)


@pytest.mark.parametrize('layout, parts, whole', [
    ({'mesh__model': 2}, 2, 'grouped'),
    # FSDP over the data axis, a second layout of this property: the slow tier, against
    # `plain_grouped` (the shared run's members, without the post-hoc steps that tier would
    # build `grouped` for). The fast tier checks groups' kernels split and their members
    # kept on a model axis (the case above) and FSDP over data without groups
    # (test_model_axis.py::test_fsdp_over_data_splits_leaves_over_data_too_and_trains_the_same).
    pytest.param({'mesh__fsdp_over_data': True, 'reproducible': False}, 4,  # member 2 x data 4
                 'plain_grouped', marks=pytest.mark.slow),
])
def test_groups_split_members_over_a_model_axis_or_the_data_axis(layout, parts, whole,
                                                                   request, tmp_path):
  """mesh.model=2, or FSDP over the data axis: every group's kernels are split over that
  axis, in training and when loaded; the members are the shared run's (whole members,
  `whole`: the module run read) to float rounding (reproducible mode is bit-exact per
  layout), so are loaded predictions. The split run trains as the shared run (its dropout)
  but skips its MC dropout and Laplace evaluations, which nothing here reads: the fast tier
  runs them with groups on the shared run and on a model axis in the matrix's fast case of
  MC dropout, model=2 and a last-layer Laplace (tests/test_combinations.py)."""
  workdir, reference = request.getfixturevalue(whole)
  reference_loaded = (request.getfixturevalue('grouped_loaded') if whole == 'grouped'
                      else dist_ens.Ensemble.load(workdir))
  split = _config(model__dropout=POSTHOC['model__dropout'], **layout, mesh__fsdp_min_size=16)
  results = dist_ens.train(split, str(tmp_path))
  np.testing.assert_allclose(results['members']['nll'], reference['members']['nll'],
                             rtol=1e-5)
  ensemble = dist_ens.Ensemble.load(tmp_path)
  kernel = ensemble._stored[1][0]['w']  # pylint: disable=protected-access
  assert kernel.shape == (2, 40, 8)
  assert kernel.sharding.shard_shape(kernel.shape)[1] == 40 // parts
  x = load_dataset('mnist1d').test.x[:50]
  np.testing.assert_allclose(ensemble.predict(x).member_probs,
                             reference_loaded.predict(x).member_probs,
                             rtol=1e-5, atol=1e-6)


# A third group-level method beside test_a_group_with_its_own_method_equals_that_method_
# without_groups's own='head' (a group's shared leaves trained by its own members alone)
# and 'prior', which cover the property in the fast tier: the slow tier.
@pytest.mark.slow
def test_a_batchensemble_group_predicts_as_without_groups(tmp_path):
  """A BatchEnsemble group (ids 0-1) beside a deep one: its shared weights are trained by
  its own members alone, so it is the BatchEnsemble run of those two members without
  groups (on the same 2 x 4 mesh): loaded predictions and member(i) (the shared weight
  times each member's rank-1 factors) equal to float rounding (reproducible mode refuses
  BatchEnsemble)."""
  group = {**GROUPS[1], 'ensemble': {'method': 'batchensemble'}}
  dist_ens.train(_config((group, GROUPS[0]), reproducible=False), str(tmp_path / 'grouped'))
  single = _single(group, reproducible=False, num_members=2, ensemble__method='batchensemble')
  dist_ens.train(single, str(tmp_path / 'single'))
  x = load_dataset('mnist1d').test.x[:20]
  grouped, alone = (dist_ens.Ensemble.load(tmp_path / name) for name in ('grouped', 'single'))
  np.testing.assert_allclose(grouped.predict(x).member_probs[:2], alone.predict(x).member_probs,
                             rtol=1e-5, atol=1e-7)
  for i in (0, 1):
    mine, theirs = grouped.member(i), alone.member(i)
    assert jax.tree.structure(mine) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('own_method, fields, words', [
    ({'method': 'mimo'}, {}, ('ensemble.method',)),
    ({'own': 'head'}, {'pbt__enabled': True, 'pbt__interval': 1, 'data__validation_size': 32,
                       'optim__learning_rate': 'loguniform(1e-4,1e-2)'},
     ('pbt.enabled', "ensemble.own='all'")),
    ({'method': 'batchensemble'}, {'eval__laplace': 'last_layer_kron', 'reproducible': False},
     ('eval.laplace', "'batchensemble'")),
])
def test_a_groups_own_method_refuses_what_it_refuses_without_groups(own_method, fields, words,
                                                                   tmp_path):
  groups = (GROUPS[0], {**GROUPS[1], 'ensemble': own_method})
  message = support.one_line_refusal(lambda: dist_ens.train(_config(groups, **fields),
                                                            str(tmp_path)))
  assert all(word in message for word in words), message
  assert not any(tmp_path.iterdir())


@pytest.mark.parametrize('groups, num_members, words', [
    (GROUPS, 6, ('num_members=6', 'counts 4', 'num_members=4')),
    (({'count': 4, 'model': {'width': (8,)}},), 4, ('model.width', 'widths')),
    (({'count': 4, 'layers': 2},), 4, ("['layers']", 'count')),
    (({'count': 0},), 4, ('count=0', '>= 1')),
    (({'count': 4, 'optim': {'learning_rate': [1e-3, 2e-3, 3e-3, 4e-3]}},), 4,
     ('optim.learning_rate', 'per-member lists')),
    ('[{"count": 4}]', 4, ('string', 'config file')),
    # A group's own field names the group: the run's config may hold another value.
    (({'count': 2}, {'count': 2, 'model': {'name': 'mlpp'}}), 4,
     ("group 'group1' (members 2-3)", "model.name='mlpp'", "'mlp'")),
])
def test_bad_groups_are_refused_naming_the_field(groups, num_members, words, tmp_path):
  config = _config(groups, num_members=num_members)
  message = support.one_line_refusal(lambda: dist_ens.train(config, str(tmp_path)))
  assert 'config.ensemble.groups' in message
  for word in words:
    assert word in message, message


def test_a_count_the_member_devices_do_not_divide_is_refused(tmp_path):
  config = _config(mesh__member=4, mesh__data=2, reproducible=False)
  message = support.one_line_refusal(lambda: dist_ens.train(config, str(tmp_path)))
  assert "group 'group0' has count=2" in message and 'mesh.member' in message, message


def test_plan_prices_each_group_and_measures_the_joint_step():
  from dist_ens import plan  # pylint: disable=g-import-not-at-top
  result = plan.make_plan(_config(), memory_bytes=1e9)
  assert [(g.name, g.first_member, g.count) for g in result.stacks] == [('group0', 0, 2),
                                                                       ('deep', 2, 2)]
  # MNIST-1D: 40 inputs, 10 classes; (16,) and (8, 8) hidden layers.
  assert result.stacks[0].params_per_member == 40 * 16 + 16 + 16 * 10 + 10
  assert result.stacks[1].params_per_member == 40 * 8 + 8 + 8 * 8 + 8 + 8 * 10 + 10
  for group in result.stacks:  # Parameters and Adam's two moments, float32, and more.
    assert group.state_bytes_per_member >= 3 * 4 * group.params_per_member
    assert group.flops_per_example > 6 * group.params_per_member * 0.5
  # Every group's state once, their shared step counter (4 bytes) once.
  assert result.state_bytes_per_device == sum(g.state_bytes_per_device
                                              for g in result.stacks) - 4
  # The joint step holds every group's state (donated) at once.
  assert result.step.alias >= result.state_bytes_per_device and result.fits
  text = plan.format_plan(result, _config())
  assert '4 members in 2 stacks' in text and "widths=(8, 8)" in text
  assert 'fits 1.00 GB per device' in text


def test_the_grouped_run_distils_all_groups_into_the_users_own_student(grouped,
                                                                       grouped_loaded):
  """distill.student as an import path (DISTILL, in the shared run): the teacher is every
  group's members, the cost counts each group at its architecture's parameters, and the
  saved student loads and predicts the reported NLL."""
  _, results = grouped
  out = results['distill']
  assert out['members_distilled'] == 4 and out['loss_last'] < out['loss_first']
  # MNIST-1D: 40 inputs, 10 classes. Widths (16,): 40*16+16 + 16*10+10; (8, 8): 40*8+8 +
  # 8*8+8 + 8*10+10; two members each. The student: 40*10+10.
  assert out['cost']['ensemble_params'] == 2 * 826 + 2 * 490
  assert out['cost']['student_params'] == 410
  ensemble = grouped_loaded
  test = load_dataset(ensemble.config.data.name, specs.data_spec(ensemble.config)).test
  probs = np.asarray(ensemble.student().predict(test.x, preprocessed=True).probs, np.float64)
  nll = -np.mean(np.log(probs[np.arange(len(test.y)), test.y]))
  assert nll == pytest.approx(out['nll'], abs=1e-5)
  # distill.student='same' with groups is refused in one line naming both fields: the
  # matrix's refused pair groups+distill (tests/test_combinations.py).


# Rendered (the slow tier) or drawn without rendering (the fast tier): matplotlib's savefig
# took 8 of this test's 11 s, and rendering a figure is the same for any run
# (tests/test_report.py renders every figure of its runs); what groups change is the
# report's content, which the fast case reads from the figures themselves. The rendered
# case reads `plain_grouped` (the shared run without its post-hoc steps), as the slow
# tier's other reader of a finished grouped run does, so that tier builds no `grouped`.
@pytest.mark.parametrize('rendered, run', [
    (False, 'grouped'), pytest.param(True, 'plain_grouped', marks=pytest.mark.slow)])
def test_the_report_shows_every_groups_ensemble_beside_the_whole(rendered, run, request,
                                                                 monkeypatch):
  """make_report on a grouped run (`run`): its summary names every group's architecture,
  and the methods table and figure show each group's ensemble beside the whole one's."""
  pytest.importorskip('matplotlib')
  # pylint: disable=g-import-not-at-top
  from dist_ens.report import build as report, plots, scatter
  from dist_ens.report.data import method_rows
  workdir, results = request.getfixturevalue(run)
  drawn = {}
  if not rendered:  # Each figure kept as drawn; its files are placeholders.
    def keep(fig, out, name):
      drawn[name] = fig
      for suffix in ('.png', '.svg'):
        (out / name).with_suffix(suffix).write_bytes(b'<svg/>')
    monkeypatch.setattr(plots, '_save', keep)
    monkeypatch.setattr(scatter, '_save', keep)
  out = report.make_report(workdir)
  text = (out / 'report.md').read_text()
  assert '4 members in 2 groups (2 x group0: mlp' in text and '2 x deep: mlp' in text
  # The methods figure and table: each group's ensemble beside the whole one's.
  assert (out / 'methods.png').exists()
  for name, group in results['groups'].items():
    row = next(line for line in text.splitlines() if line.startswith(f'| group {name} (2'))
    assert f"{group['ensemble']['nll']:.4f}" in row, row
  assert (out / 'reliability.png').exists() and (out / 'ensemble_size.png').exists()
  if not rendered:  # The methods figure's bars, labelled: the whole ensemble, then each group's.
    labels = [t.get_text() for t in drawn['methods'].axes[0].get_yticklabels()]
    assert labels == list(method_rows(results))
    assert {'group group0 (2 members)', 'group deep (2 members)'} <= set(labels[1:]), labels
    nll = [float(t.get_text()) for t in drawn['methods'].axes[1].texts]
    for name, group in results['groups'].items():
      i = labels.index(f'group {name} (2 members)')
      assert nll[i] == pytest.approx(group['ensemble']['nll'], abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('fields', [
    {'data__member_order': 'shuffled'},
    {'data__member_order': 'bootstrap', 'train__steps_per_call': 2},
    # The grouped and the single run build their augmentation differently: XLA may vectorise
    # their sums differently (1 ulp in 5 of 32 elements at -O0; 17 of 640 elements 3e-8
    # apart at its default level on an AVX-512 EPYC), so this case compares within
    # support.float_tolerance instead of bit for bit; at the tests' own level, as no bit
    # that only XLA's default level keeps is compared (the xla_default marker's child
    # process, compiling three runs at that level, took 34-41 CPU s; in process, 15).
    {'mesh__member': 2, 'mesh__data': 4, 'train__micro_batches': 4,
     'data__augment': 'crop_flip'},
], ids=['shuffled', 'bootstrap-2-per-call', 'data-axis-augment'])
def test_groups_equal_single_runs_with_per_member_data_and_other_meshes(fields, tmp_path):
  """Per-member data orders (each group takes its ids' batches), K steps per call and a
  data axis: still the same members as without groups, bit for bit (with augmentation, to
  float rounding: the comment above). Each group's run
  without groups holds members 0 to the group's last (2 for the first group, as the
  fast tier's `singles`; 4 for the second), on the same mesh."""
  grouped = dist_ens.train(_config(**fields), str(tmp_path / 'grouped'))
  stored, first = _stored(tmp_path / 'grouped'), 0
  for g, group in enumerate(GROUPS):
    ids = slice(first, first + group['count'])
    dist_ens.train(_single(group, num_members=ids.stop, **fields), str(tmp_path / f'single{g}'))
    single = jax.tree.map(lambda a, i=ids: a[i], _stored(tmp_path / f'single{g}'))
    if fields.get('data__augment'):
      # The gradient's largest sum: over the global batch's examples.
      support.assert_trees_close(stored[g], single, _config(**fields).data.batch_size)
    else:
      support.assert_trees_equal(stored[g], single)
    first += group['count']
  assert grouped['train_step_traces'] == 1


@pytest.mark.slow
def test_a_cnn_group_beside_an_mlp_group(tmp_path):
  """Different model families (not only widths) in one run, default (fast) mode."""
  groups = ({'count': 2, 'model': {'widths': (16,)}},
            {'count': 2, 'model': {'name': 'cnn', 'channels': (4, 4, 4)}})
  config = _config(groups, reproducible=False)
  results = dist_ens.train(config, str(tmp_path))
  assert set(results['groups']) == {'group0', 'group1'}
  assert np.isfinite(results['ensemble']['nll'])
  shutil.rmtree(tmp_path / 'checkpoints')


# A one-block ViT of width 8 beside a (16,) MLP group, for 2 steps; a validation split,
# top-k selection, temperature scaling and shift evaluation for
# test_selection_and_post_hoc_steps_range_over_every_groups_members.
VIT = {'name': 'vit', 'patch_size': 8, 'hidden': 8, 'depth': 1, 'heads': 2, 'mlp_dim': 8}


def _vit_config():
  groups = ({'count': 2, 'model': {'widths': (16,)}},
            {'count': 2, 'model': VIT, 'name': 'vit'})
  return _config(groups, reproducible=False, train__steps=2, train__log_every=2,
                 checkpoint__every=2, data__validation_size=200, select__top_k=2,
                 eval__temperature_scaling=True, eval__shift='gaussian_noise:1')


class _Lines(logging.Handler):
  """The log records' messages, kept."""

  def __init__(self):
    super().__init__(logging.INFO)
    self.lines = []

  def emit(self, record):
    self.lines.append(record.getMessage())


@pytest.fixture(scope='module')
def vit_run(tmp_path_factory):
  """The run of _vit_config(): (workdir, results, its log's lines)."""
  workdir, lines, root = tmp_path_factory.mktemp('vit'), _Lines(), logging.getLogger()
  level = root.level
  root.setLevel(logging.INFO)
  root.addHandler(lines)
  try:
    results = dist_ens.train(_vit_config(), str(workdir))
  finally:
    root.removeHandler(lines)
    root.setLevel(level)
  return workdir, results, '\n'.join(lines.lines)


def test_a_group_sets_a_field_only_its_model_reads_that_the_ensembles_config_lacks(vit_run):
  """model.depth, hidden, heads, mlp_dim and patch_size (a ViT's) are absent from
  configs/default.py, as from any config whose model does not read them; a ViT group beside
  MLPs sets them, as a config file would (configs/digits_groups.py's ResNet-20 and ViT
  groups). A misspelt field is still refused (above). (A one-block ViT of width 8: a
  ResNet-8 group, the same property, took 19 s alone against this test's 11-14.)"""
  config = _vit_config()
  assert not (set(VIT) - {'name'}) & set(config.model)
  spec = specs.model_spec(member_groups.group_config(config, member_groups.check(config)[1]))
  assert (spec.name, spec.depth, spec.hidden, spec.patch_size) == ('vit', 1, 8, 8)
  workdir, results, log = vit_run
  # The run's first line names each group's architecture, not config.model's alone.
  assert '4 members in 2 groups (2 x mlp (group0), 2 x vit) on mnist1d' in log
  assert results['groups']['vit']['model'] == VIT
  assert np.isfinite(results['groups']['vit']['ensemble']['nll'])
  loaded = dist_ens.Ensemble.load(workdir).member_config(3).model
  assert {f: loaded[f] for f in VIT} == VIT


@pytest.mark.parametrize('group, source, left_out', [
    ('resnet20', 'digits_resnet20.py', ()), ('vit', 'digits_vit.py', ()),
    ('cnn', 'fashion_mnist_cnn.py', ('optim.warmup_steps',)), ('mlp', 'mnist_mlp.py', ()),
])
def test_the_digits_recipes_groups_are_their_configs_models_and_optimizers(group, source,
                                                                            left_out):
  """configs/digits_groups.py states each group's recipe by hand (a reader sees it); it
  must stay the model and optimizer fields its source config changes from the default."""
  root = support.ROOT / 'configs'
  recipe = dist_ens.load_config(root / 'digits_groups.py')
  default, config = (dist_ens.load_config(root / name) for name in ('default.py', source))
  overrides = next(g for g in recipe.ensemble.groups if g['name'] == group)
  for key in ('model', 'optim'):
    changed = {f: config[key][f] for f in config[key]
               if f not in default[key] or config[key][f] != default[key][f]}
    changed = {f: v for f, v in changed.items() if f'{key}.{f}' not in left_out}
    given = {f: v for f, v in overrides[key].items() if f not in default[key]
             or v != default[key][f]}
    assert {f: tuple(v) if isinstance(v, list) else v for f, v in given.items()} == changed
