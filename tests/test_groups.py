"""Member groups (config.ensemble.groups): members of different architectures trained as
one program. The key property: a group's members are the same members, bit for bit in
reproducible mode, as the members of the same ids in a run without groups whose model
and optimizer are the group's."""

import json
import shutil

import jax
import numpy as np
import pytest

import support

import dist_ens
from dist_ens.data import load_dataset

# Two groups of two members: ids 0-1 an MLP of one hidden layer, ids 2-3 one of two with
# its own learning rate. A tiny run (support.config: 4 steps, batch 32).
GROUPS = ({'count': 2, 'model': {'widths': (16,)}},
          {'count': 2, 'model': {'widths': (8, 8)}, 'optim': {'learning_rate': 3e-3},
           'name': 'deep'})


def _config(groups=GROUPS, **fields):
  config = support.config(**{'reproducible': True, **fields})
  config.ensemble.groups = groups
  return config


def _single(group, **fields):
  """The run without groups whose model and optimizer are `group`'s: its members of the
  group's ids are the group's members."""
  config = support.config(**{'reproducible': True, **fields})
  for key in ('model', 'optim'):
    for field, value in group.get(key, {}).items():
      config[key][field] = value
  return config


def _stored(workdir):
  return jax.device_get(dist_ens.Ensemble.load(workdir)._stored)  # pylint: disable=protected-access


@pytest.fixture(scope='module')
def grouped(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('grouped')
  return workdir, dist_ens.train(_config(), str(workdir))


def test_a_groups_members_equal_the_same_members_without_groups(grouped, tmp_path):
  workdir, results = grouped
  stored = _stored(workdir)
  assert isinstance(stored, tuple) and len(stored) == 2
  first = 0
  for g, group in enumerate(GROUPS):
    single = dist_ens.train(_single(group), str(tmp_path / f'single{g}'))
    ids = slice(first, first + group['count'])
    # Bit for bit: parameters, and the test metrics computed from them.
    support.assert_trees_equal(stored[g], jax.tree.map(lambda a, i=ids: a[i],
                                                       _stored(tmp_path / f'single{g}')))
    for metric in ('nll', 'accuracy'):
      assert results['members'][metric][ids] == single['members'][metric][ids]
    first += group['count']


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


def test_load_and_predict_combine_every_group(grouped):
  workdir, results = grouped
  ensemble = dist_ens.Ensemble.load(workdir)
  test = load_dataset('mnist1d').test
  out = ensemble.predict(test.x[:50])
  assert out.probs.shape == (50, 10) and out.member_probs.shape == (4, 50, 10)
  np.testing.assert_allclose(out.probs, out.member_probs.mean(0), rtol=1e-5, atol=1e-6)
  accuracy = (out.member_probs.argmax(-1) == test.y[:50]).mean(-1)
  assert accuracy.shape == (4,)
  # Export and per-member access are refused in one line, not a traceback.
  message = support.one_line_refusal(lambda: ensemble.export(workdir / 'members'))
  assert 'Ensemble.export' in message and 'ensemble.groups' in message
  # Loaded onto one device: the same predictions.
  one = dist_ens.Ensemble.load(workdir, devices=jax.devices()[:1])
  np.testing.assert_allclose(one.predict(test.x[:50]).probs, out.probs, rtol=1e-5, atol=1e-6)


def test_an_interrupted_run_resumes_to_the_uninterrupted_state(grouped, tmp_path):
  workdir, results = grouped
  config = _config()
  stopped = dist_ens.train(config, str(tmp_path), actions=[support.PreemptAt(2)])
  assert stopped['preempted'] and stopped['step'] == 2
  resumed = dist_ens.train(config, str(tmp_path))
  support.assert_trees_equal(_stored(tmp_path), _stored(workdir))
  assert resumed['members']['nll'] == results['members']['nll']


@pytest.mark.parametrize('field, value', [
    ('ensemble.method', 'prior'),
    ('ensemble.own', 'head'), ('pbt.enabled', True),
    ('select.top_k', 2), ('eval.mc_samples', 2), ('eval.shift', 'all'),
    ('mesh.model', 2), ('data.member_split', 'kfold:2'),
])
def test_what_groups_do_not_support_yet_is_refused_in_one_line(field, value, tmp_path):
  config = _config(**{field.replace('.', '__'): value})
  message = support.one_line_refusal(lambda: dist_ens.train(config, str(tmp_path)))
  assert 'config.ensemble.groups' in message and field in message, message
  assert not any(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.parametrize('groups, num_members, words', [
    (GROUPS, 6, ('num_members=6', 'counts 4', 'num_members=4')),
    (({'count': 4, 'model': {'width': (8,)}},), 4, ('model.width', 'widths')),
    (({'count': 4, 'layers': 2},), 4, ("['layers']", 'count')),
    (({'count': 0},), 4, ('count=0', '>= 1')),
    (({'count': 4, 'optim': {'learning_rate': [1e-3, 2e-3, 3e-3, 4e-3]}},), 4,
     ('optim.learning_rate', 'per-member lists')),
    ('[{"count": 4}]', 4, ('string', 'config file')),
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


def test_plan_and_report_refuse_groups(grouped):
  from dist_ens import plan  # pylint: disable=g-import-not-at-top
  from dist_ens.io import report  # pylint: disable=g-import-not-at-top
  assert 'dist-ens plan' in support.one_line_refusal(lambda: plan.make_plan(_config()))
  pytest.importorskip('matplotlib')
  workdir, _ = grouped
  assert 'dist-ens report' in support.one_line_refusal(lambda: report.make_report(workdir))


@pytest.mark.slow
@pytest.mark.parametrize('fields', [
    {'data__member_order': 'shuffled'},
    {'data__member_order': 'bootstrap', 'train__steps_per_call': 2},
    {'mesh__member': 2, 'mesh__data': 4, 'train__micro_batches': 4,
     'data__augment': 'crop_flip'},
], ids=['shuffled', 'bootstrap-2-per-call', 'data-axis-augment'])
def test_groups_equal_single_runs_with_per_member_data_and_other_meshes(fields, tmp_path):
  """Per-member data orders (each group takes its ids' batches), K steps per call and a
  data axis: still the same members as without groups, bit for bit."""
  grouped = dist_ens.train(_config(**fields), str(tmp_path / 'grouped'))
  stored, first = _stored(tmp_path / 'grouped'), 0
  for g, group in enumerate(GROUPS):
    dist_ens.train(_single(group, **fields), str(tmp_path / f'single{g}'))
    ids = slice(first, first + group['count'])
    support.assert_trees_equal(stored[g], jax.tree.map(lambda a, i=ids: a[i],
                                                       _stored(tmp_path / f'single{g}')))
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
