"""Per-member hyperparameters: spec expansion, command-line parsing, member independence."""

import csv
from pathlib import Path

import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

import support

from dist_ens.config import specs
from dist_ens import data
from dist_ens.core import hparams
import dist_ens
from dist_ens.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / 'configs' / 'default.py'


def _config(**overrides):
  """support.config's tiny run (4 members of a (16,) MLP, batch 32, on its own mesh): 20
  steps logged every 10, saved at the end. A sweep's member equals a single run's at any
  size and mesh."""
  return support.config({'train.steps': 20, 'train.log_every': 10, 'checkpoint.every': 20},
                        **overrides)


def _resolve(config):
  return specs.resolve_hparams(config)


def test_scalars_lists_and_spaced_specs():
  config = _config(optim__learning_rate=[1e-3, 2e-3, 3e-3, 4e-3],
                   optim__weight_decay='linspace(0, 0.3)', model__init_scale='logspace(0.1, 10)')
  values = _resolve(config)
  np.testing.assert_allclose(values['optim.learning_rate'], [1e-3, 2e-3, 3e-3, 4e-3])
  np.testing.assert_allclose(values['optim.weight_decay'], [0, 0.1, 0.2, 0.3], atol=1e-7)
  np.testing.assert_allclose(values['model.init_scale'], [0.1, 1 / 1.0 ** 0 * 10 ** (-1 / 3),
                                                          10 ** (1 / 3), 10], rtol=1e-6)
  np.testing.assert_array_equal(values['optim.b1'], np.full(4, 0.9, np.float32))
  assert all(v.dtype == np.float32 and v.shape == (4,) for v in values.values())
  assert hparams.varying(values) == ['optim.learning_rate', 'optim.weight_decay',
                                     'model.init_scale']


@pytest.mark.parametrize('spec', ['uniform(0.1, 0.2)', 'loguniform(1e-4, 1e-2)'])
def test_random_specs_depend_on_seed_and_member_not_on_m(spec):
  lo, hi = (0.1, 0.2) if spec.startswith('uniform') else (1e-4, 1e-2)
  three = _resolve(_config(num_members=3, optim__learning_rate=spec))
  eight = _resolve(_config(num_members=8, optim__learning_rate=spec))
  np.testing.assert_array_equal(three['optim.learning_rate'], eight['optim.learning_rate'][:3])
  values = eight['optim.learning_rate']
  assert np.all((values >= lo) & (values <= hi)) and np.unique(values).size == 8
  other_seed = _resolve(_config(num_members=8, seed=1, optim__learning_rate=spec))
  assert not np.allclose(other_seed['optim.learning_rate'], values)
  # Two fields with the same spec draw differently.
  both = _resolve(_config(num_members=8, optim__learning_rate='uniform(0.1, 0.2)',
                                 optim__weight_decay='uniform(0.1, 0.2)'))
  assert not np.allclose(both['optim.learning_rate'], both['optim.weight_decay'])


def test_grid_is_a_cartesian_product_in_field_order():
  values = _resolve(_config(optim__learning_rate='grid(1e-3, 1e-2)',
                                   optim__weight_decay='grid(0, 0.1)'))
  pairs = list(zip(values['optim.learning_rate'].tolist(), values['optim.weight_decay'].tolist()))
  np.testing.assert_allclose(pairs, [(1e-3, 0), (1e-3, 0.1), (1e-2, 0), (1e-2, 0.1)], rtol=1e-6)


@pytest.mark.parametrize('overrides,message', [
    (dict(optim__learning_rate='grid(1,2,3)', optim__weight_decay='grid(0,1)'),
     r'config.num_members=4: the grid over optim.learning_rate, optim.weight_decay has 3 '
     r'\(optim.learning_rate\) x 2 \(optim.weight_decay\) = 6 points; set num_members=6'),
    (dict(optim__learning_rate=[1e-3, 2e-3]), r'config.optim.learning_rate has 2 values.*'
                                              r'exactly num_members=4'),
    (dict(optim__learning_rate='cosine(1, 2)'), r"unknown spec 'cosine'"),
    (dict(optim__learning_rate='fast'), r"config.optim.learning_rate='fast' is not a number"),
    (dict(optim__learning_rate='logspace(0, 1)'), r'logspace needs lo and hi > 0'),
    (dict(optim__learning_rate='uniform(1)'), r'uniform takes two numbers'),
    (dict(optim__learning_rate=[1e-3, -1.0, 1e-3, 1e-3]), r'config.optim.learning_rate.*> 0'),
    (dict(optim__learning_rate=0.0), r'config.optim.learning_rate=0.0.*> 0'),
    (dict(optim__b1=[0.9, 0.9, 1.0, 0.9]), r'config.optim.b1.*< 1.0'),
    (dict(train__label_smoothing=True), r'config.train.label_smoothing=True must be a number'),
    (dict(model__init_scale={'a': 1}), r'config.model.init_scale=.*dict'),
])
def test_bad_values_name_the_field(overrides, message):
  with pytest.raises(ConfigError, match=message):
    _resolve(_config(**overrides))


def test_core_names_its_own_fields_and_the_edge_the_configs():
  # core/ raises a plain ValueError naming the field as core.hparams.FIELDS does; only the
  # edge that read the config (config.specs.resolve_hparams) says `config.`.
  fields = dict(specs.hparams_spec(_config()).fields, **{'optim.b1': 'loguniform(0, 1)'})
  with pytest.raises(hparams.HparamsError) as raised:
    hparams.resolve(hparams.HparamsSpec(4, 0, fields))
  assert raised.value.field == 'optim.b1' and not isinstance(raised.value, ConfigError)
  assert str(raised.value).startswith("optim.b1='loguniform(0, 1)': loguniform needs lo and hi")
  with pytest.raises(ConfigError, match=r"^config\.optim\.b1='loguniform\(0, 1\)': loguniform"):
    _resolve(_config(optim__b1='loguniform(0, 1)'))


def test_command_line_forms_work_as_written():
  for argv, expected in (
      (["--config.optim.learning_rate=[0.001,0.002,0.003,0.004]"], [0.001, 0.002, 0.003, 0.004]),
      (["--config.optim.learning_rate=loguniform(1e-4,1e-2)"], 'loguniform(1e-4,1e-2)'),
      (["--config.optim.learning_rate=0.02"], 0.02)):
    flag_values = flags.FlagValues()
    sys_argv = ['prog', f'--config={DEFAULT}', *argv]
    holder = config_flags.DEFINE_config_file('config', str(DEFAULT), flag_values=flag_values,
                                             sys_argv=sys_argv)
    flag_values(sys_argv)
    assert holder.value.optim.learning_rate == expected
    holder.value.num_members = 4
    assert _resolve(holder.value)['optim.learning_rate'].shape == (4,)


def _member_metrics(final, i):
  return {k: final['members'][k][i] for k in ('accuracy', 'nll', 'brier', 'ece')}


ADAM_SWEEP = dict(optim__learning_rate=[1e-3, 3e-3, 1e-2, 2e-3],
                  optim__weight_decay=[0.0, 0.1, 0.01, 0.3], optim__b1=[0.9, 0.8, 0.95, 0.5],
                  train__label_smoothing=[0.0, 0.1, 0.2, 0.05],
                  model__init_scale=[1.0, 0.5, 2.0, 1.5])


@pytest.fixture(scope='module')
def sweeps(tmp_path_factory):
  """sweeps(optimizer, fields): the run of that sweep, trained once for the module (the
  adam sweep is also test_changing_one_members_value_changes_only_that_member's base)."""
  runs = {}

  def get(optimizer, fields):
    if optimizer not in runs:
      workdir = tmp_path_factory.mktemp(f'sweep_{optimizer}')
      runs[optimizer] = dist_ens.train(_config(optim__name=optimizer, **fields), str(workdir))
    return runs[optimizer]
  return get


@pytest.mark.parametrize('optimizer,fields', [
    ('adam', ADAM_SWEEP),
    ('sgd', dict(optim__learning_rate=[0.1, 0.03, 0.3, 0.05], optim__momentum=[0.9, 0.0, 0.5, 0.99])),
])
def test_sweep_member_equals_a_run_where_every_member_has_its_values(tmp_path, sweeps, optimizer,
                                                                    fields):
  sweep = sweeps(optimizer, fields)
  assert sweep['train_step_traces'] == 1
  assert set(sweep['hyperparameters']) == {k.replace('__', '.') for k in fields}
  for k, v in fields.items():  # As written, not as float32 rounds them (0.0010000000474...).
    assert sweep['hyperparameters'][k.replace('__', '.')] == v
  i = 2  # One member that is not the first (each single run costs a compile).
  scalars = {k: v[i] for k, v in fields.items()}
  single = dist_ens.train(_config(optim__name=optimizer, **scalars), str(tmp_path / f'single{i}'))
  assert _member_metrics(sweep, i) == _member_metrics(single, i), f'member {i}'


def test_changing_one_members_value_changes_only_that_member(tmp_path, sweeps):
  base = sweeps('adam', ADAM_SWEEP)  # The adam sweep's run, member 2's rate changed below.
  lrs = ADAM_SWEEP['optim__learning_rate']
  changed = dist_ens.train(_config(optim__name='adam', **{
      **ADAM_SWEEP, 'optim__learning_rate': lrs[:2] + [5e-2] + lrs[3:]}), str(tmp_path / 'b'))
  for i in (0, 1, 3):
    assert _member_metrics(changed, i) == _member_metrics(base, i)
  assert _member_metrics(changed, 2) != _member_metrics(base, 2)


def _selection_run(tmp_path, name):
  return dist_ens.train(_config(num_members=8, mesh__member=8, mesh__data=1, data__validation_size=400,
                           optim__learning_rate='logspace(1e-4, 3e-2)', select__top_k=3),
                   str(tmp_path / name))


def test_selection_uses_validation_only(tmp_path, monkeypatch):
  final = _selection_run(tmp_path, 'a')
  selected = final['selected']
  assert len(selected['members']) == 3 and selected['by'] == 'validation nll'
  val_nll = np.array(final['validation']['members']['nll'])
  assert sorted(selected['members']) == sorted(np.argsort(val_nll)[:3].tolist())
  rows = list(csv.DictReader((tmp_path / 'a' / 'members.csv').open()))
  assert [int(r['member']) for r in rows[:3]] == np.argsort(val_nll)[:3].tolist()
  assert len(rows) == 8 and 'optim.learning_rate' in rows[0] and 'test_nll' in rows[0]

  # Scramble the test labels: what is selected must not change.
  original = data.load_dataset

  def scrambled(*args):
    ds = original(*args)
    y = np.random.default_rng(0).permutation(ds.test.y)
    return ds._replace(test=data.Split(ds.test.x, y))

  monkeypatch.setattr(data, 'load_dataset', scrambled)
  scrambled_final = _selection_run(tmp_path, 'b')
  assert scrambled_final['selected']['members'] == selected['members']
  assert scrambled_final['ensemble']['accuracy'] != final['ensemble']['accuracy']


def test_validation_split_is_disjoint_and_fixed():
  ds = data.load_dataset('mnist1d')
  train_a, val_a = data.split_validation(ds.train, 500)
  train_b, val_b = data.split_validation(ds.train, 500)
  np.testing.assert_array_equal(val_a.x, val_b.x)
  assert train_a.num_examples == 3500 and len(val_a.y) == 500
  train_x = train_a.read(np.arange(train_a.num_examples))[0]
  rows = {r.tobytes() for r in ds.train.x}
  assert {r.tobytes() for r in val_a.x} | {r.tobytes() for r in train_x} == rows
  assert not {r.tobytes() for r in val_a.x} & {r.tobytes() for r in train_x}


def test_top_k_needs_a_validation_split(tmp_path):
  with pytest.raises(ConfigError, match='config.select.top_k=2.*data.validation_size > 0'):
    dist_ens.train(_config(select__top_k=2), str(tmp_path))
