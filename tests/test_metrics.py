"""Tests for dist_ens.eval.metrics against an independent float64 NumPy reference."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dist_ens.eval import metrics, ranks, registry as metric_registry

M, B, C = 4, 37, 10

# Most tests go through jit: eager dispatch recompiles every op per new shape,
# which is several times slower. test_jit_matches_eager covers eager mode. One
# compiled eval_batch serves both (eval_sums is its .sums).
_eval_batch = jax.jit(metrics.eval_batch)


def _eval_sums(logits, labels, mask, member_mask=None):
  return _eval_batch(logits, labels, mask, member_mask).sums

SUM_SHAPES = {
    "count": (),
    "member_nll": (M,),
    "member_correct": (M,),
    "member_brier": (M,),
    "member_entropy": (M,),
    "member_bin_count": (M, metrics.NUM_ECE_BINS),
    "member_bin_conf": (M, metrics.NUM_ECE_BINS),
    "member_bin_correct": (M, metrics.NUM_ECE_BINS),
    "ensemble_nll": (),
    "ensemble_correct": (),
    "ensemble_brier": (),
    "ensemble_entropy": (),
    "ensemble_bin_count": (metrics.NUM_ECE_BINS,),
    "ensemble_bin_conf": (metrics.NUM_ECE_BINS,),
    "ensemble_bin_correct": (metrics.NUM_ECE_BINS,),
    "disagreement": (),
    "expected_entropy": (),
    "mutual_information": (),
    "pairwise_kl": (),
}


def _random_inputs(seed=0, m=M, b=B, c=C, scale=3.0):
  rng = np.random.default_rng(seed)
  logits = (rng.standard_normal((m, b, c)) * scale).astype(np.float32)
  labels = rng.integers(0, c, size=b).astype(np.int32)
  return logits, labels


def _softmax64(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max())
  return e / e.sum()


def _reference(logits, labels, mask, member_mask=None):
  """Final metrics straight from the definitions, one example at a time."""
  m, b, c = logits.shape
  included = [k for k in range(m) if member_mask is None or member_mask[k]]
  nbins = metrics.NUM_ECE_BINS

  def new_acc():
    return {
        "nll": 0.0,
        "correct": 0.0,
        "brier": 0.0,
        "entropy": 0.0,
        "bins": [[0.0, 0.0, 0.0] for _ in range(nbins)],
        "conf": [],
        "hit": [],
    }

  def add(acc, p, y):
    pred = int(np.argmax(p))
    conf = float(np.max(p))
    # Guards the comparison itself: a float64 confidence this close to a bin
    # edge could legitimately fall on the other side in float32.
    assert abs(conf * nbins - round(conf * nbins)) > 1e-4 or conf in (0, 1)
    hit = float(pred == y)
    acc["nll"] -= math.log(p[y])
    acc["correct"] += hit
    acc["brier"] += float(np.sum((p - np.eye(c)[y]) ** 2))
    acc["entropy"] += _entropy64(p)
    acc["conf"].append(conf)
    acc["hit"].append(hit)
    k = min(int(math.floor(conf * nbins)), nbins - 1)
    acc["bins"][k][0] += 1
    acc["bins"][k][1] += conf
    acc["bins"][k][2] += hit

  members = [new_acc() for _ in range(m)]
  ensemble = new_acc()
  count = 0
  disagreement = expected_entropy = mutual_information = pairwise_kl = 0.0
  for i in range(b):
    if not mask[i]:
      continue
    count += 1
    y = int(labels[i])
    probs = [_softmax64(logits[k, i]) for k in range(m)]
    for k in range(m):
      add(members[k], probs[k], y)
    ens_p = np.mean([probs[k] for k in included], axis=0)
    add(ensemble, ens_p, y)
    ens_pred = int(np.argmax(ens_p))
    disagreement += np.mean(
        [float(np.argmax(probs[k]) != ens_pred) for k in included]
    )
    aleatoric = np.mean([_entropy64(probs[k]) for k in included])
    expected_entropy += aleatoric
    mutual_information += _entropy64(ens_p) - aleatoric
    pairs = [(j, k) for j in included for k in included if j != k]
    if pairs:
      pairwise_kl += np.mean([_kl64(probs[j], probs[k]) for j, k in pairs])

  def final(acc):
    ece = sum(abs(bc[2] - bc[1]) for bc in acc["bins"]) / count
    return {
        "accuracy": acc["correct"] / count,
        "nll": acc["nll"] / count,
        "brier": acc["brier"] / count,
        "ece": ece,
        "entropy": acc["entropy"] / count,
        "adaptive_ece": _adaptive_ece64(acc["conf"], acc["hit"], nbins),
    }

  member_final = [final(acc) for acc in members]
  return {
      "members": {
          key: [f[key] for f in member_final]
          for key in member_final[0]
      },
      "ensemble": dict(
          final(ensemble),
          disagreement=disagreement / count,
          expected_entropy=expected_entropy / count,
          mutual_information=mutual_information / count,
          pairwise_kl=pairwise_kl / count,
      ),
  }


def _entropy64(p):
  p = np.asarray(p, np.float64)
  nz = p[p > 0]
  return float(-np.sum(nz * np.log(nz)))


def _kl64(p, q):
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  nz = p > 0
  return float(np.sum(p[nz] * (np.log(p[nz]) - np.log(q[nz]))))


def _adaptive_ece64(conf, hit, nbins):
  """Equal-mass bins from the definition: sort, then cut into nbins runs whose
  sizes differ by at most one, the larger ones first."""
  n = len(conf)
  order = sorted(range(n), key=lambda i: conf[i])  # Python's sort is stable.
  sizes = [n // nbins + (1 if j < n % nbins else 0) for j in range(nbins)]
  total, start = 0.0, 0
  for size in sizes:
    chosen = order[start:start + size]
    start += size
    total += abs(sum(hit[i] for i in chosen) - sum(conf[i] for i in chosen))
  return total / n


def _finalize_with_examples(logits, labels, mask, member_mask=None):
  """finalize() given the per-example stats of the unmasked rows, as evaluate() does."""
  out = _eval_batch(logits, labels, mask, member_mask)
  keep = np.asarray(mask, bool)
  examples = metrics.ExampleStats(*(np.asarray(a)[..., keep] for a in out.examples))
  return metric_registry.finalize(out.sums, examples)


def _without_adaptive(results):
  return {group: {k: v for k, v in values.items() if k != "adaptive_ece"}
          for group, values in results.items()}


def _assert_results_close(actual, expected, atol=1e-5):
  assert actual.keys() == expected.keys()
  for group in expected:
    assert actual[group].keys() == expected[group].keys(), group
    for key in expected[group]:
      np.testing.assert_allclose(
          actual[group][key],
          expected[group][key],
          rtol=1e-5,
          atol=atol,
          err_msg=f"{group}/{key}",
      )


def _assert_sums_close(actual, expected, keys=None):
  keys = expected.keys() if keys is None else keys
  for key in keys:
    np.testing.assert_allclose(
        np.asarray(actual[key]),
        np.asarray(expected[key]),
        rtol=1e-5,
        atol=1e-5,
        err_msg=key,
    )


@pytest.mark.parametrize(
    "mask_kind, member_mask",
    [
        ("all", None),
        ("random", None),
        ("random", [True, False, True, True]),
        ("all", [False, True, False, True]),
    ],
)
def test_matches_numpy_reference(mask_kind, member_mask):
  logits, labels = _random_inputs(seed=1)
  if mask_kind == "all":
    mask = np.ones(B, bool)
  else:
    mask = np.random.default_rng(2).random(B) < 0.7
  mm = None if member_mask is None else np.asarray(member_mask)

  sums = _eval_sums(logits, labels, mask, mm)
  expected = _reference(logits, labels, mask, mm)

  _assert_results_close(metric_registry.finalize(sums), _without_adaptive(expected))
  _assert_results_close(
      _finalize_with_examples(logits, labels, mask, mm), expected
  )
  assert float(sums["count"]) == mask.sum()
  # The random logits should exercise several bins and a non-trivial ECE,
  # otherwise the comparison above would be weak.
  assert np.count_nonzero(np.asarray(sums["member_bin_count"]).sum(0)) >= 5
  assert expected["ensemble"]["disagreement"] > 0.1


def test_sums_have_documented_shapes_and_dtype():
  logits, labels = _random_inputs()
  sums = _eval_sums(logits, labels, np.ones(B, bool))
  assert {k: v.shape for k, v in sums.items()} == SUM_SHAPES
  for key, value in sums.items():
    assert value.dtype == jnp.float32, key
  np.testing.assert_array_equal(
      np.asarray(sums["member_bin_count"]).sum(-1), np.full(M, B)
  )


def test_finalize_is_json_serialisable_plain_python():
  logits, labels = _random_inputs()
  result = metric_registry.finalize(
      _eval_sums(logits, labels, np.ones(B, bool))
  )
  json.dumps(result)
  for key, values in result["members"].items():
    assert isinstance(values, list) and len(values) == M, key
    assert all(type(v) is float for v in values), key
  for key, value in result["ensemble"].items():
    assert type(value) is float, key


def test_perfect_confidence():
  _, labels = _random_inputs()
  logits = np.broadcast_to(
      100.0 * np.eye(C, dtype=np.float32)[labels], (M, B, C)
  )
  sums = _eval_sums(logits, labels, np.ones(B, bool))
  result = metric_registry.finalize(sums)
  for group in (result["members"], {k: [v] for k, v in result["ensemble"].items()}):
    np.testing.assert_allclose(group["accuracy"], 1.0)
    np.testing.assert_allclose(group["nll"], 0.0, atol=1e-6)
    np.testing.assert_allclose(group["brier"], 0.0, atol=1e-6)
    np.testing.assert_allclose(group["ece"], 0.0, atol=1e-6)
  assert result["ensemble"]["disagreement"] == 0.0
  # Certain, identical members: no uncertainty of either kind, no diversity.
  np.testing.assert_allclose(result["members"]["entropy"], 0.0, atol=1e-6)
  for key in ("entropy", "expected_entropy", "mutual_information", "pairwise_kl"):
    np.testing.assert_allclose(result["ensemble"][key], 0.0, atol=1e-6, err_msg=key)
  with_examples = _finalize_with_examples(logits, labels, np.ones(B, bool))
  np.testing.assert_allclose(with_examples["members"]["adaptive_ece"], 0.0, atol=1e-6)
  np.testing.assert_allclose(with_examples["ensemble"]["adaptive_ece"], 0.0, atol=1e-6)
  # Confidence 1.0 must be clipped into the last bin, not dropped.
  last = metrics.NUM_ECE_BINS - 1
  np.testing.assert_array_equal(np.asarray(sums["member_bin_count"])[:, last], B)
  assert float(sums["ensemble_bin_count"][last]) == B


def test_uniform_predictions():
  _, labels = _random_inputs()
  labels[:5] = 0  # make sure some labels hit the tie-broken prediction
  logits = np.zeros((M, B, C), np.float32)
  sums = _eval_sums(logits, labels, np.ones(B, bool))
  result = metric_registry.finalize(sums)

  # argmax ties resolve to the first class.
  accuracy = float(np.mean(labels == 0))
  expected_bin = math.floor(metrics.NUM_ECE_BINS / C)
  for name, res in (
      ("members", result["members"]),
      ("ensemble", {k: [v] for k, v in result["ensemble"].items()}),
  ):
    np.testing.assert_allclose(res["accuracy"], accuracy, err_msg=name)
    np.testing.assert_allclose(res["nll"], math.log(C), rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(res["brier"], 1 - 1 / C, rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(
        res["ece"], abs(accuracy - 1 / C), rtol=1e-5, err_msg=name
    )
  assert result["ensemble"]["disagreement"] == 0.0
  # Uniform members: maximal entropy, all of it aleatoric.
  np.testing.assert_allclose(result["members"]["entropy"], math.log(C), rtol=1e-6)
  np.testing.assert_allclose(result["ensemble"]["entropy"], math.log(C), rtol=1e-6)
  np.testing.assert_allclose(result["ensemble"]["expected_entropy"], math.log(C), rtol=1e-6)
  np.testing.assert_allclose(result["ensemble"]["mutual_information"], 0.0, atol=1e-6)
  np.testing.assert_allclose(result["ensemble"]["pairwise_kl"], 0.0, atol=1e-6)
  # Every confidence ties at 1/C, so the equal-mass bins are runs of examples in
  # their original order; splitting one bin's errors apart can only add to them.
  adaptive = _finalize_with_examples(logits, labels, np.ones(B, bool))
  hits = (labels == 0).astype(float)
  by_order = sum(abs(g.sum() - len(g) / C) for g in np.array_split(hits, metrics.NUM_ECE_BINS))
  np.testing.assert_allclose(adaptive["ensemble"]["adaptive_ece"], by_order / B, rtol=1e-5)
  assert adaptive["ensemble"]["adaptive_ece"] > abs(accuracy - 1 / C) + 0.01
  member_counts = np.asarray(sums["member_bin_count"])
  np.testing.assert_array_equal(member_counts[:, expected_bin], B)
  assert member_counts.sum() == M * B
  assert float(sums["ensemble_bin_count"][expected_bin]) == B


def test_all_wrong_confident():
  _, labels = _random_inputs()
  wrong = (labels + 1) % C
  logits = np.broadcast_to(
      50.0 * np.eye(C, dtype=np.float32)[wrong], (M, B, C)
  )
  result = metric_registry.finalize(
      _eval_sums(logits, labels, np.ones(B, bool))
  )
  for res in (
      result["members"],
      {k: [v] for k, v in result["ensemble"].items()},
  ):
    np.testing.assert_allclose(res["accuracy"], 0.0)
    np.testing.assert_allclose(res["nll"], 50.0, rtol=1e-5)
    np.testing.assert_allclose(res["brier"], 2.0, atol=1e-5)
    np.testing.assert_allclose(res["ece"], 1.0, atol=1e-5)


def test_padded_last_batch_and_add_sums_equal_whole():
  logits, labels = _random_inputs(seed=3)
  member_mask = np.array([True, True, False, True])
  whole = _eval_sums(logits, labels, np.ones(B, bool), member_mask)

  batch = 32
  pad = 2 * batch - B
  rng = np.random.default_rng(4)
  # Garbage in the padding: extreme and non-finite logits, out-of-range labels.
  pad_logits = rng.standard_normal((M, pad, C)).astype(np.float32) * 1e4
  pad_logits[:, 0, :] = np.nan
  pad_logits[:, 1, 0] = np.inf
  pad_labels = rng.integers(-5, 2 * C, size=pad).astype(np.int32)
  padded_logits = np.concatenate([logits, pad_logits], axis=1)
  padded_labels = np.concatenate([labels, pad_labels])
  padded_mask = np.arange(2 * batch) < B

  # One padded batch holding everything.
  one = _eval_sums(padded_logits, padded_labels, padded_mask, member_mask)
  _assert_sums_close(one, whole)

  # Two batches of 32, the second mostly padding, combined with add_sums.
  first = _eval_sums(
      padded_logits[:, :batch], padded_labels[:batch], padded_mask[:batch],
      member_mask,
  )
  second = _eval_sums(
      padded_logits[:, batch:], padded_labels[batch:], padded_mask[batch:],
      member_mask,
  )
  combined = metrics.add_sums(first, second)
  assert combined.keys() == whole.keys()
  for value in combined.values():
    assert np.all(np.isfinite(np.asarray(value)))
  _assert_sums_close(combined, whole)
  _assert_results_close(metric_registry.finalize(combined), metric_registry.finalize(whole))


def test_identical_members():
  logits, labels = _random_inputs(seed=5)
  same = np.broadcast_to(logits[:1], (M, B, C))
  result = _finalize_with_examples(same, labels, np.ones(B, bool))
  for key in ("accuracy", "nll", "brier", "ece", "entropy", "adaptive_ece"):
    np.testing.assert_allclose(
        result["members"][key], result["members"][key][0], err_msg=key
    )
    np.testing.assert_allclose(
        result["ensemble"][key], result["members"][key][0], rtol=1e-5,
        atol=1e-6, err_msg=key,
    )
  assert result["ensemble"]["disagreement"] == 0.0
  np.testing.assert_allclose(result["ensemble"]["expected_entropy"],
                             result["members"]["entropy"][0], rtol=1e-6)
  # Identical members carry no epistemic uncertainty and no diversity.
  assert abs(result["ensemble"]["mutual_information"]) < 1e-6
  assert abs(result["ensemble"]["pairwise_kl"]) < 1e-6
  # The random logits are far from uniform or certain, so this is not vacuous.
  assert 0.3 < result["ensemble"]["entropy"] < math.log(C) - 0.3


@pytest.mark.parametrize("excluded", [0, 2])
def test_member_mask_equals_dropping_member(excluded):
  logits, labels = _random_inputs(seed=6)
  mask = np.random.default_rng(7).random(B) < 0.8
  member_mask = np.arange(M) != excluded

  masked = _eval_sums(logits, labels, mask, member_mask)
  dropped = _eval_sums(
      np.delete(logits, excluded, axis=0), labels, mask
  )
  full = _eval_sums(logits, labels, mask)

  ensemble_keys = [k for k in SUM_SHAPES if not k.startswith("member_")]
  _assert_sums_close(masked, dropped, ensemble_keys)
  # Sanity: excluding the member actually changes the ensemble.
  assert not np.isclose(
      float(masked["ensemble_nll"]), float(full["ensemble_nll"])
  )
  # Per-member sums ignore member_mask: kept members match the dropped run,
  # and every member (the excluded one too) matches the unmasked run.
  for key in SUM_SHAPES:
    if key.startswith("member_"):
      np.testing.assert_allclose(
          np.delete(np.asarray(masked[key]), excluded, axis=0),
          np.asarray(dropped[key]), rtol=1e-6, err_msg=key,
      )
      np.testing.assert_allclose(
          np.asarray(masked[key]), np.asarray(full[key]), rtol=1e-6,
          err_msg=key,
      )


def test_jit_matches_eager():
  logits, labels = _random_inputs(seed=8)
  mask = np.arange(B) < 30
  member_mask = np.array([True, False, True, True])
  # Eager dispatch is slow, so only the member_mask path (the one with more
  # logic) is compared op-by-op.
  eager = metrics.eval_batch(logits, labels, mask, member_mask).sums
  jitted = jax.jit(lambda *a: metrics.eval_batch(*a).sums)(logits, labels, mask, member_mask)
  assert jitted.keys() == eager.keys() == SUM_SHAPES.keys()
  _assert_sums_close(jitted, eager)


def test_member_sharded_logits(devices):
  logits, labels = _random_inputs(seed=9)
  mesh = jax.sharding.Mesh(np.array(devices[:M]), ("member",))
  sharded = jax.device_put(
      logits,
      jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("member")),
  )
  mask = np.ones(B, bool)
  assert len(sharded.sharding.device_set) == M
  out = _eval_sums(sharded, labels, mask)
  _assert_sums_close(out, _eval_sums(logits, labels, mask))


def test_finalize_zero_count_raises():
  logits, labels = _random_inputs()
  sums = _eval_sums(logits, labels, np.zeros(B, bool))
  assert float(sums["count"]) == 0.0
  with pytest.raises(ValueError, match="count|examples"):
    metric_registry.finalize(sums)


def test_uncertainty_is_finite_when_an_excluded_member_is_nan():
  logits, labels = _random_inputs(seed=10)
  poisoned = logits.copy()
  poisoned[1] = np.nan
  member_mask = np.arange(M) != 1
  got = metric_registry.finalize(_eval_sums(poisoned, labels, np.ones(B, bool), member_mask))
  dropped = metric_registry.finalize(
      _eval_sums(np.delete(logits, 1, axis=0), labels, np.ones(B, bool))
  )
  _assert_results_close({"ensemble": got["ensemble"]}, {"ensemble": dropped["ensemble"]})
  assert np.isnan(got["members"]["entropy"][1])


def test_single_member_has_no_pairs():
  logits, labels = _random_inputs(seed=11, m=1)
  result = metric_registry.finalize(jax.jit(lambda *a: metrics.eval_batch(*a).sums)(
      logits, labels, np.ones(B, bool)))
  assert result["ensemble"]["pairwise_kl"] == 0.0
  assert abs(result["ensemble"]["mutual_information"]) < 1e-6


def test_member_uncertainty_matches_eval_batch():
  logits, _ = _random_inputs(seed=12)
  member_mask = np.array([True, True, False, True])
  u = jax.jit(metrics.member_uncertainty)(logits, member_mask)
  stats = _eval_batch(logits, np.zeros(B, np.int32), np.ones(B, bool), member_mask).examples
  np.testing.assert_allclose(u["entropy"], stats.entropy, rtol=1e-6)
  np.testing.assert_allclose(u["mutual_information"], stats.mutual_information, atol=1e-6)
  for i in range(B):
    probs = [_softmax64(logits[k, i]) for k in range(M) if member_mask[k]]
    reference = np.mean([_kl64(p, q) for p in probs for q in probs if p is not q])
    np.testing.assert_allclose(u["pairwise_kl"][i], reference, rtol=1e-4, atol=1e-6)
  ens = np.exp(jax.jit(metrics.ensemble_log_probs)(logits, member_mask))
  np.testing.assert_allclose(
      ens, np.mean(np.asarray(jax.nn.softmax(logits[member_mask])), axis=0), rtol=1e-5)


@pytest.mark.parametrize("n", [1, 7, 15, 16, 100])
def test_adaptive_ece_matches_definition(n):
  rng = np.random.default_rng(n)
  conf = rng.random((3, n))
  hit = (rng.random((3, n)) < conf).astype(float)
  got = ranks.adaptive_ece(conf, hit)
  for row in range(3):
    expected = _adaptive_ece64(list(conf[row]), list(hit[row]), metrics.NUM_ECE_BINS)
    np.testing.assert_allclose(got[row], expected, rtol=1e-12)


def test_adaptive_ece_differs_from_equal_width_ece():
  # Everything in one equal-width bin but split apart by equal-mass bins:
  # equal-width ECE averages the errors away, adaptive ECE does not.
  conf = np.array([0.61, 0.62, 0.63, 0.64])
  hit = np.array([0.0, 0.0, 1.0, 1.0])
  assert ranks.adaptive_ece(conf, hit, num_bins=2) == pytest.approx(
      (abs(0 - 1.23) + abs(2 - 1.27)) / 4)


@pytest.mark.parametrize("ties", [False, True])
def test_auroc_aupr_match_sklearn(ties):
  sk = pytest.importorskip("sklearn.metrics")
  rng = np.random.default_rng(13)
  in_scores = rng.normal(0.0, 1.0, 300)
  out_scores = rng.normal(0.8, 1.0, 200)
  if ties:  # Coarse scores: many ties within and across the two sets.
    in_scores, out_scores = np.round(in_scores, 1), np.round(out_scores, 1)
  labels = np.r_[np.zeros(300), np.ones(200)]
  scores = np.r_[in_scores, out_scores]
  assert 0.6 < ranks.auroc(in_scores, out_scores) < 0.9
  np.testing.assert_allclose(ranks.auroc(in_scores, out_scores),
                             sk.roc_auc_score(labels, scores), rtol=1e-12)
  np.testing.assert_allclose(ranks.aupr(in_scores, out_scores),
                             sk.average_precision_score(labels, scores), rtol=1e-12)


def test_auroc_aupr_edge_cases():
  assert ranks.auroc(np.array([0.0, 0.1]), np.array([0.5, 0.9])) == 1.0
  assert ranks.auroc(np.array([0.5, 0.9]), np.array([0.0, 0.1])) == 0.0
  assert ranks.aupr(np.array([0.0, 0.1]), np.array([0.5, 0.9])) == 1.0
  # Constant scores separate nothing: AUROC one half, AUPR the OOD fraction.
  assert ranks.auroc(np.ones(3), np.ones(1)) == 0.5
  assert ranks.aupr(np.ones(3), np.ones(1)) == 0.25
  assert np.isnan(ranks.auroc(np.array([]), np.ones(2)))


def test_ood_metrics_uses_entropy_and_mutual_information():
  sk = pytest.importorskip("sklearn.metrics")
  rng = np.random.default_rng(14)

  def stats(n, shift):
    return metrics.ExampleStats(
        member_confidence=rng.random((M, n)), member_correct=np.zeros((M, n)),
        member_entropy=rng.random((M, n)) + shift, ensemble_confidence=rng.random(n),
        ensemble_correct=np.zeros(n), entropy=rng.random(n) + shift,
        mutual_information=rng.random(n) + 2 * shift)

  inside, outside = stats(50, 0.0), stats(40, 0.3)
  got = ranks.ood_metrics(inside, outside)
  labels = np.r_[np.zeros(50), np.ones(40)]
  for key, field in (("entropy", "entropy"), ("mi", "mutual_information")):
    scores = np.r_[getattr(inside, field), getattr(outside, field)]
    np.testing.assert_allclose(got["ensemble"][f"auroc_{key}"],
                               sk.roc_auc_score(labels, scores))
    np.testing.assert_allclose(got["ensemble"][f"aupr_{key}"],
                               sk.average_precision_score(labels, scores))
  for m in range(M):
    scores = np.r_[inside.member_entropy[m], outside.member_entropy[m]]
    np.testing.assert_allclose(got["members"]["auroc_entropy"][m],
                               sk.roc_auc_score(labels, scores))
  json.dumps(got)
