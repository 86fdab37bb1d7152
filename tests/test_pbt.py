"""Population-based training: the decisions, the exploit, and whole runs (resume, lineage)."""

import csv
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import runs
import support

import dist_ens
from dist_ens.config import specs
from dist_ens.config.loading import load_config
from dist_ens.core import hparams as hparams_lib
from dist_ens.ensembles import pbt as pbt_lib
from dist_ens.errors import ConfigError
from dist_ens.evaluators import pbt as pbt_train

ROOT = Path(__file__).resolve().parents[1]
LR = 'optim.learning_rate'


def _spec(**overrides):
  fields = dict(interval=8, metric='nll', quantile=0.25, fields=(), perturb_factors=(0.8, 1.2),
                resample_probability=0.0, seed=3,
                configured={**{f: 0.0 for f in hparams_lib.FIELDS},
                            LR: 'loguniform(1e-4,1e-2)'},
                varying=[LR], select_metrics={'nll': False, 'accuracy': True})
  fields.update(overrides)
  return pbt_lib.make_spec(**fields)


def _hparams(m):
  hp = {f: np.full(m, 0.5, np.float32) for f in hparams_lib.FIELDS}
  hp[LR] = np.geomspace(1e-4, 1e-2, m).astype(np.float32)
  return hp


def test_worst_quantile_copies_best_and_perturbs_only_explored_fields():
  values = np.array([0.9, 0.2, 0.5, 1.4, 0.3, 0.7, 1.1, 0.4])  # lower is better
  hp = _hparams(8)
  hp['optim.weight_decay'] = np.arange(8, dtype=np.float32) / 10  # not explored: copied
  decision = pbt_lib.decide(_spec(), 1, values, hp)
  best, worst = {1, 4}, {3, 6}  # the 2 lowest and 2 highest of `values`
  for i in range(8):
    src = decision.sources[i]
    if i not in worst:
      assert src == i
      assert all(decision.hparams[f][i] == hp[f][i] for f in hp)
      continue
    assert src in best
    perturbed = {np.float32(np.float64(hp[LR][src]) * f) for f in (0.8, 1.2)}
    assert decision.hparams[LR][i] in perturbed
    assert decision.hparams['optim.weight_decay'][i] == np.float32(src / 10)
  # Higher is better for accuracy: the same values rank the other way round.
  flipped = pbt_lib.decide(_spec(metric='accuracy'), 1, values, hp)
  assert {i for i in range(8) if flipped.sources[i] != i} == best
  assert set(flipped.sources[[1, 4]]) <= worst
  # Deterministic: the same inputs, the same decision.
  again = pbt_lib.decide(_spec(), 1, values, hp)
  np.testing.assert_array_equal(again.sources, decision.sources)
  np.testing.assert_array_equal(again.hparams[LR], decision.hparams[LR])


def test_nan_ranks_last_and_cannot_be_copied():
  values = [0.1, np.nan, 0.3, 0.2]
  decision = pbt_lib.decide(_spec(), 2, values, _hparams(4))
  # ceil(0.25 * 4) = 1 replaced: the NaN member, from the best (member 0).
  assert decision.sources.tolist() == [0, 0, 2, 3]
  everyone_bad = pbt_lib.decide(_spec(), 2, [np.nan] * 4, _hparams(4))
  assert everyone_bad.sources.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize('configured, check', [
    ('loguniform(1e-4,1e-2)', lambda v: 1e-4 * (1 - 1e-6) <= v <= 1e-2 * (1 + 1e-6)),
    ('grid(0.001,0.003,0.01)', lambda v: v in {np.float32(x) for x in (0.001, 0.003, 0.01)}),
    ([0.002, 0.004, 0.006, 0.008], lambda v: v in {np.float32(x) for x in (0.002, 0.004, 0.006, 0.008)}),
])
def test_resample_draws_from_the_sweep_spec(configured, check):
  spec = _spec(resample_probability=1.0, quantile=0.5,
               configured={**{f: 0.0 for f in hparams_lib.FIELDS}, LR: configured})
  drawn = []
  for round_index in range(1, 30):
    decision = pbt_lib.decide(spec, round_index, np.arange(4.0), _hparams(4))
    drawn += [decision.hparams[LR][i] for i in (2, 3)]  # the worst half
  assert all(check(v) for v in drawn), drawn
  assert len(set(drawn)) > 1


def test_perturbation_is_reflected_into_the_spec_range():
  hp = _hparams(4)
  hp[LR][:] = 1e-2  # the top of loguniform(1e-4,1e-2): x1.2 reflects to 1e-2 / 1.2
  spec = _spec(perturb_factors=(1.2,))
  decision = pbt_lib.decide(spec, 1, [0.1, 0.2, 0.3, 0.4], hp)
  assert decision.sources[3] == 0
  assert decision.hparams[LR][3] == pytest.approx(1e-2 / 1.2, rel=1e-6)


def test_exploit_copies_members_bit_for_bit_and_keeps_shardings():
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('member', 'data'))
  rng = np.random.default_rng(0)
  host = {'w': rng.normal(size=(8, 3, 6)).astype(np.float32),
          'count': np.arange(8, dtype=np.int32), 'step': np.int32(7)}
  shardings = {'w': NamedSharding(mesh, P('member', None, 'data')),
               'count': NamedSharding(mesh, P('member')), 'step': NamedSharding(mesh, P())}
  state = jax.tree.map(jax.device_put, host, shardings)
  exploit = pbt_train.make_exploit(shardings, mesh)
  sources = np.array([0, 1, 6, 3, 4, 1, 6, 7], np.int32)
  out = exploit(state, jax.device_put(sources, NamedSharding(mesh, P())))
  np.testing.assert_array_equal(np.asarray(out['w']), host['w'][sources])
  np.testing.assert_array_equal(np.asarray(out['count']), host['count'][sources])
  assert int(out['step']) == 7
  for name in host:
    assert out[name].sharding == shardings[name], name


def _config(**overrides):
  config = load_config(ROOT / 'configs' / 'default.py')
  # Two rounds (4 and 8, not the last step): what the lineage and resume tests need; 24
  # steps with rounds at 8 and 16 checked the same at twice the steps of each run.
  config.train.steps = 12
  config.train.log_every = 4
  config.train.eval_every = 0
  # Saved at 6 (test_resume_after_a_kill_between_rounds_is_exact resumes there, between
  # the rounds at 4 and 8) and at the end.
  config.checkpoint.every = 6
  # A (16,) MLP, as support.config's: the properties are the rounds' decisions and copies,
  # not the model's, and default.py's (256, 256) MLP has ~100x the parameters to compute.
  config.model.widths = (16,)
  config.data.batch_size = 32
  config.data.validation_size = 200
  config.writers = ('jsonl',)
  config.optim.learning_rate = 'loguniform(1e-4,3e-2)'
  config.pbt.enabled = True
  config.pbt.interval = 4
  config.pbt.resample_probability = 0.0
  return support.override(config, **overrides)


class _Capture:
  """Keeps the state and hyperparameters right after the round at `step`."""

  def __init__(self, step):
    self.step, self.seen = step, None

  def on_step(self, call):
    if call.step == self.step:
      self.seen = (jax.device_get(call.state), jax.device_get(call.session.hparams),
                   dict(call.session.results['pbt']))

  def on_end(self, call):
    pass

  def close(self):
    pass


def _run_config(**overrides):
  """The module's run: reproducible, each member's batch in 4 micro-batches, members
  split 8 ways; test_rounds_do_not_depend_on_the_mesh_in_reproducible_mode reruns it on
  another mesh."""
  return _config(reproducible=True, train__micro_batches=4,
                 **{'mesh__member': 8, 'mesh__data': 1, **overrides})


@pytest.fixture(scope='module')
def pbt_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('pbt') / 'run'
  capture = _Capture(4)
  result = dist_ens.train(_run_config(), str(workdir), actions=[capture])
  return workdir, result, capture.seen


def _events(workdir):
  lines = (workdir / 'metrics.jsonl').read_text().splitlines()
  return [json.loads(line) for line in lines]


def _members_csv(workdir):
  with open(workdir / 'members.csv', newline='') as f:
    return list(csv.DictReader(f))


def _in_range(value, low=1e-4, high=3e-2):
  """A perturbed learning rate reflected into _config's loguniform(1e-4,3e-2) by the same
  ratio at a bound it crosses (test_perturbation_is_reflected_into_the_spec_range), as
  float32: the (16,) MLP's best member has a rate near the top."""
  if value > high:
    value = high * high / value
  elif value < low:
    value = low * low / value
  return np.float32(value)


def test_round_copies_state_bit_for_bit_and_perturbs_hyperparameters(pbt_run):
  workdir, result, (state, hp, pbt) = pbt_run
  assert result['train_step_traces'] == 1
  sources = pbt['rounds'][0]['sources']
  copied = [i for i, s in enumerate(sources) if s != i]
  assert len(copied) == 2  # ceil(0.25 * 8)
  initial = hparams_lib.resolve(specs.hparams_spec(_config()))
  for dst in copied:
    src = sources[dst]
    for tree in (state.params, state.opt_state, state.model_state):
      for leaf in jax.tree.leaves(tree):
        np.testing.assert_array_equal(np.asarray(leaf)[dst], np.asarray(leaf)[src])
    perturbed = {_in_range(np.float64(initial[LR][src]) * f) for f in (0.8, 1.2)}
    assert np.asarray(hp[LR])[dst] in perturbed
  for i in set(range(8)) - set(copied):
    assert np.asarray(hp[LR])[i] == initial[LR][i]


def test_lineage_reproduces_the_decisions_from_the_logged_metrics(pbt_run):
  workdir, result, _ = pbt_run
  config = _config()
  spec = specs.pbt_spec(config)
  rounds = [e for e in _events(workdir) if e['split'] == 'pbt']
  assert [e['step'] for e in rounds] == [4, 8]  # not at the last step, 12
  hp = hparams_lib.resolve(specs.hparams_spec(config))
  lineage = [[] for _ in range(8)]
  for event in rounds:
    logged = event['pbt']
    values = [np.nan if v is None else v for v in logged['values']]
    decision = pbt_lib.decide(spec, event['step'] // 4, values, hp)
    assert decision.sources.tolist() == logged['sources']
    for field, column in logged['hparams'].items():
      np.testing.assert_array_equal(np.float32(column), decision.hparams[field], err_msg=field)
    hp = {f: np.float32(v) for f, v in logged['hparams'].items()}
    lineage = [entries + ([f'{event["step"]}<{s}'] if s != i else [])
               for i, (entries, s) in enumerate(zip(lineage, logged['sources']))]
  rows = {int(r['member']): r for r in _members_csv(workdir)}
  for i in range(8):
    assert rows[i]['lineage'] == ' '.join(lineage[i])
    assert np.float32(rows[i][LR]) == pytest.approx(hp[LR][i], rel=1e-5)  # written as %.6g
  assert result['hyperparameters'][LR] == hparams_lib.as_written(hp[LR])


def test_resume_after_a_kill_between_rounds_is_exact(pbt_run, tmp_path):
  workdir, result, _ = pbt_run
  # What a kill right after step 6's checkpoint leaves (runs.killed_after: a copy of the
  # module's run cut there, one training fewer than a faulted run and its resume), resumed.
  stopped = runs.killed_after(workdir, 6, tmp_path / 'stopped')
  resumed = dist_ens.train(_run_config(), str(stopped))
  assert resumed['train_step_traces'] == 1
  assert resumed['members'] == result['members']
  assert resumed['pbt'] == result['pbt']
  assert [e for e in _events(stopped) if e['split'] == 'pbt'] == [
      e for e in _events(workdir) if e['split'] == 'pbt']
  a = dist_ens.Ensemble.load(workdir, devices=jax.devices()[:1])
  b = dist_ens.Ensemble.load(stopped, devices=jax.devices()[:1])
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_disabled_is_the_plain_sweep_and_untouched_members_match_it(pbt_run, tmp_path):
  workdir, result, _ = pbt_run
  plain = dist_ens.train(_run_config(pbt__enabled=False), str(tmp_path / 'plain'))
  assert 'pbt' not in plain and plain['train_step_traces'] == 1
  assert not [e for e in _events(tmp_path / 'plain') if e['split'] == 'pbt']
  assert 'lineage' not in _members_csv(tmp_path / 'plain')[0]
  # A member never replaced trained exactly as in the sweep: nothing flows into it.
  kept = [i for i, line in enumerate(result['pbt']['lineage']) if not line]
  assert len(kept) >= 4
  for metric in ('nll', 'accuracy'):
    for i in kept:
      assert result['members'][metric][i] == plain['members'][metric][i], (metric, i)
  replaced = set(range(8)) - set(kept)
  assert any(result['members']['nll'][i] != plain['members']['nll'][i] for i in replaced)


@pytest.mark.parametrize('overrides, match', [
    (dict(data__validation_size=0), r'pbt.enabled=True .*data.validation_size > 0'),
    (dict(optim__learning_rate=1e-3), r'pbt.fields=\(\) finds nothing to explore'),
    (dict(pbt__fields=('optim.lr',)), r'pbt.fields=.*not per member'),
    (dict(pbt__quantile=0.75), r'pbt.quantile=0.75 must be a fraction in \(0, 0.5\]'),
    (dict(pbt__interval=12), r'pbt.interval=12 is invalid: must be below train.steps=12'),
    (dict(pbt__metric='loss'), r"pbt.metric='loss' .*use one of"),
    (dict(pbt__perturb_factors=(0.8, -1.0)), r'pbt.perturb_factors'),
    (dict(ensemble__method='batchensemble'), r"pbt.enabled=True .*ensemble.method='deep'"),
    (dict(train__steps_per_call=3, train__log_every=3, checkpoint__every=3),
     r'pbt.interval=4 is invalid: must be a multiple of train.steps_per_call=3'),
])
def test_bad_pbt_config_is_refused_naming_the_field(tmp_path, overrides, match):
  with pytest.raises(ConfigError, match=match):
    dist_ens.train(_config(**overrides), str(tmp_path / 'w'))
  assert not (tmp_path / 'w').exists()


def test_rounds_do_not_depend_on_the_mesh_in_reproducible_mode(pbt_run, tmp_path):
  # Two meshes, members split 8 ways (the module's run) vs each member's batch split 4
  # ways: the same decisions, and members equal up to the evaluation's rounding.
  _, a, _ = pbt_run
  b = dist_ens.train(_run_config(mesh__member=2, mesh__data=4), str(tmp_path / 'b'))
  assert a['pbt']['rounds'] == b['pbt']['rounds'] and a['pbt']['rounds'][0]['step'] == 4
  assert a['hyperparameters'] == b['hyperparameters']
  np.testing.assert_allclose(a['members']['nll'], b['members']['nll'], rtol=1e-6)


def test_the_report_draws_each_members_schedule_and_copies(pbt_run, tmp_path, monkeypatch):
  """report_pbt.schedules: starts at the sweep's values, marks exactly the members the
  lineage names at each round, and a member's values change only where it copied; the
  report of a PBT run renders its figure and names it."""
  pytest.importorskip('matplotlib')
  # pylint: disable=import-outside-toplevel
  from dist_ens.report import build as report, pbt as report_pbt, plots, scatter
  workdir, result, _ = pbt_run
  workdir = runs.copy(workdir, tmp_path / 'run')  # make_report writes into the workdir.
  # Only the PBT figure rendered: matplotlib's savefig of the others took ~6 of this test's
  # 8 s, and rendering them is the same for any run (tests/test_report.py renders every
  # figure of its runs). Theirs are placeholder files, as test_groups' fast report test.
  save = plots._save  # pylint: disable=protected-access

  def only_pbt(fig, out, name):
    if name == 'pbt':
      save(fig, out, name)
    else:
      for suffix in ('.png', '.svg'):
        (out / name).with_suffix(suffix).write_bytes(b'<svg/>')

  monkeypatch.setattr(plots, '_save', only_pbt)
  monkeypatch.setattr(scatter, '_save', only_pbt)
  s = report_pbt.schedules(_config(), _events(workdir))
  initial = hparams_lib.resolve(specs.hparams_spec(_config()))
  np.testing.assert_allclose(s['fields'][LR][:, 0], initial[LR], rtol=1e-6)
  rounds = result['pbt']['rounds']
  assert s['steps'].tolist() == [0] + [r['step'] for r in rounds]
  for m, entries in enumerate(result['pbt']['lineage']):
    marked = [f'{s["steps"][r + 1]}<{rounds[r]["sources"][m]}'
              for r in np.flatnonzero(s['copied'][m])]
    assert ' '.join(marked) == entries
    lr = s['fields'][LR][m]  # Written values: rounded to float32's digits.
    changed = ~np.isclose(lr[1:], lr[:-1], rtol=1e-6)
    assert not np.any(changed & ~s['copied'][m])
  out = report.make_report(workdir)
  assert (out / 'pbt.png').read_bytes().startswith(b'\x89PNG') and (out / 'pbt.svg').is_file()
  assert 'Population-based training' in (out / 'report.md').read_text()


def test_round_line_counts_copies_of_a_large_population():
  """A round of 4,096 members copies 1,024: the log line names a few and counts them
  (members.csv's lineage column lists each); a small round names every copy."""
  values = list(np.linspace(0.4, 0.9, 4096))
  sources = list(range(4096))
  sources[-1024:] = range(1024)
  line = pbt_train.round_line(3, 600, 'nll', values, sources)
  assert len(line) < 400 and '1,024 members copied better ones' in line
  assert 'member 3072 copied member 0' in line
  assert pbt_train.round_line(1, 10, 'nll', [0.5, 0.7], [0, 0]).endswith(
      'member 1 copied member 0')
