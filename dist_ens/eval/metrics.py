"""Ensemble classification and uncertainty metrics: additive sums on device, ranks on host.

Metrics are computed on device inside a jitted eval step, one batch at a time.
Most are means over examples, so they are expressed as SUMS: `eval_batch(...).sums` holds
the per-batch sums, `add_sums` accumulates them across batches, and `finalize`
turns the totals into final values once, on the host. Because masked (padding)
examples contribute exactly zero, a padded last batch gives exact results.

Two kinds of metric are not sums: adaptive ECE (equal-mass bins need the sorted
confidences of the whole split) and OOD AUROC/AUPR (ranks of the scores of both
splits). For those the step also returns small per-example arrays (`ExampleStats`:
a few floats per example and member); the caller drops the padding, concatenates
the batches on the host and `finalize` / `ood_metrics` compute them in NumPy.
That is exact (it equals scikit-learn's roc_auc_score / average_precision_score,
ties included), where fixed fine histograms on device would only approximate
ranks; the cost is O(M x N) host memory for an N-example split, which is small
for evaluation sets (8 members x 10^5 examples x 3 floats is 10 MB).

Ensemble prediction:
  The ensemble's predictive distribution p_bar is the mean of the included
  members' softmax probabilities. Its log-probabilities are computed stably as
  `logsumexp_m(log_softmax(logits_m)) - log(K)`, K the number of included members.

Definitions (per example; the reported value is the mean over examples):
  accuracy   [argmax p == y]; argmax ties go to the first (lowest) class index.
  nll        -log p(y).
  brier      sum_c (p_c - onehot(y)_c)^2.
  entropy    H[p] = -sum_c p_c log p_c (nats), with 0 log 0 = 0. For the ensemble
             this is the total predictive uncertainty H[p_bar].
  expected_entropy   mean over included members of H[p_m] (the aleatoric part).
  mutual_information H[p_bar] - expected_entropy (the epistemic part: the
             information the label would give about which member is right).
             Mathematically >= 0; float32 rounding can leave about -1e-7.
  disagreement  mean over included members of [argmax p_m != argmax p_bar].
  pairwise_kl   mean over ordered pairs m != n of included members of
             KL(p_m || p_n) = sum_c p_m,c (log p_m,c - log p_n,c); 0 for one member.
  ece        Confidence is `max_c p_c`. Examples are binned into NUM_ECE_BINS
             equal-width bins over [0, 1] with
             `bin = clip(floor(confidence * NUM_ECE_BINS), 0, NUM_ECE_BINS - 1)`,
             so confidence 1.0 lands in the last bin (float32 confidences exactly
             on an edge may fall on either side of it);
             `ECE = sum_b |correct_b - conf_b| / count`, with correct_b and conf_b
             the summed correctness and confidence of the examples in bin b.
  adaptive_ece  The same with NUM_ECE_BINS equal-mass bins: examples sorted by
             confidence (a stable sort, ties kept in example order) and split
             into NUM_ECE_BINS contiguous groups whose sizes differ by at most one
             (`np.array_split`); empty groups (fewer examples than bins) are skipped.

Typical use:

  sums = None
  for batch in eval_batches:
    batch_sums = jitted_eval_step(params, batch).sums  # calls eval_batch
    sums = batch_sums if sums is None else add_sums(sums, batch_sums)
  results = finalize(jax.device_get(sums))
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dist_ens.eval.ranks import NUM_ECE_BINS, ExampleStats



class BatchEval(NamedTuple):
  """What the eval step returns for one batch: additive sums and per-example stats."""
  sums: dict[str, Any]
  examples: ExampleStats


def ensemble_log_probs(logits: jax.Array, member_mask: jax.Array | None = None) -> jax.Array:
  """Log of the mean of the included members' softmax probabilities.

  Example:
    >>> logits = jnp.array([[[0., 0.]], [[0., jnp.log(3.)]]])  # [M=2, B=1, C=2]
    >>> np.round(np.exp(ensemble_log_probs(logits)), 3).tolist()
    [[0.375, 0.625]]

  Args:
    logits: [M, B, C] per-member logits (computed in float32).
    member_mask: [M] bool, members in the ensemble (None = all).

  Returns:
    [B, C] ensemble log-probabilities.
  """
  member_log_probs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  return _ensemble_log_probs(member_log_probs, _member_included(member_log_probs, member_mask))


def _member_included(member_log_probs: jax.Array, member_mask: jax.Array | None) -> jax.Array:
  if member_mask is None:
    return jnp.ones((member_log_probs.shape[0],), bool)
  return jnp.asarray(member_mask, bool)


def _ensemble_log_probs(member_log_probs: jax.Array, included: jax.Array) -> jax.Array:
  # Excluded members are set to -inf (not weighted by zero inside logsumexp) so
  # that they cannot dominate its max-shift and cost precision.
  included_log_probs = jnp.where(_per_member(included, member_log_probs.ndim),
                                 member_log_probs, -jnp.inf)
  return jax.nn.logsumexp(included_log_probs, axis=0) - jnp.log(
      jnp.sum(included.astype(jnp.float32)))


def _per_member(included: jax.Array, ndim: int) -> jax.Array:
  """[M] member flags shaped to broadcast against an [M, ...] array of `ndim` axes
  (examples may carry more axes than one: [M, B, T, C] per-position outputs)."""
  return included.reshape(-1, *(1,) * (ndim - 1))


def _entropy(log_probs: jax.Array) -> jax.Array:
  # 0 log 0 = 0: a class with probability 0 (log-prob -inf) adds nothing, not NaN;
  # a NaN member stays NaN rather than look certain.
  probs = jnp.exp(log_probs)
  return -jnp.sum(jnp.where(probs == 0, 0.0, probs * log_probs), axis=-1)


def member_uncertainty(logits: jax.Array, member_mask: jax.Array | None = None
                       ) -> dict[str, jax.Array]:
  """Per-example uncertainty of an ensemble's prediction (see the module docstring).

  Example:
    >>> same = jnp.zeros((3, 1, 4))  # three identical, uniform members
    >>> u = member_uncertainty(same)
    >>> float(u['entropy'][0]).__round__(4), float(u['mutual_information'][0]).__round__(4)
    (1.3863, 0.0)

  Args:
    logits: [M, B, C] per-member logits.
    member_mask: [M] bool, members in the ensemble (None = all).

  Returns:
    A dict of [B] arrays 'entropy' (H[p_bar]), 'expected_entropy',
    'mutual_information', 'pairwise_kl', and 'member_entropy' [M, B].
  """
  member_log_probs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  included = _member_included(member_log_probs, member_mask)
  return _uncertainty(member_log_probs, _ensemble_log_probs(member_log_probs, included),
                      included)


def _uncertainty(member_log_probs: jax.Array, ens_log_probs: jax.Array,
                 included: jax.Array) -> dict[str, jax.Array]:
  k = jnp.sum(included.astype(jnp.float32))
  member_entropy = _entropy(member_log_probs)  # [M, B] (or [M, B, T])
  inc = _per_member(included, member_entropy.ndim)
  # Excluded members may be NaN (a frozen, poisoned member): select, never multiply.
  expected_entropy = jnp.sum(jnp.where(inc, member_entropy, 0.0), axis=0) / k
  entropy = _entropy(ens_log_probs)
  # sum_{m,n} KL(p_m || p_n) = sum_m sum_c p_m,c (K log p_m,c - sum_n log p_n,c): one
  # pass over members instead of M^2 pairs. The n = m terms are zero, so dividing by
  # the K(K-1) ordered pairs gives the mean over distinct pairs. Rounding errors in
  # the difference are weighted by p_m,c, so they stay at float32 precision.
  member_probs = jnp.exp(member_log_probs)
  log_prob_sum = jnp.sum(jnp.where(_per_member(included, member_log_probs.ndim),
                                   member_log_probs, 0.0), axis=0)
  kl_terms = jnp.where(member_probs == 0, 0.0,
                       member_probs * (k * member_log_probs - log_prob_sum[None]))
  kl_sums = jnp.where(inc, jnp.sum(kl_terms, axis=-1), 0.0)
  pairwise_kl = jnp.sum(kl_sums, axis=0) / (k * jnp.maximum(k - 1.0, 1.0))
  return {'entropy': entropy, 'expected_entropy': expected_entropy,
          'mutual_information': entropy - expected_entropy, 'pairwise_kl': pairwise_kl,
          'member_entropy': member_entropy}


def _bin_sums(
    confidence: jax.Array, correct: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-bin sums of count, confidence and correctness.

  Args:
    confidence: [..., B] top-class probability per example.
    correct: [..., B] 1.0 where the prediction is right, else 0.0.
    mask: [B] bool; False marks padding.

  Returns:
    (bin_count, bin_conf, bin_correct), each [..., NUM_ECE_BINS].
  """
  # Padding may carry NaN confidence; zero it before it meets the one-hot,
  # since NaN * 0 is still NaN.
  confidence = jnp.where(mask, confidence, 0.0)
  correct = jnp.where(mask, correct, 0.0)
  bin_index = jnp.clip(
      jnp.floor(confidence * NUM_ECE_BINS).astype(jnp.int32),
      0,
      NUM_ECE_BINS - 1,
  )
  # A masked one-hot keeps shapes static under jit (no scatter, no
  # data-dependent indexing).
  in_bin = jax.nn.one_hot(bin_index, NUM_ECE_BINS, dtype=jnp.float32)
  in_bin = in_bin * mask[:, None].astype(jnp.float32)
  bin_count = jnp.sum(in_bin, axis=-2)
  bin_conf = jnp.sum(in_bin * confidence[..., None], axis=-2)
  bin_correct = jnp.sum(in_bin * correct[..., None], axis=-2)
  return bin_count, bin_conf, bin_correct


def _prediction_terms(log_probs: jax.Array, scores: jax.Array, labels: jax.Array,
                      onehot: jax.Array, mask: jax.Array) -> dict[str, Any]:
  """Per-example terms of a predictor ([M, B, C] members or [B, C] the ensemble): the
  prediction (argmax of `scores`), correctness, confidence, and the masked sums of
  nll, correct and brier and the ECE bins."""
  pred = jnp.argmax(scores, axis=-1)
  correct = (pred == labels).astype(jnp.float32)
  # Gather rather than multiply by the one-hot: a -inf log-prob on another class
  # (from -inf logits) would otherwise turn into NaN.
  index = jnp.broadcast_to(labels[:, None], log_probs.shape[:-1] + (1,))
  nll = -jnp.take_along_axis(log_probs, index, axis=-1)[..., 0]
  brier = jnp.sum((jnp.exp(log_probs) - onehot) ** 2, axis=-1)
  conf = jnp.exp(jnp.max(log_probs, axis=-1))
  bin_count, bin_conf, bin_correct = _bin_sums(conf, correct, mask)
  masked = lambda x: jnp.sum(jnp.where(mask, x, 0.0), axis=-1)
  return {'pred': pred, 'correct': correct, 'conf': conf,
          'sums': {'nll': masked(nll), 'correct': masked(correct), 'brier': masked(brier),
                   'bin_count': bin_count, 'bin_conf': bin_conf, 'bin_correct': bin_correct}}


def _batch_sums(member, ens, uncertainty, member_weight, example_weight, mask):
  """eval_batch's `sums` from the members' and the ensemble's prediction terms."""

  def masked_sum(per_example: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask, per_example, 0.0), axis=-1)

  member_disagrees = (member['pred'] != ens['pred']).astype(jnp.float32)  # [M, B]
  disagreement = jnp.sum(member_weight[:, None] * member_disagrees, axis=0) / jnp.sum(
      member_weight)
  return {
      "count": jnp.sum(example_weight),
      **{f"member_{k}": v for k, v in member['sums'].items()},
      "member_entropy": masked_sum(uncertainty["member_entropy"]),
      **{f"ensemble_{k}": v for k, v in ens['sums'].items()},
      "ensemble_entropy": masked_sum(uncertainty["entropy"]),
      "disagreement": masked_sum(disagreement),
      "expected_entropy": masked_sum(uncertainty["expected_entropy"]),
      "mutual_information": masked_sum(uncertainty["mutual_information"]),
      "pairwise_kl": masked_sum(uncertainty["pairwise_kl"]),
  }


def eval_batch(
    logits: jax.Array,
    labels: jax.Array,
    mask: jax.Array,
    member_mask: jax.Array | None = None,
) -> BatchEval:
  """Additive metric sums and per-example stats of one batch of ensemble predictions.

  Pure jnp and jit-able. Padded rows (mask False) may hold anything, including
  NaN/inf logits and out-of-range labels: they are removed from the sums with
  `jnp.where` rather than multiplied by zero, so they contribute exactly nothing;
  in `examples` they hold arbitrary values for the caller to drop.

  Example:
    >>> logits = jnp.zeros((2, 3, 4))  # 2 members, 3 examples, 4 classes
    >>> out = eval_batch(logits, jnp.array([0, 1, 2]), jnp.array([True, True, False]))
    >>> float(out.sums['count']), out.examples.member_confidence.shape
    (2.0, (2, 3))

  Args:
    logits: [M, B, C] per-member logits. Computation is done in float32.
    labels: [B] integer class labels.
    mask: [B] bool; False marks padding.
    member_mask: [M] bool; members in the ensemble (None = all). Excluded members keep
      their own sums but leave the ensemble's mean and the ensemble-only metrics
      (all excluded: NaN, a caller bug not checked at runtime).

  Returns:
    BatchEval(sums, examples). `sums` is a flat dict of float32 arrays: 'count' [];
      'member_{nll,correct,brier,entropy}' [M] and 'ensemble_{...}' [] (sums over
      examples of -log p(y), [argmax p == y], sum_c (p_c - onehot_c)^2, H[p]);
      '{member,ensemble}_bin_{count,conf,correct}' [M, NUM_ECE_BINS] / [NUM_ECE_BINS];
      'disagreement', 'expected_entropy', 'mutual_information', 'pairwise_kl' [] (the
      module docstring defines them).
    `examples` is an ExampleStats of per-example arrays.
  """
  logits = jnp.asarray(logits, jnp.float32)
  num_members, _, num_classes = logits.shape
  mask = jnp.asarray(mask, bool)
  example_weight = mask.astype(jnp.float32)
  member_included = jnp.asarray(True if member_mask is None else member_mask, bool)
  member_included = jnp.broadcast_to(member_included, (num_members,))
  member_weight = member_included.astype(jnp.float32)

  # Padding labels may be out of range: pin them to a class (no out-of-bounds gathers).
  labels = jnp.where(mask, labels, 0)
  onehot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)  # [B, C]

  member_log_probs = jax.nn.log_softmax(logits, axis=-1)  # [M, B, C]
  member = _prediction_terms(member_log_probs, logits, labels, onehot, mask)
  ens_log_probs = _ensemble_log_probs(member_log_probs, member_included)  # [B, C]
  ens = _prediction_terms(ens_log_probs, ens_log_probs, labels, onehot, mask)
  uncertainty = _uncertainty(member_log_probs, ens_log_probs, member_included)
  sums = _batch_sums(member, ens, uncertainty, member_weight, example_weight, mask)
  examples = ExampleStats(
      member_confidence=member['conf'], member_correct=member['correct'],
      member_entropy=uncertainty["member_entropy"], ensemble_confidence=ens['conf'],
      ensemble_correct=ens['correct'], entropy=uncertainty["entropy"],
      mutual_information=uncertainty["mutual_information"])
  return BatchEval(sums, examples)


def add_sums(
    a: dict[str, jax.Array], b: dict[str, jax.Array]
) -> dict[str, jax.Array]:
  """Adds two sums dicts elementwise (e.g. to accumulate across batches).

  Args:
    a: sums dict as returned by `eval_batch(...).sums`.
    b: sums dict with the same keys and shapes.

  Returns:
    The elementwise sum, with the same structure: one compiled program for the whole dict
    (eagerly, each distinct leaf shape would compile and run its own).
  """
  return _add_trees(a, b)


@jax.jit
def _add_trees(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
  return jax.tree.map(jnp.add, a, b)
