"""Ensemble classification metrics computed as additive sums.

Metrics are computed on device inside a jitted eval step, one batch at a time.
Every metric is therefore expressed as a SUM over examples: `eval_sums` returns
the per-batch sums, `add_sums` accumulates them across batches, and `finalize`
turns the totals into final values once, on the host. Because masked (padding)
examples contribute exactly zero, a padded last batch gives exact results.

Ensemble prediction:
  The ensemble's predictive distribution is the mean of the included members'
  softmax probabilities. Its log-probabilities are computed stably as
  `logsumexp_m(log_softmax(logits_m)) - log(num_included)`.

Calibration (ECE):
  Confidence is the top-class probability `max_c p_c`. Examples are binned into
  `NUM_ECE_BINS` equal-width bins over [0, 1] with
  `bin = clip(floor(confidence * NUM_ECE_BINS), 0, NUM_ECE_BINS - 1)`, so
  confidence 1.0 lands in the last bin. Confidences are float32, so a value
  sitting exactly on a bin edge may fall on either side of it.
  `ECE = sum_b |correct_b - conf_b| / count`, where `correct_b` and `conf_b`
  are the summed correctness and confidence of the examples in bin b.

Predictions use `jnp.argmax`, so ties go to the first (lowest) class index.

Typical use:

  sums = None
  for batch in eval_batches:
    batch_sums = jitted_eval_step(params, batch)  # calls eval_sums
    sums = batch_sums if sums is None else add_sums(sums, batch_sums)
  results = finalize(jax.device_get(sums))
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

NUM_ECE_BINS = 15


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


def eval_sums(
    logits: jax.Array,
    labels: jax.Array,
    mask: jax.Array,
    member_mask: jax.Array | None = None,
) -> dict[str, jax.Array]:
  """Computes additive metric sums for one batch of ensemble predictions.

  Pure jnp and jit-able. Padded rows (mask False) may hold anything, including
  NaN/inf logits and out-of-range labels: they are removed with `jnp.where`
  rather than multiplied by zero, so they contribute exactly nothing.

  Args:
    logits: [M, B, C] per-member logits. Computation is done in float32.
    labels: [B] integer class labels.
    mask: [B] bool; False marks padding.
    member_mask: [M] bool; members included in the ensemble (None = all).
      Excluded members still get their own per-member sums but are left out of
      the ensemble's mean probabilities and of disagreement. If it excludes
      every member, the ensemble values and disagreement are undefined (NaN);
      that is a caller bug and is not checked at runtime.

  Returns:
    A flat dict of float32 arrays:
      'count': [] number of unmasked examples.
      'member_nll', 'member_correct', 'member_brier': [M] sums over examples
        of -log p_m(y), [argmax p_m == y] and sum_c (p_m,c - onehot_c)^2.
      'member_bin_count', 'member_bin_conf', 'member_bin_correct':
        [M, NUM_ECE_BINS] per-bin example count, confidence and correctness.
      'ensemble_nll', 'ensemble_correct', 'ensemble_brier': [] the same for
        the ensemble.
      'ensemble_bin_count', 'ensemble_bin_conf', 'ensemble_bin_correct':
        [NUM_ECE_BINS].
      'disagreement': [] sum over examples of the mean over included members
        of [argmax_m != argmax_ensemble].
  """
  logits = jnp.asarray(logits, jnp.float32)
  num_members, _, num_classes = logits.shape
  mask = jnp.asarray(mask, bool)
  example_weight = mask.astype(jnp.float32)
  if member_mask is None:
    member_included = jnp.ones((num_members,), bool)
  else:
    member_included = jnp.asarray(member_mask, bool)
  member_weight = member_included.astype(jnp.float32)

  # Padding labels may be out of range; pin them to a valid class so the
  # gathers below never rely on out-of-bounds semantics.
  labels = jnp.where(mask, labels, 0)
  onehot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)  # [B, C]

  def masked_sum(per_example: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask, per_example, 0.0), axis=-1)

  # Members.
  member_log_probs = jax.nn.log_softmax(logits, axis=-1)  # [M, B, C]
  member_probs = jnp.exp(member_log_probs)
  member_pred = jnp.argmax(logits, axis=-1)  # [M, B]
  member_correct = (member_pred == labels).astype(jnp.float32)
  # Gather rather than multiply by the one-hot: a -inf log-prob on another
  # class (from -inf logits) would otherwise turn into NaN.
  member_nll = -jnp.take_along_axis(
      member_log_probs, labels[None, :, None], axis=-1
  )[..., 0]
  member_brier = jnp.sum((member_probs - onehot) ** 2, axis=-1)
  member_conf = jnp.exp(jnp.max(member_log_probs, axis=-1))
  member_bins = _bin_sums(member_conf, member_correct, mask)

  # Ensemble. Excluded members are set to -inf (not weighted by zero inside
  # logsumexp) so that they cannot dominate its max-shift and cost precision.
  included_log_probs = jnp.where(
      member_included[:, None, None], member_log_probs, -jnp.inf
  )
  ens_log_probs = jax.nn.logsumexp(included_log_probs, axis=0) - jnp.log(
      jnp.sum(member_weight)
  )  # [B, C]
  ens_probs = jnp.exp(ens_log_probs)
  ens_pred = jnp.argmax(ens_log_probs, axis=-1)  # [B]
  ens_correct = (ens_pred == labels).astype(jnp.float32)
  ens_nll = -jnp.take_along_axis(ens_log_probs, labels[:, None], axis=-1)[
      :, 0
  ]
  ens_brier = jnp.sum((ens_probs - onehot) ** 2, axis=-1)
  ens_conf = jnp.exp(jnp.max(ens_log_probs, axis=-1))
  ens_bins = _bin_sums(ens_conf, ens_correct, mask)

  member_disagrees = (member_pred != ens_pred).astype(jnp.float32)  # [M, B]
  disagreement = jnp.sum(
      member_weight[:, None] * member_disagrees, axis=0
  ) / jnp.sum(member_weight)

  return {
      "count": jnp.sum(example_weight),
      "member_nll": masked_sum(member_nll),
      "member_correct": masked_sum(member_correct),
      "member_brier": masked_sum(member_brier),
      "member_bin_count": member_bins[0],
      "member_bin_conf": member_bins[1],
      "member_bin_correct": member_bins[2],
      "ensemble_nll": masked_sum(ens_nll),
      "ensemble_correct": masked_sum(ens_correct),
      "ensemble_brier": masked_sum(ens_brier),
      "ensemble_bin_count": ens_bins[0],
      "ensemble_bin_conf": ens_bins[1],
      "ensemble_bin_correct": ens_bins[2],
      "disagreement": masked_sum(disagreement),
  }


def add_sums(
    a: dict[str, jax.Array], b: dict[str, jax.Array]
) -> dict[str, jax.Array]:
  """Adds two sums dicts elementwise (e.g. to accumulate across batches).

  Args:
    a: sums dict as returned by `eval_sums`.
    b: sums dict with the same keys and shapes.

  Returns:
    The elementwise sum, with the same structure.
  """
  return jax.tree.map(jnp.add, a, b)


def _ece(
    bin_correct: np.ndarray, bin_conf: np.ndarray, count: float
) -> np.ndarray:
  return np.sum(np.abs(bin_correct - bin_conf), axis=-1) / count


def finalize(sums: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """Turns accumulated sums into final metric values, on the host.

  Args:
    sums: sums dict from `eval_sums` / `add_sums` (device or numpy arrays).

  Returns:
    {"members": {"accuracy", "nll", "brier", "ece"}: lists of M floats,
     "ensemble": {"accuracy", "nll", "brier", "ece", "disagreement"}: floats}.
    Plain Python floats and lists, so the result is JSON-serialisable.

  Raises:
    ValueError: if the sums cover no examples (count is 0).
  """
  s = {k: np.asarray(v, dtype=np.float64) for k, v in sums.items()}
  count = float(s["count"])
  if not count > 0:
    raise ValueError(
        f"Cannot finalize metrics: sums cover {count} unmasked examples; "
        "evaluate at least one example with mask=True."
    )

  def as_list(x: np.ndarray) -> list[float]:
    return [float(v) for v in x]

  return {
      "members": {
          "accuracy": as_list(s["member_correct"] / count),
          "nll": as_list(s["member_nll"] / count),
          "brier": as_list(s["member_brier"] / count),
          "ece": as_list(
              _ece(s["member_bin_correct"], s["member_bin_conf"], count)
          ),
      },
      "ensemble": {
          "accuracy": float(s["ensemble_correct"] / count),
          "nll": float(s["ensemble_nll"] / count),
          "brier": float(s["ensemble_brier"] / count),
          "ece": float(
              _ece(s["ensemble_bin_correct"], s["ensemble_bin_conf"], count)
          ),
          "disagreement": float(s["disagreement"] / count),
      },
  }
