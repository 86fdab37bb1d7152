"""Choosing an ensemble from a pool of members (a sweep) by their validation predictions.

Greedy ensemble selection (Caruana et al. 2004, "Ensemble selection from libraries
of models"; the selection step of hyper-deep ensembles, Wenzel et al. 2020): start
from the empty ensemble and repeatedly add, WITH replacement, the member whose
addition gives the lowest validation NLL of the averaged probabilities; a member
picked twice counts twice in the average. After `size` picks, the ensemble kept is
the shortest prefix of the picks with the lowest validation NLL (Caruana's "return
the best of the nested ensembles"), so it is never worse on validation than the best
single member, which is always the first pick. Ties go to the lowest member index.

Without replacement (`replacement=False`, config.select.greedy_replacement) each member is
picked at most once: forward selection of distinct members, for a budget of K members at
prediction time (with replacement, K picks can be as few as 2 distinct members weighted
unevenly; docs/groups.md's recipe measured that). The picks stop when no candidate is
left; the best prefix is kept as above.

Beside it sits today's top-k (dist_ens.evaluators.top_k.SelectTopK): the k best
members by a validation metric, each counted once.

Only each member's likelihood of the true target matters to the NLL, so the search
runs on an [M, N] matrix in float64 on the host: O(size x M x N), milliseconds for
hundreds of members.
"""

from typing import NamedTuple

import numpy as np


class Selection(NamedTuple):
  """A greedy selection.

  Attributes:
    picks: the member chosen at each kept step, in order (repeats allowed unless the
      selection was without replacement).
    counts: [M] how many times each member was picked (its weight in the ensemble; 0
      or 1 without replacement).
    nll_by_size: validation NLL after each pick made (kept or not): `size` of them, or
      as many as there were candidates without replacement.
    nll: validation NLL of the kept ensemble (= min of nll_by_size).
  """
  picks: list[int]
  counts: np.ndarray
  nll_by_size: list[float]
  nll: float


def greedy_select(log_likelihood: np.ndarray, size: int,
                  candidates: np.ndarray | None = None, *,
                  replacement: bool = True) -> Selection:
  """Caruana's greedy selection by validation NLL (see the module doc), with replacement
  or, `replacement=False`, of distinct members.

  The ensemble's likelihood of an example is the mean of its members' (a mixture, for
  any task), so the search needs each member's log-likelihood of each example's target
  and nothing else: the task gives it (Task.log_likelihood).

  Example:
    >>> ll = np.log(np.array([[.9, .4], [.4, .8]]))  # [M=2, N=2]: p_m(y_n)
    >>> greedy_select(ll, size=3).picks
    [0, 1, 0]
    >>> greedy_select(ll, size=3, replacement=False).picks
    [0, 1]

  Args:
    log_likelihood: [M, N] each member's log-likelihood of each validation example.
    size: the number of picks to make (>= 1).
    candidates: [M] bool, members that may be picked (default all); members with
      non-finite predictions are never picked.
    replacement: whether a member may be picked again (Caruana's default); without,
      at most min(size, candidates) picks are made.

  Returns:
    The Selection.
  """
  if size < 1:
    raise ValueError(f'greedy_select(size={size}): size must be at least 1.')
  with np.errstate(over='ignore', invalid='ignore'):
    true_probs = np.exp(np.asarray(log_likelihood, np.float64))
  # Densities above 1 (regression) are fine; a member with a NaN or Inf never is.
  allowed = np.all(np.isfinite(true_probs), axis=1)
  if candidates is not None:
    allowed &= np.asarray(candidates, bool)
  if not allowed.any():
    raise ValueError('greedy_select(): no candidate member has finite predictions.')
  total, picks, path = np.zeros(true_probs.shape[1]), [], []
  for n in range(1, (size if replacement else min(size, int(allowed.sum()))) + 1):
    with np.errstate(divide='ignore', invalid='ignore'):
      nlls = -np.mean(np.log((total[None] + true_probs) / n), axis=1)
    nlls[~allowed] = np.inf
    best = int(np.argmin(nlls))  # The first minimum: ties go to the lowest index.
    picks.append(best)
    path.append(float(nlls[best]))
    total = total + true_probs[best]
    if not replacement:
      allowed[best] = False
  keep = int(np.argmin(path)) + 1  # The shortest best prefix.
  counts = np.bincount(picks[:keep], minlength=true_probs.shape[0])
  return Selection(picks[:keep], counts, path, path[keep - 1])
