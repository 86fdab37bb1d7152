"""Joint predictions: the dyadic joint log-loss of members and their ensemble.

A marginal metric (NLL, accuracy) scores each example alone, so it cannot tell an
ensemble whose members disagree in a consistent way (epistemic uncertainty: each member
is one plausible function) from one whose members are each as unsure as their mean. The
joint log-loss of Osband et al., "The Neural Testbed" (2022), can: it scores the
likelihood of tau labels at once, and an ensemble's joint likelihood is the mean over
members of the PRODUCT of their likelihoods, not the product of the means.

Dyadic sampling (the Testbed's): each joint batch draws kappa = 2 distinct anchor
examples, then fills its tau positions with anchors picked uniformly with replacement.
With only two inputs per batch, a good joint prediction must know how its beliefs about
the same input, seen several times, move together.

On a real data set the label of a position is the example's own label (a data set has
one label per example), so positions that repeat an anchor repeat its label. On a
synthetic problem with a known p*(y | x) (the Testbed; benchmarks/testbed.py) each
position draws its own label, and `joint_nll` takes those per-position
log-likelihoods directly.

The loss of a batch is -log p(y_1..y_tau | x_1..x_tau), in nats per batch, NOT divided
by tau (as the Testbed reports it); its mean over batches is reported. At tau = 1 it is
a sampled estimate of the marginal NLL. It needs only each member's per-example
log-likelihood (Task.log_likelihood), so it serves any task that gives one: a
classifier's log-probability of the label, a regressor's Gaussian log-density.

Example:
  ll = task.log_likelihood(outputs, test.y)                       # [M, N] float64
  batches = dyadic_batches(len(test.y), tau=10, num_batches=1000, seed=0)   # [1000, 10]
  loss = joint_log_loss(ll, batches)
  loss.members, loss.ensemble                                     # [M], a float
"""

from typing import NamedTuple

import numpy as np

# Anchor inputs per joint batch: the Testbed's dyadic sampling.
KAPPA = 2
# Stream tag of the dyadic batches' draws, apart from every other use of the seed.
_STREAM = 0x4A4F494E  # 'JOIN'


class JointLoss(NamedTuple):
  """Mean over joint batches of the negative joint log-likelihood (nats per batch)."""
  members: np.ndarray  # [M] float64: each member alone
  ensemble: float  # the included members' mixture: -log mean_m prod_t p_m(y_t | x_t)


def dyadic_batches(num_examples: int, tau: int, num_batches: int, seed: int,
                   kappa: int = KAPPA) -> np.ndarray:
  """[num_batches, tau] int64 example indices of the dyadic joint batches.

  Each batch draws `kappa` distinct anchors from range(num_examples) (with replacement
  only when there are fewer examples than kappa), and each of its tau positions one of
  the anchors uniformly. Depends only on the arguments: not on the mesh, M or the model.

  Example:
    dyadic_batches(1000, tau=10, num_batches=2, seed=0)   # two rows of 10 indices,
                                                          # at most 2 distinct per row
  """
  if num_examples < 1 or tau < 1 or num_batches < 1 or kappa < 1:
    raise ValueError(f'dyadic_batches needs num_examples, tau, num_batches and kappa >= 1; '
                     f'got {num_examples}, {tau}, {num_batches}, {kappa}.')
  rng = np.random.default_rng(np.random.SeedSequence([seed, _STREAM]))
  replace = num_examples < kappa
  anchors = np.stack([rng.choice(num_examples, kappa, replace=replace)
                      for _ in range(num_batches)])  # [B, kappa]
  positions = rng.integers(kappa, size=(num_batches, tau))
  return np.take_along_axis(anchors, positions, axis=1).astype(np.int64)


def joint_nll(log_likelihood: np.ndarray, included: np.ndarray | None = None) -> JointLoss:
  """The joint log-loss from per-position log-likelihoods.

  Args:
    log_likelihood: [M, B, tau] member m's log p_m(y_t | x_t) of position t of batch b
      (each position may carry its own label).
    included: [M] bool, the members in the ensemble (default: all).

  Returns:
    JointLoss: each member's mean over batches of -sum_t log p_m, and the ensemble's of
    -log (1/M') sum_m exp(sum_t log p_m) over the M' included members, in float64.
  """
  ll = np.asarray(log_likelihood, np.float64)
  if ll.ndim != 3:
    raise ValueError(f'joint_nll wants log-likelihoods [M, B, tau]; got shape {ll.shape}.')
  included = np.ones(ll.shape[0], bool) if included is None else np.asarray(included, bool)
  if not included.any():
    raise ValueError('joint_nll: no member is included in the ensemble.')
  member_joint = ll.sum(axis=-1)  # [M, B]
  kept = member_joint[included]
  ensemble = np.logaddexp.reduce(kept, axis=0) - np.log(len(kept))  # [B]
  return JointLoss(members=-member_joint.mean(axis=1), ensemble=float(-ensemble.mean()))


def joint_log_loss(log_likelihood: np.ndarray, batches: np.ndarray,
                   included: np.ndarray | None = None) -> JointLoss:
  """The joint log-loss of a data set's examples, each position labelled by its example.

  Args:
    log_likelihood: [M, N] member m's log-likelihood of example n's own target
      (Task.log_likelihood).
    batches: [B, tau] example indices (dyadic_batches).
    included: [M] bool, the members in the ensemble (default: all).
  """
  ll = np.asarray(log_likelihood, np.float64)
  return joint_nll(ll[:, np.asarray(batches)], included)
