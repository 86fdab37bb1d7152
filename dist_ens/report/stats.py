"""What a report computes from predictions: reliability bins and accuracy/NLL against
ensemble size (plain numpy, no plotting)."""

import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from dist_ens.eval.metrics import NUM_ECE_BINS


class Reliability(NamedTuple):
  """Equal-width confidence bins of one predictor (empty bins have count 0)."""
  accuracy: np.ndarray  # [NUM_ECE_BINS] fraction correct per bin (0 where empty)
  confidence: np.ndarray  # [NUM_ECE_BINS] mean confidence per bin (0 where empty)
  count: np.ndarray  # [NUM_ECE_BINS]
  ece: float


def reliability(probs: np.ndarray, labels: np.ndarray,
                num_bins: int = NUM_ECE_BINS) -> Reliability:
  """Binned accuracy and confidence, with bins and ECE as in dist_ens.eval.metrics.

  Predictions with a non-finite probability (a diverged member) fall in no bin and
  make the ECE NaN.

  Example:
    >>> r = reliability(np.array([[0.9, 0.1], [0.2, 0.8]]), np.array([0, 0]), num_bins=2)
    >>> r.count.tolist(), r.accuracy.tolist(), round(r.ece, 3)
    ([0, 2], [0.0, 0.5], 0.35)

  Args:
    probs: [N, C] predicted probabilities.
    labels: [N] integer labels.
    num_bins: equal-width bins over [0, 1].

  Returns:
    Reliability of the N predictions.
  """
  probs = np.asarray(probs, np.float64)
  labels = np.asarray(labels)
  finite = np.isfinite(probs).all(-1)
  confidence = np.where(finite, probs.max(-1, initial=0.0, where=np.isfinite(probs)), 0.0)
  correct = (probs.argmax(-1) == labels).astype(np.float64)
  index = np.clip(np.floor(confidence * num_bins).astype(int), 0, num_bins - 1)[finite]
  count = np.bincount(index, minlength=num_bins)
  conf_sum = np.bincount(index, confidence[finite], minlength=num_bins)
  correct_sum = np.bincount(index, correct[finite], minlength=num_bins)
  safe = np.maximum(count, 1)
  ece = float(np.abs(correct_sum - conf_sum).sum() / len(labels)) if finite.all() else np.nan
  return Reliability(correct_sum / safe, conf_sum / safe, count, ece)


def _accuracy_nll(probs: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
  """Accuracy and mean NLL of [N, C] probabilities (NaN where they are not finite)."""
  if not np.isfinite(probs).all():
    return np.nan, np.nan
  picked = probs[np.arange(len(labels)), labels]
  return (float(np.mean(probs.argmax(-1) == labels)),
          float(-np.mean(np.log(np.maximum(picked, 1e-300)))))


class SizeSpread(NamedTuple):
  """Accuracy and NLL of ensembles of k members, over several member subsets per size.

  Row i describes size[i]; its first num_subsets[i] columns hold one subset each and
  the rest are NaN (fewer distinct subsets exist, e.g. one of all members).
  """
  size: np.ndarray  # [K] ensemble sizes, increasing
  num_subsets: np.ndarray  # [K] subsets evaluated per size
  accuracy: np.ndarray  # [K, S] test accuracy per size and subset
  nll: np.ndarray  # [K, S] test NLL per size and subset

  def stat(self, key: str, name: str) -> np.ndarray:
    """[K] 'mean', 'min', 'max', 'q25' or 'q75' of `key` ('accuracy' or 'nll') per size."""
    values = {'accuracy': self.accuracy, 'nll': self.nll}.get(key)
    if values is None:
      raise ValueError(f"key={key!r}: use 'accuracy' or 'nll'")
    return subset_stat(values, name)


def subset_stat(values: np.ndarray, name: str) -> np.ndarray:
  """[K] 'mean', 'min', 'max', 'q25' or 'q75' over the subsets (axis 1, NaN = no subset)
  of a [K, S] table of one metric per ensemble size and subset."""
  reducers = {'mean': np.nanmean, 'min': np.nanmin, 'max': np.nanmax,
              'q25': lambda v, axis: np.nanpercentile(v, 25, axis=axis),
              'q75': lambda v, axis: np.nanpercentile(v, 75, axis=axis)}
  if name not in reducers:
    raise ValueError(f'name={name!r}: use one of {sorted(reducers)}')
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', RuntimeWarning)  # A size whose subsets are all NaN.
    return reducers[name](values, axis=1)


def _subsets(num: int, k: int, num_subsets: int,
             rng: np.random.Generator) -> list[tuple[int, ...]]:
  """Every k-subset of range(num) when there are at most num_subsets, else that many
  distinct ones drawn at random (sorted tuples)."""
  if math.comb(num, k) <= num_subsets:
    return list(itertools.combinations(range(num), k))
  chosen: dict[tuple[int, ...], None] = {}  # Insertion-ordered: the draw order.
  while len(chosen) < num_subsets:
    chosen[tuple(sorted(rng.choice(num, size=k, replace=False).tolist()))] = None
  return list(chosen)


def _spread_sizes(num: int, max_sizes: int) -> np.ndarray:
  """1..num when that is at most max_sizes values, else about max_sizes log-spaced ones
  (1 and num included): large ensembles change little from one size to the next."""
  if num <= max_sizes:
    return np.arange(1, num + 1)
  return np.unique(np.round(np.geomspace(1, num, max_sizes)).astype(int))


def ensemble_size_spread(member_probs: np.ndarray, labels: np.ndarray,
                         members: Sequence[int], num_subsets: int = 20, seed: int = 0,
                         max_sizes: int = 24) -> SizeSpread:
  """Accuracy and NLL of the ensembles of k of `members`, over many subsets of each size.

  For each k, every k-subset when there are at most num_subsets of them (so k = 1 gives
  each member alone when len(members) <= num_subsets, and k = len(members) the one full
  ensemble), else num_subsets distinct subsets drawn with numpy's default_rng(seed).

  Example:
    >>> p = np.array([[[0.9, 0.1]], [[0.3, 0.7]], [[0.6, 0.4]]])  # 3 members, 1 example
    >>> s = ensemble_size_spread(p, np.array([0]), [0, 1, 2])
    >>> s.num_subsets.tolist(), s.stat('accuracy', 'min').tolist()
    ([3, 3, 1], [0.0, 0.0, 1.0])

  Args:
    member_probs: [M, N, C] every member's probabilities.
    labels: [N] integer labels.
    members: the member indices to draw from (e.g. the non-frozen ones).
    num_subsets: the most subsets evaluated per size.
    seed: seeds the draw of subsets.
    max_sizes: sizes evaluated at most (log-spaced beyond it; the cost grows as the
      sum of the sizes).

  Returns:
    SizeSpread over the sizes 1..len(members).
  """
  labels = np.asarray(labels)

  def accuracy_nll(chosen):
    return _accuracy_nll(member_probs[chosen].sum(0, dtype=np.float64) / len(chosen), labels)

  return SizeSpread(*over_subsets(members, accuracy_nll, num_subsets, seed, max_sizes))


def over_subsets(members: Sequence[int], pair: Callable[[np.ndarray], tuple[float, float]],
                 num_subsets: int, seed: int, max_sizes: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(sizes [K], subsets per size [K], a [K, S], b [K, S]): `pair(chosen member indices)`
  -> (a, b) for the subsets of each spread size that _subsets draws from
  default_rng(seed) (NaN where a size has fewer than num_subsets)."""
  members = np.asarray(list(members), int)
  rng = np.random.default_rng(seed)
  sizes = _spread_sizes(len(members), max_sizes)
  a = np.full((len(sizes), num_subsets), np.nan)
  b = np.full((len(sizes), num_subsets), np.nan)
  counts = []
  for i, k in enumerate(sizes):
    subsets = _subsets(len(members), int(k), num_subsets, rng)
    counts.append(len(subsets))
    for j, subset in enumerate(subsets):
      a[i, j], b[i, j] = pair(members[list(subset)])
  return sizes, np.array(counts, int), a, b
