"""Every combination works or is refused (DESIGN.md property 8), over the options of
tests/combinations_table.py.

Valid pairs run packed into a few cases (combinations_table.valid_cases: every valid pair
is in some case, no case holds a refused pair; `pytest` runs the cheapest cases found that
hold every option once, _FAST_IDS, `pytest -m slow` the rest); each case trains on 8 fake devices, is
preempted (SIGTERM) after step 1 and resumes from that checkpoint to step 2 (a few cases
instead train uninterrupted and resume from a copy killed after step 1, ending bit for bit
where the uninterrupted run ended), tracing its train step once in that session, then loads with Ensemble.load, predicts finite outputs that give the run's
reported test accuracy or RMSE (and the same outputs loaded on one device), and exports every predicting member to the file that holds
its leaves. Each
refused pair, with every other axis at its default, must raise ConfigError in one line
naming both fields before the workdir exists. docs/combinations.md is the same table.
"""

import functools
import importlib.util
import logging
import math
from pathlib import Path

import numpy as np
import pytest

import combinations_table as table
import runs
import support

import dist_ens
from dist_ens import data, tasks
from dist_ens.config import checks
from dist_ens.core import optim
from dist_ens.data import member_split, pipeline, resident
from dist_ens.ensembles import methods, own, students
from dist_ens.errors import ConfigError
from dist_ens.eval import laplace
from dist_ens.evaluators import posthoc

ROOT = Path(__file__).resolve().parents[1]


def _toy(n, seed, kind):
  rng = np.random.default_rng(seed)
  # Signals [L, C], which eval.shift's corruptions apply to (not to tabular [F] inputs).
  x = rng.normal(size=(n, 8, 1)).astype(np.float32)
  if kind == 'classes':
    return x, ((x[:, 0, 0] > 0).astype(np.int32) + (x[:, 1, 0] > 0)).astype(np.int32)
  y = np.sin(x[:, :2, 0]) * np.array([1.0, 2.0]) + 0.1 * rng.standard_normal((n, 2))
  return x, (y[:, 0] if kind == 'targets' else y).astype(np.float32)


def _tokens(n, seed):
  """Next-token pairs of a repeating pattern 0..4 (vocabulary 6); every third row ends
  early, its tail padded (input token 5, target -1: not scored)."""
  rng = np.random.default_rng(seed)
  seq = (rng.integers(0, 5, n)[:, None] + np.arange(9)[None]) % 5
  pad = (np.arange(8)[None] >= 5) & (np.arange(n) % 3 == 0)[:, None]
  return (np.where(pad, 5, seq[:, :-1]).astype(np.int32),
          np.where(pad, -1, seq[:, 1:]).astype(np.int32))


DATASETS = {kind: data.from_arrays(*_toy(128, 0, kind), *_toy(32, 1, kind), name=kind)
            for kind in ('classes', 'targets', 'vectors')}
DATASETS['tokens'] = data.from_arrays(*_tokens(128, 0), *_tokens(32, 1), name='tokens',
                                      num_classes=6, pad_id=-1)


def _config(case):
  config = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.model.widths = 4, (8,)
  config.data.batch_size, config.data.prefetch, config.eval.batch_size = 16, 0, 64
  config.train.steps, config.train.log_every, config.train.eval_every = 2, 2, 0
  config.checkpoint.every, config.checkpoint.keep, config.writers = 1, 2, ('jsonl',)
  overrides = {}
  for option in case:
    overrides.update(option.overrides)
  config.update_from_flattened_dict(overrides)
  return config


def _dataset(case):
  [task] = [o for o in case if table.AXIS_OF.get(o.key) == 'task']
  return DATASETS[task.dataset]


def _same(a, b, path=''):
  """Where two final_metrics differ (resume must end where the straight run ended)."""
  if isinstance(a, dict) and isinstance(b, dict):
    return [d for k in sorted(set(a) | set(b)) for d in _same(a.get(k), b.get(k), f'{path}/{k}')]
  if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
    return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f'{path}/{i}')]
  if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
    return []
  return [] if a == b else [path]


def _train_resume_load_predict(case, workdir, caplog, straight_dir=None):
  """Preempted (SIGTERM) after step 1 and resumed to step 2; with `straight_dir`, the run
  trains uninterrupted there instead, a kill right after its step-1 checkpoint is copied
  to `workdir` (runs.killed_after: the checkpoint the preempted run saves, as every=1
  saves each step) and the resume from it must end where the uninterrupted run ended."""
  config, dataset = _config(case), _dataset(case)
  if straight_dir is None:
    stopped = dist_ens.train(config, str(workdir), dataset=dataset,
                             actions=[support.PreemptAt(1)])
    assert stopped['preempted'] and stopped['step'] == 1, stopped
  else:
    straight = dist_ens.train(config, str(straight_dir), dataset=dataset)
    runs.killed_after(straight_dir, 1, workdir)
  caplog.clear()
  resumed = dist_ens.train(_config(case), str(workdir), dataset=dataset)
  assert 'resuming from the checkpoint at step 1' in caplog.text
  assert resumed['step'] == 2
  # One program for the session, whatever the options: a retrace would compile again.
  assert resumed['train_step_traces'] == 1, resumed['train_step_traces']
  if straight_dir is not None:  # Resume ends where an uninterrupted run ends.
    differ = [p for p in _same(straight, resumed) if not p.endswith('_seconds')]
    assert not differ, f'the resumed run ends elsewhere: {differ[:8]}'
  support.check_loaded_run(workdir, dataset, resumed)


_CASES = table.valid_cases()
# Options the fast tier leaves to the slow one: what they hold, a fast case holds too
# (epinet: a frozen network in the model state as 'prior', a loss over an extra output
# axis as 'mimo'; tests/test_epinet.py covers its resume and predictions; own=epinet, a
# shared base as own=head: tests/test_epinet_frozen_base.py).
_SLOW_ONLY = frozenset({'epinet', 'own=epinet'})
_REGRESSION = ('regression', 'regression [N, D]', 'regression_homoscedastic')
# Option combinations that other tests name as their fast cover in this matrix: some fast
# case holds one key of each slot.
_NAMED_COVERS = {
    # tests/test_groups.py's split-groups test leaves MC dropout and the Laplace to it.
    'MC dropout and Laplace on a model axis': (('mc_dropout',), ('model=2',), ('laplace',)),
    # docs/testing.md: the fast cover of test_groups' slow batchensemble-group test.
    'batchensemble in member groups': (('batchensemble',), ('groups',)),
    # tests/test_batchensemble.py and tests/test_packed.py check a classifier's run.
    'batchensemble on a regression task': (('batchensemble',), _REGRESSION),
    'packed on a regression task': (('packed',), _REGRESSION),
}
# The fast tier's cases: every option but _SLOW_ONLY in one, each named cover, and for
# each of pbt, multiswag and fge a case that is compared bit for bit with an uninterrupted
# run (where state crosses the resume: a PBT round at step 1, SWAG's and FGE's collected
# weights), at the least cost found: each case's CPU seconds measured alone, then a
# minimum-cost cover of the options (issue 64, 2026-11-28: this file alone 123 -> 89 s,
# 663 -> 542 compiles, against the earlier pick of the cases holding the most missing
# options, whose model axes, groups and token run multiplied every program of a case).
# What a case costs is its programs: a task, method, model axis or member groups changes
# them all, a post-hoc option adds a few.
_FAST_IDS = (
    'regression+batchensemble+model=2+member_split+top_k+greedy+shift+conformal+groups',
    'mc_dropout+model=2+member_split+temperature+laplace+reproducible+bf16+distill',
    'multiswag+bf16',
    'fge+greedy+temperature+shift+conformal',
    'sngp+pbt+greedy distinct',
    'token_classification+own=head+greedy distinct',
    'regression_homoscedastic+own=lora',
    'regression_homoscedastic+packed',
    'regression [N, D]+masksembles',
    'mimo+greedy distinct+temperature',
    'member_split+distill=path',
    'prior+bf16',
    'rank1+temperature',
    'sgmcmc+bf16',
    'snapshot+bf16',
)


def _keys(case) -> set[str]:
  return {o.key for o in case}


def _holds(case, slots) -> bool:
  return all(_keys(case) & set(slot) for slot in slots)


def _fast_cases() -> tuple[list[tuple[table.Option, ...]], list[str]]:
  """The cases of _FAST_IDS; where a change to the table left some out (its cases are
  packed anew), cases holding what is then missing, the most missing options first, so
  that the fast tier still holds every option and named cover. Returns the cases and the
  ids so added (test_the_fast_cases_are_current names them)."""
  chosen = [c for c in _CASES if table.case_id(c) in _FAST_IDS]
  fast_able = [c for c in _CASES if not _SLOW_ONLY & _keys(c)]
  wanted = {o.key for options in table.AXES.values() for o in options
            if o.fields} - _SLOW_ONLY
  added = []
  while True:
    missing = wanted - set().union(*map(_keys, chosen))
    unheld = [slots for slots in _NAMED_COVERS.values()  # Refused now: the test says so.
              if not any(_holds(c, slots) for c in chosen)
              and any(_holds(c, slots) for c in fast_able)]
    if unheld:
      pick = next(c for c in fast_able if _holds(c, unheld[0]))
    elif missing:
      pick = max(fast_able, key=lambda c: len(_keys(c) & missing))
    else:
      return chosen, added
    chosen.append(pick)
    added.append(table.case_id(pick))


_FAST, _FAST_ADDED = _fast_cases()
# The fast case compared bit for bit for each of these options (the first holding it): the
# resume from a copy of the uninterrupted run killed after step 1, two runs as the others.
# The preemption that saves step 1 is the trainer's, the same for every case; the other
# cases run it.
_COMPARED = [next(c for c in _FAST if key in _keys(c)) for key in ('pbt', 'multiswag', 'fge')]


@pytest.mark.parametrize('case', [
    pytest.param(c, marks=() if c in _FAST else pytest.mark.slow) for c in _CASES],
                         ids=[table.case_id(c) for c in _CASES])
def test_valid_options_train_resume_load_and_predict(case, tmp_path, caplog):
  caplog.set_level(logging.INFO, logger='absl')
  _train_resume_load_predict(case, tmp_path / 'w', caplog,
                             tmp_path / 'straight' if case in _COMPARED else None)


_REFUSED = sorted(tuple(sorted(p)) for p in table.REFUSED)


@pytest.mark.parametrize('a, b', _REFUSED, ids=['+'.join(p) for p in _REFUSED])
def test_a_refused_pair_is_refused_in_one_line_naming_both_before_anything(a, b, tmp_path):
  first, second = table.OPTIONS[a], table.OPTIONS[b]
  case = table.with_defaults(first, second)
  with pytest.raises(ConfigError) as refused:
    dist_ens.train(_config(case), str(tmp_path / 'w'), dataset=_dataset(case))
  message = str(refused.value)
  assert '\n' not in message, message
  for option in (first, second):
    assert any(field in message for field in option.fields), (option.fields, message)
  assert not (tmp_path / 'w').exists()


_KNOWN = sorted(tuple(sorted(p)) for p in table.KNOWN_FAILURES)


@pytest.mark.parametrize('a, b', [
    pytest.param(a, b, marks=pytest.mark.xfail(
        strict=True, reason=table.KNOWN_FAILURES[frozenset((a, b))])) for a, b in _KNOWN],
                         ids=['+'.join(p) for p in _KNOWN])
def test_a_known_failure_still_fails(a, b, tmp_path, caplog):
  caplog.set_level(logging.INFO, logger='absl')
  case = table.with_defaults(table.OPTIONS[a], table.OPTIONS[b])
  _train_resume_load_predict(case, tmp_path / 'w', caplog)


def test_the_cases_hold_every_valid_pair_and_no_other():
  covered = {frozenset((x.key, y.key)) for case in _CASES for x in case for y in case if x != y}
  for a, b in table.all_pairs():
    pair, outcome = frozenset((a.key, b.key)), table.outcome(a.key, b.key)
    assert (pair in covered) == (outcome == 'valid'), (pair, outcome)
  for pair in (*table.REFUSED, *table.KNOWN_FAILURES):
    assert len({table.AXIS_OF[k] for k in pair}) == 2, pair  # known options, two axes


def test_the_fast_cases_are_current_and_hold_every_option_and_named_cover():
  ids = {table.case_id(c) for c in _CASES}
  gone = [i for i in _FAST_IDS if i not in ids]
  assert not gone, (f'_FAST_IDS names cases the table no longer packs: {gone}; replace them '
                    f'with cheap cases that hold their options (these were added: '
                    f'{_FAST_ADDED})')
  assert len(_FAST) == len(set(map(table.case_id, _FAST))) == len(_FAST_IDS)
  held = set().union(*map(_keys, _FAST))
  for option in table.OPTIONS.values():
    if option.fields and option.key not in _SLOW_ONLY:
      assert option.key in held, option.key
  for name, slots in _NAMED_COVERS.items():
    assert any(_holds(c, slots) for c in _FAST), name
  assert all(key in _keys(c) for key, c in zip(('pbt', 'multiswag', 'fge'), _COMPARED))


# Every closed set of values an option of the matrix takes (and the member orders), read
# from the package: a value added there without a case here fails the test below.
CLOSED = {
    'task': tuple(tasks.TASKS),
    'ensemble.method': tuple(methods.METHODS),
    'ensemble.own': (*own.NAMED, *methods.METHOD_OWN),
    'eval.laplace': laplace.KINDS,
    'data.member_order': pipeline.MEMBER_ORDERS,
    'data.member_split': member_split.KINDS,
    'data.resident': resident.SETTINGS,
    'select.method': posthoc.SELECT_METHODS,
    'precision': checks.PRECISIONS,
    'distill.student': students.KINDS,
    'optim.name': tuple(optim.OPTIMIZERS),
    'optim.schedule': optim.SCHEDULES,
    'train.loss': tuple(tasks.LOSSES),
}


def _value(field, value):
  # A member split's form is its name before the first ':' ('kfold:2' is 'kfold').
  return value.split(':')[0] if field == 'data.member_split' and value else value


def test_every_value_of_a_closed_option_is_in_some_case():
  config = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  default = lambda field: _value(field, functools.reduce(getattr, field.split('.'), config))
  options = [*table.OPTIONS.values(), *table.VALUES]  # Every case holds the defaults too.
  missing = [(field, value) for field, values in CLOSED.items() for value in values
             if value != default(field)
             and not any(_value(field, o.overrides.get(field)) == value for o in options)]
  assert not missing, f'give these a case in tests/combinations_table.py VALUES: {missing}'


@pytest.mark.slow
@pytest.mark.parametrize('option', table.VALUES, ids=[o.key for o in table.VALUES])
def test_each_value_trains_resumes_loads_and_predicts(option, tmp_path, caplog):
  caplog.set_level(logging.INFO, logger='absl')
  _train_resume_load_predict(table.value_case(option), tmp_path / 'w', caplog)


_TASK_OPTIONS = [o for o in table.AXES['task'] if o.key in tasks.TASKS]


@pytest.mark.parametrize('loss', [o for o in table.VALUES if 'train.loss' in o.overrides],
                         ids=lambda o: o.key)
def test_a_loss_is_refused_with_the_tasks_whose_outputs_it_cannot_read(loss, tmp_path):
  """Each built-in loss trains with its task (test_each_value_trains...) and is refused,
  in one line naming both fields, with every other built-in task (it crashed in the
  step's trace: 'mse' with task='regression' met [B, 2] outputs)."""
  own_task = loss.requires or 'classification'
  for task in _TASK_OPTIONS:
    if task.key == own_task or (loss.key == 'cross_entropy' and 'classification' in task.key):
      continue
    case = (*table.with_defaults(task), loss)
    with pytest.raises(ConfigError) as refused:
      dist_ens.train(_config(case), str(tmp_path / 'w'), dataset=_dataset(case))
    message = str(refused.value)
    assert '\n' not in message and 'train.loss' in message and 'config.task' in message
    assert not (tmp_path / 'w').exists()


def test_committed_combinations_doc_is_current():
  spec = importlib.util.spec_from_file_location(
      'gen_combinations_doc', ROOT / 'tools' / 'gen_combinations_doc.py')
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  assert (ROOT / 'docs' / 'combinations.md').read_text() == tool.generate(), (
      'docs/combinations.md is stale: run python tools/gen_combinations_doc.py')
