"""Metrics that need ranks, not sums: adaptive ECE and OOD AUROC/AUPR, on the host.

The eval step returns a few floats per example (ExampleStats); the caller drops the
padding and concatenates the batches, and these functions compute exact values in
NumPy (ties included, equal to scikit-learn's roc_auc_score / average_precision_score).
"""

from typing import Any, NamedTuple

import numpy as np

NUM_ECE_BINS = 15


class ExampleStats(NamedTuple):
  """Per-example values the rank-based metrics need; B examples, M members.

  Padding rows hold arbitrary values: drop them with the batch mask on the host.
  """
  member_confidence: Any  # [M, B] max_c p_m,c
  member_correct: Any  # [M, B] 1.0 where member m's argmax is the label
  member_entropy: Any  # [M, B] H[p_m]
  ensemble_confidence: Any  # [B]
  ensemble_correct: Any  # [B]
  entropy: Any  # [B] H[p_bar], the ensemble's predictive entropy
  mutual_information: Any  # [B]


def adaptive_ece(confidence: np.ndarray, correct: np.ndarray,
                 num_bins: int = NUM_ECE_BINS) -> np.ndarray:
  """ECE over equal-mass confidence bins (see the module docstring), on the host.

  Example:
    >>> # Bins {0.6, 0.7} and {0.8, 0.9}: (|1 - 1.3| + |2 - 1.7|) / 4 examples.
    >>> round(float(adaptive_ece(np.array([.9, .8, .6, .7]), np.array([1., 1., 0., 1.]),
    ...                          num_bins=2)), 6)
    0.15

  Args:
    confidence: [..., N] top-class probability of each example (no padding).
    correct: [..., N] 1.0 where the prediction is right.
    num_bins: number of equal-mass bins.

  Returns:
    [...] adaptive ECE along the last axis (float64).
  """
  confidence = np.asarray(confidence, np.float64)
  correct = np.asarray(correct, np.float64)
  n = confidence.shape[-1]
  order = np.argsort(confidence, axis=-1, kind='stable')
  confidence = np.take_along_axis(confidence, order, axis=-1)
  correct = np.take_along_axis(correct, order, axis=-1)
  total = np.zeros(confidence.shape[:-1])
  for group in np.array_split(np.arange(n), num_bins):
    if len(group):
      total += np.abs(correct[..., group].sum(-1) - confidence[..., group].sum(-1))
  return total / n


def _ood_labels_and_scores(in_scores: np.ndarray, out_scores: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
  scores = np.concatenate([np.asarray(in_scores, np.float64),
                           np.asarray(out_scores, np.float64)])
  is_ood = np.concatenate([np.zeros(len(in_scores), bool), np.ones(len(out_scores), bool)])
  return is_ood, scores


def auroc(in_scores: np.ndarray, out_scores: np.ndarray) -> float:
  """Area under the ROC curve of telling out- from in-distribution by a score.

  Higher scores should mean "more likely OOD". Equals the probability that a random
  OOD example scores above a random in-distribution one, ties counting one half
  (the Mann-Whitney U statistic, with average ranks for ties).

  Example:
    >>> auroc(np.array([0.1, 0.4]), np.array([0.3, 0.9]))
    0.75

  Args:
    in_scores: [N_in] scores of in-distribution examples.
    out_scores: [N_out] scores of out-of-distribution examples.

  Returns:
    AUROC in [0, 1]; NaN if either set is empty.
  """
  n_in, n_out = len(in_scores), len(out_scores)
  if not n_in or not n_out:
    return float('nan')
  is_ood, scores = _ood_labels_and_scores(in_scores, out_scores)
  order = np.argsort(scores, kind='stable')
  sorted_scores = scores[order]
  ranks = np.empty(len(scores))
  # Average 1-based rank within each run of tied scores.
  starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
  ends = np.r_[starts[1:], len(scores)]
  for start, end in zip(starts, ends):
    ranks[order[start:end]] = (start + end + 1) / 2.0
  u = ranks[is_ood].sum() - n_out * (n_out + 1) / 2.0
  return float(u / (n_in * n_out))


def aupr(in_scores: np.ndarray, out_scores: np.ndarray) -> float:
  """Area under the precision-recall curve with OOD as the positive class.

  Computed as average precision, sum_k (R_k - R_{k-1}) P_k over the distinct score
  thresholds from high to low (scikit-learn's average_precision_score).

  Example:
    >>> aupr(np.array([0.1, 0.4]), np.array([0.3, 0.9]))
    0.8333333333333333

  Args:
    in_scores: [N_in] scores of in-distribution examples.
    out_scores: [N_out] scores of out-of-distribution examples (higher = more OOD).

  Returns:
    AUPR in [0, 1]; NaN if either set is empty.
  """
  if not len(in_scores) or not len(out_scores):
    return float('nan')
  is_ood, scores = _ood_labels_and_scores(in_scores, out_scores)
  order = np.argsort(-scores, kind='stable')
  scores, is_ood = scores[order], is_ood[order]
  # The last position of each run of tied scores: one threshold per distinct score.
  last = np.r_[np.flatnonzero(scores[1:] != scores[:-1]), len(scores) - 1]
  true_pos = np.cumsum(is_ood)[last]
  precision = true_pos / (last + 1)
  recall = true_pos / is_ood.sum()
  return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def ood_metrics(in_examples: ExampleStats, out_examples: ExampleStats) -> dict[str, Any]:
  """AUROC/AUPR of separating OOD from in-distribution examples by uncertainty.

  Example:
    >>> a = ExampleStats(*([np.zeros((1, 2))] * 3 + [np.zeros(2)] * 2),
    ...                  entropy=np.array([.1, .2]), mutual_information=np.array([0., .1]))
    >>> b = a._replace(entropy=np.array([.9, .8]), mutual_information=np.array([.2, .3]))
    >>> ood_metrics(a, b)['ensemble']['auroc_entropy']
    1.0

  Args:
    in_examples: ExampleStats of the in-distribution split (padding removed).
    out_examples: ExampleStats of the OOD split (padding removed).

  Returns:
    {'members': {'auroc_entropy', 'aupr_entropy'}: lists of M floats (each member's
     own predictive entropy as the score),
     'ensemble': {'auroc_entropy', 'aupr_entropy', 'auroc_mi', 'aupr_mi',
     'entropy_in', 'entropy_out', 'mi_in', 'mi_out'}: floats}, OOD the positive class;
    the *_in / *_out values are the mean scores of each split.
  """
  members_in = np.asarray(in_examples.member_entropy)
  members_out = np.asarray(out_examples.member_entropy)
  ent_in, ent_out = np.asarray(in_examples.entropy), np.asarray(out_examples.entropy)
  mi_in = np.asarray(in_examples.mutual_information)
  mi_out = np.asarray(out_examples.mutual_information)
  return {
      'members': {
          'auroc_entropy': [auroc(a, b) for a, b in zip(members_in, members_out)],
          'aupr_entropy': [aupr(a, b) for a, b in zip(members_in, members_out)],
      },
      'ensemble': {
          'auroc_entropy': auroc(ent_in, ent_out), 'aupr_entropy': aupr(ent_in, ent_out),
          'auroc_mi': auroc(mi_in, mi_out), 'aupr_mi': aupr(mi_in, mi_out),
          'entropy_in': float(np.mean(ent_in)), 'entropy_out': float(np.mean(ent_out)),
          'mi_in': float(np.mean(mi_in)), 'mi_out': float(np.mean(mi_out)),
      },
  }
