"""Last-layer Laplace (config.eval.laplace; dist_ens.eval.laplace): the three forms of the
Gauss-Newton matrix against a float64 numpy recomputation from the definition, the
predictive's limits, and a run that fits every member in one program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support

import dist_ens
from dist_ens import data
from dist_ens.errors import ConfigError
from dist_ens.eval import laplace

F, C, N = 3, 4, 50


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  phi = rng.normal(size=(N, F))
  logits = rng.normal(size=(N, C)) * 2
  probs = np.exp(logits - logits.max(1, keepdims=True))
  return phi, probs / probs.sum(1, keepdims=True)


def _ggn_by_definition(phi, probs):
  """sum_n J_n^T Lambda_n J_n with J_n = d logits / d theta, theta = (W; b) row-major."""
  psi = np.concatenate([phi, np.ones((len(phi), 1))], 1)
  h = np.zeros(((F + 1) * C, (F + 1) * C))
  for p_n, psi_n in zip(probs, psi):
    jac = np.zeros((C, F + 1, C))  # logit c depends on theta[f, c] with weight psi_f
    for c in range(C):
      jac[c, :, c] = psi_n
    jac = jac.reshape(C, -1)
    h += jac.T @ (np.diag(p_n) - np.outer(p_n, p_n)) @ jac
  return psi, h


def _curvature(kind, phi, probs):
  psi = laplace.with_bias(jnp.asarray(phi, jnp.float32))
  return laplace.batch_curvature(kind, psi, jnp.asarray(probs, jnp.float32), jnp.ones(N))


def test_each_form_is_the_gauss_newton_matrix_or_its_stated_approximation():
  phi, probs = _problem()
  psi, h = _ggn_by_definition(phi, probs)
  full = _curvature('last_layer_full', phi, probs)
  np.testing.assert_allclose(full.h, h, rtol=1e-4, atol=1e-4)
  diag = _curvature('last_layer_diag', phi, probs)
  np.testing.assert_allclose(diag.h, np.diag(h), rtol=1e-4, atol=1e-4)
  kron = _curvature('last_layer_kron', phi, probs)
  lam = np.mean([np.diag(p) - np.outer(p, p) for p in probs], 0)
  np.testing.assert_allclose(np.asarray(kron.a), psi.T @ psi, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(kron.g) / float(kron.count), lam, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('kind', laplace.KINDS)
def test_logit_covariance_is_psi_sigma_psi(kind):
  """V(x) = (psi^T kron I) (H + delta I)^-1 (psi kron I), H the form's own matrix."""
  phi, probs = _problem(1)
  psi, h = _ggn_by_definition(phi, probs)
  if kind == 'last_layer_diag':
    h = np.diag(np.diag(h))
  elif kind == 'last_layer_kron':
    h = np.kron(psi.T @ psi, np.mean([np.diag(p) - np.outer(p, p) for p in probs], 0))
  delta = 0.7
  sigma = np.linalg.inv(h + delta * np.eye(len(h)))
  post = laplace.posterior(kind, _curvature(kind, phi, probs))
  got = laplace.logit_covariance(kind, post, jnp.asarray(psi[:5], jnp.float32), delta)
  for n in range(5):
    jac = np.kron(psi[n][:, None], np.eye(C))  # [P, C]
    np.testing.assert_allclose(got[n], jac.T @ sigma @ jac, rtol=2e-3, atol=1e-5)


def test_predictive_tends_to_the_plain_softmax_as_the_prior_tightens():
  phi, probs = _problem(2)
  post = laplace.posterior('last_layer_kron', _curvature('last_layer_kron', phi, probs))
  psi = laplace.with_bias(jnp.asarray(phi[:8], jnp.float32))
  logits = jnp.asarray(np.log(probs[:8]), jnp.float32)
  tight = laplace.predictive_log_probs(logits, laplace.logit_covariance(
      'last_layer_kron', post, psi, 1e6), 0, None)
  np.testing.assert_allclose(tight, jax.nn.log_softmax(logits), atol=1e-4)
  loose = laplace.predictive_log_probs(logits, laplace.logit_covariance(
      'last_layer_kron', post, psi, 1e-3), 0, None)
  entropy = lambda lp: -(np.exp(lp) * lp).sum(-1)
  assert (entropy(loose) > entropy(tight)).all()  # Uncertainty in the weights spreads p.
  sampled = laplace.predictive_log_probs(logits, laplace.logit_covariance(
      'last_layer_kron', post, psi, 1e6), 64, jax.random.key(0))
  np.testing.assert_allclose(sampled, tight, atol=1e-3)


def _toy(n, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 40, 1)).astype(np.float32)  # MNIST-1D's shape: its OOD noise fits
  return x, ((x[:, 0, 0] > 0).astype(np.int32) + (x[:, 1, 0] > 0)).astype(np.int32)


def _config(kind, validation=64):
  """support.config's run (4 members, batch 32) on DATASET with a `kind` fit, 30 steps
  logged and saved at the end. Kept: a (8,) MLP (test_laplace_predict checks the 9 x 9
  Kronecker factor; DATASET's 3 classes make these programs this file's own at any width),
  a 4 x 2 mesh (the fit with each member's batch split over 'data'; test_laplace_predict
  loads the runs there and checks it), and `validation` examples to choose the prior on."""
  return support.config({
      'model.widths': (8,), 'mesh.member': 4, 'mesh.data': 2,
      'data.validation_size': validation, 'train.steps': 30, 'train.log_every': 30,
      'checkpoint.every': 30, 'eval.laplace': kind, 'eval.joint_tau': 0})


DATASET = data.from_arrays(*_toy(256, 0), *_toy(128, 1), name='toy')


def test_a_run_fits_every_member_and_reports_the_mixture(tmp_path):
  out = dist_ens.train(_config('last_layer_kron'), str(tmp_path / 'kron'), dataset=DATASET)
  fit = out['laplace']
  assert fit['kind'] == 'last_layer_kron' and fit['predictive'] == 'probit'
  assert fit['prior_precision_by'] == 'validation nll' and len(fit['prior_precision']) == 4
  assert fit['train_examples'] == 256 - 64
  assert set(fit['prior_precision']) <= set(laplace.PRIOR_GRID)
  # The mixture of Laplaces is scored like any ensemble, beside the plain one.
  assert np.isfinite(fit['ensemble']['nll']) and 0 < fit['ensemble']['accuracy'] <= 1
  assert len(fit['members']['nll']) == 4
  config = _config('last_layer_diag', validation=0)
  config.eval.laplace_samples, config.eval.ood_dataset = 8, 'mnist1d_noise'
  out = dist_ens.train(config, str(tmp_path / 'diag'), dataset=DATASET)
  assert out['laplace']['prior_precision_by'] == 'marginal likelihood'
  assert out['laplace']['predictive'] == 'mc:8' and out['laplace']['train_examples'] == 256
  assert 0 <= out['laplace']['ood']['ensemble']['auroc_entropy'] <= 1


def test_with_member_blocks_each_member_counts_only_its_blocks_rows(tmp_path):
  """data.member_split='blocks:2' (two data sets as one run): each member's curvature
  sums its own block's 128 rows: block 1 mirrored (inputs and labels) moves only the
  fits of block 1's members (a curvature over all rows would move every member's)."""
  config = _config('last_layer_kron', validation=0)
  config.data.member_split = 'blocks:2'
  out = dist_ens.train(config, str(tmp_path / 'a'), dataset=DATASET)
  assert out['laplace']['train_examples'] == 128 and 'member_split' not in out
  x, y = _toy(256, 0)
  flipped = data.from_arrays(np.concatenate([x[:128], -x[128:]]),
                             np.concatenate([y[:128], 2 - y[128:]]), *_toy(128, 1), name='toy')
  dist_ens.train(config, str(tmp_path / 'b'), dataset=flipped)
  a, b = (dict(np.load(tmp_path / run / 'laplace.npz')) for run in 'ab')
  same = [k for k in a if a[k].ndim and a[k].shape[0] == 4
          and np.array_equal(a[k][:2], b[k][:2])]
  differ = [k for k in a if a[k].ndim and a[k].shape[0] == 4
            and not np.allclose(a[k][2:], b[k][2:])]
  assert same and differ


@pytest.mark.parametrize('field, value, names', [
    ('eval.laplace', 'full', 'eval.laplace'),
    ('eval.laplace_samples', -1, 'eval.laplace_samples'),
    ('task', 'regression', 'config.task'),
    ('ensemble.method', 'batchensemble', 'ensemble.method'),
])
def test_what_it_cannot_fit_is_refused_in_one_line(field, value, names, tmp_path):
  config = _config('last_layer_full')
  config.update_from_flattened_dict({field: value})
  dataset = DATASET
  if value == 'regression':
    dataset = data.from_arrays(DATASET.train.x, DATASET.train.y.astype(np.float32),
                               DATASET.test.x, DATASET.test.y.astype(np.float32), name='toy')
  with pytest.raises(ConfigError, match=names.replace('.', r'\.')) as refused:
    dist_ens.train(config, str(tmp_path / 'w'), dataset=dataset)
  assert '\n' not in str(refused.value)
  assert not (tmp_path / 'w').exists()
