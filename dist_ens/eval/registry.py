"""The metric registry: every evaluation metric defined once (name, label, which way is
better, how its value follows from a split's sums), and `finalize`, which turns the sums
that dist_ens.eval.metrics.eval_batch accumulates into final values on the host."""

from typing import Any, NamedTuple

import numpy as np

from dist_ens.eval.ranks import ExampleStats, adaptive_ece


def _ece(
    bin_correct: np.ndarray, bin_conf: np.ndarray, count: float
) -> np.ndarray:
  return np.sum(np.abs(bin_correct - bin_conf), axis=-1) / count


class Metric(NamedTuple):
  """One metric, defined once: its name in results and events, how tables label and
  print it, which way is better, and how its final value comes from the split's sums.

  value(sums, prefix, count) -> the value for prefix 'member' ([M]) or 'ensemble' ([]);
  a metric with `from_examples` is computed from the per-example stats instead.
  """
  name: str
  label: str
  higher_is_better: bool | None  # None: a description (entropy), not a quality to rank by.
  scopes: tuple[str, ...]  # 'members' and/or 'ensemble'
  value: Any = None
  from_examples: Any = None  # (ExampleStats, prefix) -> value
  fmt: str = '.4f'


def _ratio(key: str):
  return lambda s, prefix, count: s[f'{prefix}_{key}'] / count


def _summed(key: str):
  return lambda s, prefix, count: s[key] / count


def _examples_adaptive_ece(examples: ExampleStats, prefix: str):
  if prefix == 'member':
    return adaptive_ece(examples.member_confidence, examples.member_correct)
  return adaptive_ece(examples.ensemble_confidence, examples.ensemble_correct)


_BOTH, _ENSEMBLE = ('members', 'ensemble'), ('ensemble',)
# Every evaluation metric, in the order results and tables list them.
METRICS: tuple[Metric, ...] = (
    Metric('accuracy', 'accuracy', True, _BOTH, _ratio('correct')),
    Metric('nll', 'NLL', False, _BOTH, _ratio('nll')),
    Metric('brier', 'Brier', False, _BOTH, _ratio('brier')),
    Metric('ece', 'ECE', False, _BOTH, lambda s, prefix, count: _ece(
        s[f'{prefix}_bin_correct'], s[f'{prefix}_bin_conf'], count)),
    Metric('adaptive_ece', 'adaptive ECE', False, _BOTH, from_examples=_examples_adaptive_ece),
    Metric('disagreement', 'disagreement', None, _ENSEMBLE, _summed('disagreement')),
    Metric('entropy', 'entropy', None, _BOTH, _ratio('entropy')),
    Metric('expected_entropy', 'expected entropy', None, _ENSEMBLE, _summed('expected_entropy')),
    Metric('mutual_information', 'mutual information', None, _ENSEMBLE,
           _summed('mutual_information')),
    Metric('pairwise_kl', 'pairwise KL', None, _ENSEMBLE, _summed('pairwise_kl')),
)


def finalize(sums: dict[str, Any], examples: ExampleStats | None = None
             ) -> dict[str, dict[str, Any]]:
  """Turns accumulated sums (and per-example stats) into final metric values, on the host.

  Example:
    >>> import jax.numpy as jnp
    >>> from dist_ens.eval.metrics import eval_batch
    >>> out = eval_batch(jnp.zeros((2, 3, 4)), jnp.array([0, 1, 2]), jnp.ones(3, bool))
    >>> round(finalize(out.sums)['ensemble']['accuracy'], 4)
    0.3333

  Args:
    sums: sums dict from `eval_batch(...).sums` / `add_sums` (device or numpy arrays).
    examples: the split's ExampleStats with padding removed; when given, the
      result also holds 'adaptive_ece'.

  Returns:
    {"members": {"accuracy", "nll", "brier", "ece", "entropy"[, "adaptive_ece"]}:
       lists of M floats,
     "ensemble": {"accuracy", "nll", "brier", "ece", "disagreement", "entropy",
       "expected_entropy", "mutual_information", "pairwise_kl"[, "adaptive_ece"]}:
       floats}.
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

  results: dict[str, dict[str, Any]] = {'members': {}, 'ensemble': {}}
  for metric in METRICS:
    for scope in metric.scopes:
      prefix = 'member' if scope == 'members' else 'ensemble'
      if metric.from_examples is not None:
        if examples is None:
          continue
        value = metric.from_examples(examples, prefix)
      else:
        value = metric.value(s, prefix, count)
      results[scope][metric.name] = ([float(v) for v in value] if scope == 'members'
                                     else float(value))
  return results
