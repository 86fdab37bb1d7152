"""Last-layer Laplace approximations of a classifier's members (config.eval.laplace).

A member's output layer, logits = phi(x) W + b, gets a Gaussian posterior around its
trained weights theta* = (W, b) (Daxberger et al. 2021, "Laplace Redux"); one per member
of a deep ensemble is a mixture of Laplaces (Eschenhagen et al. 2021). With
psi = (phi, 1) the features and a 1 for the bias, and theta the [F+1, C] matrix (W; b)
flattened row-major ((f, c) pairs, P = (F + 1) C entries):

  precision   H + delta I, H the generalised Gauss-Newton matrix of the training loss,
              sum_n (psi_n psi_n^T) kron Lambda_n with Lambda_n = diag(p_n) - p_n p_n^T,
              the softmax cross-entropy's Hessian in the logits, and delta the prior
              precision. Forms of H:
                'last_layer_full'  H itself, [P, P];
                'last_layer_kron'  A kron G with A = sum_n psi_n psi_n^T and G the mean
                                   Lambda_n (K-FAC; eigenvalues a_i g_j);
                'last_layer_diag'  diag(H).
  predictive  the logits of x are N(mu, V) with mu the trained member's logits and
              V = (psi^T kron I) (H + delta I)^-1 (psi kron I) [C, C]; probabilities by
              the probit approximation, softmax(mu / sqrt(1 + pi/8 diag V)), or the mean
              softmax over `samples` draws of the last layer's weights, theta* + Sigma^1/2 e
              with e ~ N(0, I) (weight_noise): each draw is one function, the same for
              every input, so the draws also give joint predictions (dist_ens.eval.joint),
              and each input's logits under them are N(mu, V) as above.
  delta       from PRIOR_GRID per member: the one of greatest validation log-likelihood
              where there is a validation split, else of greatest log marginal
              likelihood of the last layer, -delta/2 |theta*|^2 + P/2 log delta
              - 1/2 sum_k log(lambda_k + delta) (the terms that depend on delta).

Everything here is one member's and pure jnp (float32): the action vmaps it over the
member axis, so a mesh's members are fitted in one program.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ('last_layer_diag', 'last_layer_kron', 'last_layer_full')
PRIOR_GRID = tuple(float(d) for d in np.logspace(-4, 4, 33))


class Curvature(NamedTuple):
  """Sums over training examples of one member's GGN, in the form its kind keeps:
  full: h [P, P]; kron: a [F1, F1], g [C, C] (a sum: divide by count); diag: h [P]."""
  h: Any
  a: Any
  g: Any
  count: Any


class Posterior(NamedTuple):
  """(H + delta I)'s eigenbasis without delta: full q [P, P], lam [P]; kron q_a [F1, F1],
  lam_a [F1], q_g [C, C], lam_g [C]; diag lam [P]. Unused fields are empty arrays."""
  q: Any
  lam: Any
  q_a: Any
  lam_a: Any
  q_g: Any
  lam_g: Any


def with_bias(features: jax.Array) -> jax.Array:
  """psi: [B, F] features with a column of ones appended (the bias's input)."""
  return jnp.concatenate([features, jnp.ones((*features.shape[:-1], 1), features.dtype)], -1)


def _ggn_factor(probs: jax.Array) -> jax.Array:
  """L [B, C, C] with L L^T = diag(p) - p p^T: diag(sqrt p) - p sqrt(p)^T."""
  root = jnp.sqrt(probs)
  return jax.vmap(jnp.diag)(root) - probs[:, :, None] * root[:, None, :]


def batch_curvature(kind: str, psi: jax.Array, probs: jax.Array, mask: jax.Array
                    ) -> Curvature:
  """One batch's sums (psi [B, F1], probs [B, C], mask [B] for padding rows)."""
  psi = psi * mask[:, None]
  c = probs.shape[-1]
  if kind == 'last_layer_kron':
    lam = jax.vmap(jnp.diag)(probs) - probs[:, :, None] * probs[:, None, :]
    return Curvature(jnp.zeros(()), psi.T @ psi, jnp.einsum('b,bcd->cd', mask, lam),
                     mask.sum())
  if kind == 'last_layer_diag':
    lam_diag = probs - probs ** 2  # Lambda's diagonal
    h = jnp.einsum('bf,bc->fc', psi ** 2, lam_diag).reshape(-1)
    return Curvature(h, jnp.zeros(()), jnp.zeros(()), mask.sum())
  # Full: H = sum_n J_n J_n^T with J_n = psi_n kron L_n [P, C].
  j = (psi[:, :, None, None] * _ggn_factor(probs)[:, None]).reshape(psi.shape[0], -1, c)
  return Curvature(jnp.einsum('bpc,bqc->pq', j, j), jnp.zeros(()), jnp.zeros(()),
                   mask.sum())


def posterior(kind: str, curvature: Curvature) -> Posterior:
  """The eigenbasis of one member's GGN."""
  empty = jnp.zeros((0,))
  if kind == 'last_layer_kron':
    lam_a, q_a = jnp.linalg.eigh(curvature.a)
    lam_g, q_g = jnp.linalg.eigh(curvature.g / jnp.maximum(curvature.count, 1))
    return Posterior(empty, empty, q_a, jnp.maximum(lam_a, 0), q_g, jnp.maximum(lam_g, 0))
  if kind == 'last_layer_diag':
    return Posterior(empty, jnp.maximum(curvature.h, 0), empty, empty, empty, empty)
  lam, q = jnp.linalg.eigh(curvature.h)
  return Posterior(q, jnp.maximum(lam, 0), empty, empty, empty, empty)


def eigenvalues(kind: str, post: Posterior) -> jax.Array:
  """H's eigenvalues [P] (kron: every a_i g_j)."""
  if kind == 'last_layer_kron':
    return jnp.outer(post.lam_a, post.lam_g).reshape(-1)
  return post.lam


def logit_covariance(kind: str, post: Posterior, psi: jax.Array, delta: jax.Array
                     ) -> jax.Array:
  """V [B, C, C]: the covariance of the logits of inputs with features psi [B, F1]."""
  if kind == 'last_layer_kron':
    u2 = (psi @ post.q_a) ** 2  # [B, F1]
    d = u2 @ (1.0 / (post.lam_a[:, None] * post.lam_g[None, :] + delta))  # [B, C]
    return jnp.einsum('cj,bj,dj->bcd', post.q_g, d, post.q_g)
  if kind == 'last_layer_diag':
    f1 = psi.shape[-1]
    inv = (1.0 / (post.lam + delta)).reshape(f1, -1)  # [F1, C]
    return jax.vmap(jnp.diag)((psi ** 2) @ inv)
  f1 = psi.shape[-1]
  q = post.q.reshape(f1, -1, post.q.shape[-1])  # [F1, C, P]
  r = jnp.einsum('bf,fcp->bcp', psi, q)
  return jnp.einsum('bcp,p,bdp->bcd', r, 1.0 / (post.lam + delta), r)


def predictive_log_probs(logits: jax.Array, cov: jax.Array, samples: int,
                         key: jax.Array | None) -> jax.Array:
  """log p(y | x) [B, C] of logits N(logits, cov): probit (samples=0) or MC over draws
  of each input's logits on their own (the run's MC predictive draws weights instead:
  weight_noise, sampled_log_probs)."""
  if not samples:
    var = jnp.diagonal(cov, axis1=-2, axis2=-1)
    return jax.nn.log_softmax(logits / jnp.sqrt(1.0 + jnp.pi / 8.0 * var), axis=-1)
  w, u = jnp.linalg.eigh(cov)
  root = u * jnp.sqrt(jnp.maximum(w, 0))[:, None, :]  # [B, C, C]: root root^T = cov
  eps = jax.random.normal(key, (samples, *logits.shape))
  draws = logits + jnp.einsum('bcd,sbd->sbc', root, eps)
  return jax.nn.logsumexp(jax.nn.log_softmax(draws, -1), axis=0) - jnp.log(samples)


def log_marginal_likelihood(kind: str, post: Posterior, theta_norm2: jax.Array,
                            deltas: jax.Array) -> jax.Array:
  """[D] the delta-dependent terms of the last layer's log evidence, per prior precision."""
  lam = eigenvalues(kind, post)
  p = lam.shape[0]
  return jax.vmap(lambda d: -0.5 * d * theta_norm2 + 0.5 * p * jnp.log(d)
                  - 0.5 * jnp.log(lam + d).sum())(deltas)


def weight_noise(kind: str, post: Posterior, delta: jax.Array, eps: jax.Array) -> jax.Array:
  """[S, F1, C] draws of theta - theta* ~ N(0, (H + delta I)^-1) from eps [S, F1, C] of
  N(0, I), in the form's own eigenbasis (kron: Q_a (e / sqrt(a_i g_j + delta)) Q_g^T)."""
  if kind == 'last_layer_kron':
    scale = jax.lax.rsqrt(jnp.outer(post.lam_a, post.lam_g) + delta)  # [F1, C]
    return jnp.einsum('fi,sij,cj->sfc', post.q_a, eps * scale, post.q_g)
  # The size of P spelled out: with no draws (S = 0) a -1 has nothing to divide.
  flat = eps.reshape(eps.shape[0], post.lam.shape[0]) * jax.lax.rsqrt(post.lam + delta)
  if kind == 'last_layer_diag':
    return flat.reshape(eps.shape)
  return (flat @ post.q.T).reshape(eps.shape)


def sampled_log_probs(logits: jax.Array, psi: jax.Array, noise: jax.Array) -> jax.Array:
  """[S, B, C] log-probabilities of each weight draw (noise [S, F1, C], weight_noise)."""
  return jax.nn.log_softmax(logits + jnp.einsum('bf,sfc->sbc', psi, noise), -1)
