"""Distillation (config.distill; dist_ens.ensembles.distill, evaluators/distill.py):
the objective against numpy, a run's 'distill' results and saved student against
recomputations from the student it saved, a rerun that distils a finished run into a
Hydra student, and the refusals. A training of the tests' shared tiny run, and a rerun of
the session's shared finished run (tests/runs.py)."""

import shutil

import jax
import numpy as np
import pytest

import dist_ens
import runs
import support
from dist_ens.config import specs
from dist_ens import data
from dist_ens.ensembles import distill, students
from dist_ens.errors import ConfigError
from dist_ens.io import student_file

STEPS = 16


def _config(**fields):
  return support.config(train__steps=STEPS, checkpoint__every=STEPS, eval__joint_tau=0,
                        **fields)


def _test_split(config):
  return data.load_dataset(config.data.name, specs.data_spec(config)).test


def _nll(probs, y):
  return float(-np.mean(np.log(np.asarray(probs, np.float64)[np.arange(len(y)), y])))


@pytest.fixture(scope='module')
def same(tmp_path_factory):
  """A run distilled into a 'same' student with enough steps to learn the ensemble."""
  workdir = tmp_path_factory.mktemp('same')
  config = _config(distill__student='same', distill__steps=400, distill__temperature=2.0,
                   distill__learning_rate=3e-3, eval__ood_dataset='mnist1d_noise')
  return workdir, dist_ens.train(config, str(workdir))


@pytest.fixture(scope='module')
def plain_then_hydra(tmp_path_factory, tiny_run):
  """A run without distillation (a copy of the session's shared finished run,
  tests/runs.py), then the same command with distill.student='hydra', which distils the
  finished run without training it again."""
  workdir = runs.copy(tiny_run, tmp_path_factory.mktemp('hydra'))
  plain = tiny_run[1]
  had_student = (workdir / student_file.FILE).exists()
  hydra = dist_ens.train(runs.tiny_config(distill__student='hydra', distill__steps=20),
                         str(workdir))
  return workdir, plain, had_student, hydra


def test_the_loss_is_t_squared_times_the_kl_to_the_tempered_ensemble():
  rng = np.random.default_rng(0)
  teacher, student, t = rng.normal(size=(3, 5, 4)) * 2, rng.normal(size=(1, 5, 4)), 2.5
  softmax = lambda a: np.exp(a - a.max(-1, keepdims=True)) / np.exp(
      a - a.max(-1, keepdims=True)).sum(-1, keepdims=True)
  p = softmax(teacher / t).mean(0)  # the members' mean tempered probabilities
  q = softmax(student[0] / t)
  want = t ** 2 * np.mean(np.sum(p * (np.log(p) - np.log(q)), -1))
  targets = distill.soft_targets(teacher.astype(np.float32), t, 1)
  got = distill.distill_loss(student.astype(np.float32), targets, t)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  # Hydra: head h against member h, averaged over heads.
  heads = rng.normal(size=(3, 5, 4))
  want = t ** 2 * np.mean(np.sum(softmax(teacher / t) * (
      np.log(softmax(teacher / t)) - np.log(softmax(heads / t))), -1))
  got = distill.distill_loss(heads.astype(np.float32),
                             distill.soft_targets(teacher.astype(np.float32), t, 3), t)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_a_distilled_run_reports_the_student_and_saves_it(same):
  workdir, out = same
  d = out['distill']
  assert d['student'] == 'same' and d['heads'] == 1 and d['members_distilled'] == 4
  for field in ('accuracy', 'nll', 'ece', 'nll_gain_kept', 'nll_member_mean', 'nll_ensemble'):
    assert np.isfinite(d[field]), field
  assert d['nll_member_mean'] == pytest.approx(np.mean(out['members']['nll']))
  assert d['nll_ensemble'] == out['ensemble']['nll']
  gain = (d['nll_member_mean'] - d['nll']) / (d['nll_member_mean'] - d['nll_ensemble'])
  assert d['nll_gain_kept'] == pytest.approx(gain)
  assert d['loss_last'] < d['loss_first']  # the student learned the soft targets
  assert 0 <= d['ood']['auroc_entropy'] <= 1 and 0 <= d['ood']['aupr_entropy'] <= 1
  ens = dist_ens.Ensemble.load(workdir)
  member_params = sum(np.size(leaf) for leaf in jax.tree.leaves(ens.member(0)))
  cost = d['cost']
  assert cost['student_params'] == member_params  # the members' architecture
  assert cost['ensemble_params'] == 4 * member_params
  assert cost['flops_ratio'] == pytest.approx(0.25, rel=1e-6)


def test_the_saved_students_nll_is_the_reported_one(same):
  workdir, out = same
  ens = dist_ens.Ensemble.load(workdir)
  test = _test_split(ens.config)
  pred = ens.student().predict(test.x, preprocessed=True)
  np.testing.assert_allclose(pred.probs.sum(-1), 1.0, rtol=1e-5)
  assert _nll(pred.probs, test.y) == pytest.approx(out['distill']['nll'], abs=1e-5)
  accuracy = float(np.mean(pred.probs.argmax(-1) == test.y))
  assert accuracy == pytest.approx(out['distill']['accuracy'], abs=1e-6)


def test_the_student_moves_from_its_init_towards_the_ensemble(same):
  """A property that could fail: trained on the ensemble's soft targets, the student's
  test NLL is nearer the ensemble's than that of the same student at its init."""
  workdir, out = same
  ens = dist_ens.Ensemble.load(workdir)
  test, student = _test_split(ens.config), ens.student()
  init = student.net.init(students.student_key(ens.config.seed), test.x[:1])
  untrained = np.exp(np.asarray(student.net.log_probs(*init, test.x)))
  ensemble_nll = out['ensemble']['nll']
  assert (abs(out['distill']['nll'] - ensemble_nll)
          < abs(_nll(untrained, test.y) - ensemble_nll))


def test_no_student_without_distill_and_a_rerun_distils_into_hydra(plain_then_hydra):
  workdir, plain, had_student, hydra = plain_then_hydra
  assert 'distill' not in plain and not had_student
  d = hydra['distill']
  assert d['student'] == 'hydra' and d['heads'] == 4
  assert hydra['ensemble']['nll'] == plain['ensemble']['nll']  # not trained again
  # Body: 40 -> 16; a head per member: 16 -> 10 (MNIST-1D's input and classes).
  body, head = 40 * 16 + 16, 16 * 10 + 10
  assert d['cost']['student_params'] == body + 4 * head
  assert d['cost']['ensemble_params'] == 4 * (body + head)
  assert 0 < d['cost']['flops_ratio'] < 1
  ens = dist_ens.Ensemble.load(workdir)
  test = _test_split(ens.config)
  pred = ens.student().predict(test.x, preprocessed=True)
  assert pred.head_probs.shape == (4, len(test.y), 10)
  np.testing.assert_allclose(pred.probs, pred.head_probs.mean(0), rtol=1e-5, atol=1e-7)
  assert _nll(pred.probs, test.y) == pytest.approx(d['nll'], abs=1e-5)


def test_a_student_given_by_import_path_is_trained_saved_and_loaded(plain_then_hydra, tmp_path):
  workdir = tmp_path / 'copy'
  shutil.copytree(plain_then_hydra[0], workdir)
  out = dist_ens.train(runs.tiny_config(distill__student='support:linear_student',
                                       distill__steps=20), str(workdir))
  d = out['distill']
  assert d['heads'] == 1 and d['cost']['student_params'] == 40 * 10 + 10
  ens = dist_ens.Ensemble.load(workdir)
  test = _test_split(ens.config)
  pred = ens.student().predict(test.x, preprocessed=True)
  assert _nll(pred.probs, test.y) == pytest.approx(d['nll'], abs=1e-5)


def test_loading_a_student_from_a_run_without_one_fails_in_one_line(plain_then_hydra):
  workdir = plain_then_hydra[0]
  (workdir / student_file.FILE).rename(workdir / 'moved.npz')
  try:
    with pytest.raises(FileNotFoundError, match='distill.student') as missing:
      dist_ens.Ensemble.load(workdir).student()
    assert '\n' not in str(missing.value)
  finally:
    (workdir / 'moved.npz').rename(workdir / student_file.FILE)


@pytest.mark.parametrize('fields, names', [
    ({'distill.student': 'teacher'}, 'distill.student'),
    ({'distill.student': 'same', 'distill.steps': 0}, 'distill.steps'),
    ({'distill.student': 'same', 'distill.temperature': 0.0}, 'distill.temperature'),
    ({'distill.student': 'hydra', 'model.name': 'cnn'}, 'distill.student'),
    ({'distill.student': 'same', 'task': 'regression'}, 'config.task'),
    ({'distill.student': 'same', 'ensemble.method': 'batchensemble'}, 'ensemble.method'),
    ({'distill.student': 'no_such_module:make'}, 'distill.student'),
])
def test_what_cannot_be_distilled_is_refused_in_one_line(fields, names, tmp_path):
  config = _config()
  config.update_from_flattened_dict(fields)
  if 'task' in fields:
    config.data.name = 'uci:energy'
  with pytest.raises(ConfigError, match=names.replace('.', r'\.')) as refused:
    dist_ens.train(config, str(tmp_path / 'w'))
  assert '\n' not in str(refused.value)
  assert not (tmp_path / 'w').exists()
