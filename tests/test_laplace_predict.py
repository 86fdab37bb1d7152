"""A run's Laplace posteriors through Ensemble.load / predict (config.eval.laplace): the
Laplace probabilities predict gives reproduce final_metrics.json's 'laplace' section
(recomputed in float64 numpy), the weight draws its joint log-loss, on a 4 x 2 mesh of 8
fake devices and on another mesh, and from a run of two processes; what cannot be
predicted is refused in one line (a regression run's refusal: test_regression_run's
test_a_regression_ensemble_loads_and_predicts_in_target_units, on its own regression run)."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support
import test_laplace
from runs import copy

import dist_ens
from dist_ens.config import specs
from dist_ens import data
from dist_ens.eval import joint, laplace, laplace_predictive
from dist_ens.evaluators import laplace_file

ROOT = Path(__file__).resolve().parents[1]


# test_laplace's data set: its runs' programs have these shapes too (the compilation cache).
DATASET = test_laplace.DATASET


def _config(kind, samples=0, validation=64):
  """test_laplace's run, with `samples` weight draws and the joint log-loss on."""
  config = test_laplace._config(kind, validation)  # pylint: disable=protected-access
  return support.override(config, {'eval.laplace_samples': samples, 'eval.joint_tau': 4,
                                   'eval.joint_batches': 50})


def _scores(member_probs, y):
  """float64 NLL and accuracy of each member and of their mean, from probabilities."""
  p = np.asarray(member_probs, np.float64)
  rows = np.arange(len(y))
  mixture = p.mean(0)
  return {'members': {'nll': -np.log(p[:, rows, y]).mean(1),
                      'accuracy': (p.argmax(-1) == y).mean(1)},
          'ensemble': {'nll': -np.log(mixture[rows, y]).mean(),
                       'accuracy': (mixture.argmax(-1) == y).mean()}}


def _assert_reported(fit, member_probs, probs, y):
  got = _scores(member_probs, y)
  np.testing.assert_allclose(np.asarray(probs, np.float64),
                             np.asarray(member_probs, np.float64).mean(0), atol=1e-6)
  for who in ('members', 'ensemble'):
    for metric in ('nll', 'accuracy'):
      np.testing.assert_allclose(got[who][metric], fit[who][metric], rtol=1e-5, atol=1e-6,
                                 err_msg=f'{who} {metric}')


def _posterior(kind, psi, probs):
  """laplace.posterior of one batch's curvature (every example counted), jitted."""
  return jax.jit(lambda x, p: laplace.posterior(
      kind, laplace.batch_curvature(kind, x, p, jnp.ones(len(x)))))(psi, probs)


@functools.cache
def _fit(kind):
  """(features psi [40, F1] with a bias column, softmax probs [40, C], the posterior of
  `kind` on them), F1 = 4, C = 3: one fit per form serves both tests below."""
  rng = np.random.default_rng(3)
  f1, c, n = 4, 3, 40
  psi = jnp.asarray(np.concatenate([rng.normal(size=(n, f1 - 1)), np.ones((n, 1))], 1),
                    jnp.float32)
  logits = rng.normal(size=(n, c))
  probs = jnp.asarray(np.exp(logits) / np.exp(logits).sum(1, keepdims=True), jnp.float32)
  return psi, probs, _posterior(kind, psi, probs)


@pytest.mark.parametrize('kind', laplace.KINDS)
def test_weight_draws_have_the_posterior_covariance(kind):
  """psi @ (theta - theta*) over many draws has the logit covariance V = psi^T Sigma psi
  (checked against Sigma inverted directly in tests/test_laplace.py)."""
  psi, _, post = _fit(kind)
  f1, c = psi.shape[1], 3
  eps = jax.random.normal(jax.random.key(0), (40_000, f1, c))
  # Jitted, as in a run (eagerly, each op compiles a program of its own).
  noise = np.asarray(jax.jit(lambda p, e: laplace.weight_noise(kind, p, 0.5, e))(post, eps),
                     np.float64)
  logit_noise = np.einsum('bf,sfc->sbc', np.asarray(psi[:3], np.float64), noise)  # [S, 3, C]
  empirical = np.einsum('sbc,sbd->bcd', logit_noise, logit_noise) / len(noise)
  expected = np.asarray(jax.jit(lambda p, x: laplace.logit_covariance(kind, p, x, 0.5))(
      post, psi[:3]))
  np.testing.assert_allclose(empirical, expected, atol=0.03 * np.abs(expected).max())


@pytest.mark.parametrize('kind', laplace.KINDS)
def test_no_weight_draws_is_an_empty_stack_for_every_form(kind):
  """eval.laplace_samples=0 (the default, the probit predictive) draws nothing: every form
  gives [0, F1, C] (diag and full once crashed after training on a reshape of no draws)."""
  psi, probs, post = _fit(kind)
  f1, c = psi.shape[1], probs.shape[1]
  noise = jax.jit(lambda p, key: laplace_predictive._member_noise(  # pylint: disable=protected-access
      kind, 0, c, p, jnp.float32(0.5), key))(post, jax.random.key(0))
  assert noise.shape == (0, f1, c)


# (workdir, final metrics) of each fit. One run is trained, without a validation split
# (diag, 8 weight draws; the prior chosen by the marginal likelihood); the probit kron fit
# and the full fit with 4 draws are refits of copies of it: rerunning a finished run's
# command with another eval.laplace steps nowhere and fits again (dist_ens/training/loop.py,
# Session.writes_final_events), so each form is fitted and reported as at the end of a run
# without training three times. One fixture each: a test pays only for the fits it reads.
@pytest.fixture(scope='module')
def diag_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('laplace_predict') / 'diag'
  config = _config('last_layer_diag', samples=8, validation=0)
  return workdir, dist_ens.train(config, str(workdir), dataset=DATASET)


def _refit(diag_run, tmp_path_factory, name, config):
  workdir = copy(diag_run, tmp_path_factory.mktemp('laplace_predict') / name)
  final = dist_ens.train(config, str(workdir), dataset=DATASET)
  # A refit, not a second training: the same members, scored as the run scored them.
  assert final['step'] == diag_run[1]['step'] and final['ensemble'] == diag_run[1]['ensemble']
  assert final['laplace']['kind'] == config.eval.laplace
  return workdir, final


@pytest.fixture(scope='module')
def kron_run(diag_run, tmp_path_factory):
  return _refit(diag_run, tmp_path_factory, 'kron', _config('last_layer_kron', validation=0))


@pytest.fixture(scope='module')
def full_run(diag_run, tmp_path_factory):
  return _refit(diag_run, tmp_path_factory, 'full',
                _config('last_layer_full', samples=4, validation=0))


@pytest.mark.parametrize('name', ['kron', 'diag', 'full'])
def test_predict_with_laplace_gives_the_reported_test_metrics(request, name):
  workdir, final = request.getfixturevalue(f'{name}_run')
  assert (workdir / laplace_file.FILE).is_file()
  ens = dist_ens.Ensemble.load(workdir)
  assert ens.mesh.shape['member'] == 4 and ens.mesh.shape['data'] == 2
  out = ens.predict(DATASET.test.x, preprocessed=True, laplace=True)
  _assert_reported(final['laplace'], out.member_probs, out.probs, DATASET.test.y)
  # The default prediction is the plain one, as before: it gives the plain metrics.
  plain = ens.predict(DATASET.test.x, preprocessed=True)
  _assert_reported(final, plain.member_probs, plain.probs, DATASET.test.y)
  assert not np.allclose(plain.member_probs, out.member_probs, atol=1e-4)


def test_another_mesh_and_batch_size_predict_the_same(diag_run):
  workdir, final = diag_run
  ens = dist_ens.Ensemble.load(workdir, mesh={'member': 2, 'data': 4})
  out = ens.predict(DATASET.test.x, batch_size=24, preprocessed=True, laplace=True)
  _assert_reported(final['laplace'], out.member_probs, out.probs, DATASET.test.y)


def test_the_weight_draws_give_the_reported_joint_log_loss(diag_run):
  workdir, final = diag_run
  ens = dist_ens.Ensemble.load(workdir)
  draws = np.asarray(ens.laplace_samples(DATASET.test.x, preprocessed=True), np.float64)
  m, s, n, _ = draws.shape
  assert (m, s, n) == (4, 8, len(DATASET.test.y))
  mean = ens.predict(DATASET.test.x, preprocessed=True, laplace=True).member_probs
  np.testing.assert_allclose(draws.mean(1), mean, atol=1e-6)
  reported = final['laplace']['joint']
  assert (reported['tau'], reported['batches'], reported['samples']) == (4, 50, 8)
  batches = joint.dyadic_batches(n, 4, 50, seed=ens.config.seed)
  # Draw s of member m is one function: its likelihood of a batch is a product over the
  # batch's positions; member m's, the mean over its draws; the ensemble's, over all.
  ll = np.log(draws[:, :, np.arange(n), DATASET.test.y])[:, :, batches].sum(-1)  # [M, S, B]
  mixture = lambda a, axis: -(np.log(np.mean(np.exp(a), axis=axis))).mean(-1)
  np.testing.assert_allclose(mixture(ll, 1), reported['members'], rtol=1e-5)
  np.testing.assert_allclose(mixture(ll.reshape(m * s, -1), 0), reported['ensemble'],
                             rtol=1e-5)


def test_the_file_holds_one_posterior_per_member(kron_run):
  workdir, final = kron_run
  saved = np.load(workdir / laplace_file.FILE)
  assert str(saved['kind']) == 'last_layer_kron' and int(saved['samples']) == 0
  np.testing.assert_allclose(saved['prior_precision'], final['laplace']['prior_precision'],
                             rtol=1e-6)
  assert saved['q_a'].shape == (4, 9, 9) and saved['q_g'].shape == (4, 3, 3)
  assert int(saved['step']) == 30


def _refused(ens, match, call):
  with pytest.raises(ValueError, match=match) as refused:
    call(ens)
  assert '\n' not in str(refused.value)


def test_a_run_without_laplace_is_refused_in_one_line(tiny_run):
  """The session's shared run of support.config (tests/runs.py: no eval.laplace; only
  loaded here) is refused for predict(laplace=True) and predicts its own way."""
  ens = dist_ens.Ensemble.load(tiny_run[0])
  assert not ens.config.eval.laplace
  test_x = data.load_dataset('mnist1d').test.x
  _refused(ens, r"eval\.laplace='last_layer_kron'",
           lambda e: e.predict(test_x, preprocessed=True, laplace=True))
  assert ens.predict(test_x[:3], preprocessed=True).probs.shape == (3, 10)


def test_draws_of_a_probit_fit_are_refused_in_one_line(kron_run):
  ens = dist_ens.Ensemble.load(kron_run[0])
  _refused(ens, r'eval\.laplace_samples=k > 0',
           lambda e: e.laplace_samples(DATASET.test.x, preprocessed=True))


@pytest.mark.slow
def test_a_two_process_run_writes_the_fit_once_and_it_loads_in_one(tmp_path):
  """Two processes of 4 devices (launch/local.sh) fit on one 4 x 2 mesh; process 0 writes
  laplace.npz; this process (8 devices) loads it and predicts the reported metrics. The
  processes compile as the tests do (support.FAST_COMPILE, as test_many_processes' do; at
  XLA's default level the test took twice the CPU seconds, 52 against 26), local.sh adding
  their device count."""
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'JAX_PLATFORMS')}
  env.update(PYTHONPATH=str(ROOT), PYTHON=sys.executable, XLA_FLAGS=' '.join(support.FAST_COMPILE))
  flags = ['--config.train.steps=20', '--config.train.eval_every=0', '--config.num_members=4',
           '--config.data.batch_size=64', '--config.mesh.member=4', '--config.mesh.data=2',
           '--config.eval.laplace=last_layer_kron', '--config.eval.laplace_samples=4']
  done = subprocess.run(
      ['bash', str(ROOT / 'launch' / 'local.sh'), '--processes', '2', '--devices-per-process',
       '4', '--timeout', '240', '--', f'--config={ROOT / "configs" / "default.py"}',
       f'--workdir={tmp_path / "w"}', *flags],
      env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
  reported = json.loads((tmp_path / 'w' / 'final_metrics.json').read_text())['laplace']
  ens = dist_ens.Ensemble.load(tmp_path / 'w')
  test = data.load_dataset(ens.config.data.name, specs.data_spec(ens.config)).test
  out = ens.predict(test.x, preprocessed=True, laplace=True)
  _assert_reported(reported, out.member_probs, out.probs, np.asarray(test.y))
