"""Population-based training's decisions: which members copy which, and the explored values.

Pure numpy, no JAX and no state: a round's decisions depend only on (pbt.seed, the
round's index, the members' validation metric values, their hyperparameters before the
round), so a resumed run makes the same ones, and a test recomputes them from the values
metrics.jsonl logged. dist_ens/evaluators/pbt.py applies them to the train state.

A round (Jaderberg et al. 2017, "truncation selection" as in Ray Tune's
PopulationBasedTraining): members ranked best first by the metric (non-finite values,
e.g. a frozen member's, last; ties by index); each of the worst n = ceil(quantile * M)
(at most M // 2) copies one of the best n, drawn at random, and explores every explored
field: with probability resample_probability a fresh draw from the field's sweep spec,
else the source's value times one of perturb_factors, then reflected into the spec's range
at the bound it crossed (clipping made a source at the bound a clone of itself).
Member i's draws come from (seed, round, i) alone.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from dist_ens.core import hparams as hparams_lib
from dist_ens.errors import ConfigError


class FieldRule(NamedTuple):
  """How one per-member hyperparameter is explored."""
  low: float  # explored values are clipped to [low, high]
  high: float
  choices: tuple[float, ...]  # a list or grid: a resample picks one of them; () otherwise
  log: bool  # a resample is log-uniform in [low, high] (logspace, loguniform)
  resample: bool  # whether the field's spec gives anything to draw from (not a lone number)


class PbtSpec(NamedTuple):
  """config.pbt, checked, with each explored field's rule (see make_spec)."""
  interval: int  # steps between rounds
  metric: str  # validation metric ranked by
  higher_is_better: bool
  quantile: float  # fraction of members replaced each round
  rules: Mapping[str, FieldRule]  # explored fields, in core.hparams.FIELDS order
  perturb_factors: tuple[float, ...]
  resample_probability: float
  seed: int


class Decision(NamedTuple):
  """One round's outcome."""
  sources: np.ndarray  # [M] int: member i takes member sources[i]'s state (i: kept)
  hparams: dict[str, np.ndarray]  # every field, [M] float32, after explore


def replaced_count(num_members: int, quantile: float) -> int:
  """Members replaced each round: ceil(quantile * M), at most M // 2 (top and bottom
  never overlap)."""
  return min(num_members // 2, math.ceil(quantile * num_members - 1e-9))


def rank(values: Sequence[float], higher_is_better: bool) -> np.ndarray:
  """Member indices best first; non-finite values last; ties broken by index."""
  values = np.asarray(values, np.float64)
  finite = np.isfinite(values)
  signed = np.where(finite, -values if higher_is_better else values, 0.0)
  return np.lexsort((np.arange(len(values)), signed, ~finite))


def decide(spec: PbtSpec, round_index: int, values: Sequence[float],
           hparams: Mapping[str, np.ndarray], first_member: int = 0) -> Decision:
  """Who copies whom in round `round_index`, and every member's hyperparameters after it.

  Args:
    spec: the run's PbtSpec.
    round_index: the round, step // interval (1 for the first).
    values: [M] validation metric values (NaN for a member that cannot rank).
    hparams: {field: [M]} every per-member hyperparameter before the round.
    first_member: the id of values[0] (a member group's population: its members are ids
      first_member .., and each draws from (seed, round, its id) as without groups).

  Example:
    >>> d = decide(spec, 1, [0.3, 0.9, 0.5, 0.2], hparams)   # nll: member 1 is worst
    >>> d.sources.tolist()                                    # it copies member 3
    [0, 3, 2, 3]
  """
  m = len(values)
  order = rank(values, spec.higher_is_better)
  n = replaced_count(m, spec.quantile)
  finite = np.isfinite(np.asarray(values, np.float64))
  top = [int(i) for i in order[:n] if finite[i]]
  sources = np.arange(m)
  new = {f: np.array(v, np.float32) for f, v in hparams.items()}
  if not top:  # Nothing can rank (every member diverged): no one to copy from.
    return Decision(sources, new)
  for member in sorted(int(i) for i in order[m - n:]):
    rng = np.random.default_rng([spec.seed, round_index, first_member + member])
    source = top[int(rng.integers(len(top)))]
    sources[member] = source
    for field in hparams:  # Every field, each from its source; explored ones perturbed.
      value = float(hparams[field][source])
      if field in spec.rules:
        value = _explore(rng, spec.rules[field], value, spec.perturb_factors,
                         spec.resample_probability)
      new[field][member] = value
  return Decision(sources, new)


def _explore(rng: np.random.Generator, rule: FieldRule, value: float,
             factors: Sequence[float], resample_probability: float) -> float:
  resample = rng.random() < resample_probability and rule.resample
  factor = factors[int(rng.integers(len(factors)))]  # Drawn either way: a fixed draw count.
  if not resample:
    value = value * factor
  elif rule.choices:
    value = rule.choices[int(rng.integers(len(rule.choices)))]
  elif rule.log:
    value = math.exp(rng.uniform(math.log(rule.low), math.log(rule.high)))
  else:
    value = rng.uniform(rule.low, rule.high)
  return float(np.float32(_reflect(value, rule.low, rule.high)))


def _reflect(value: float, low: float, high: float) -> float:
  """`value` reflected back into [low, high] at the bound it crossed: by the same ratio for
  a positive range (perturbations multiply), else by the same distance. Clipping would
  give a source at the bound its own value, an exact clone of it."""
  if value > high:
    value = high * high / value if low > 0 else 2 * high - value
  elif value < low:
    value = low * low / value if low > 0 and value > 0 else 2 * low - value
  return min(max(value, low), high)  # A range narrower than the step: clipped after all.


def field_rule(field: str, configured: Any) -> FieldRule:
  """The explore rule of a per-member field from how it is configured: a spec's range
  (a list's or grid's values), or for a lone number just the field's legal range."""
  low, inclusive, high = hparams_lib.legal_range(field)
  legal_low = low if inclusive else float(np.finfo(np.float32).tiny)
  legal_high = math.inf if high is None else float(np.nextafter(np.float32(high), np.float32(0)))
  if isinstance(configured, str):
    name, numbers = hparams_lib.parse_spec(field, configured)
    if name == 'grid':
      return _choices(numbers, legal_low, legal_high)
    lo, hi = sorted(numbers)
    return FieldRule(max(lo, legal_low), min(hi, legal_high), (),
                     name in ('logspace', 'loguniform'), True)
  if isinstance(configured, (list, tuple)):
    return _choices([float(v) for v in configured], legal_low, legal_high)
  return FieldRule(legal_low, legal_high, (), False, False)


def _choices(values: list[float], legal_low: float, legal_high: float) -> FieldRule:
  choices = tuple(sorted(set(values)))
  return FieldRule(max(min(choices), legal_low), min(max(choices), legal_high), choices, False,
                   True)


def make_spec(*, interval: int, metric: str, quantile: float, fields: Sequence[str],
              perturb_factors: Sequence[float], resample_probability: float, seed: int,
              configured: Mapping[str, Any], varying: Sequence[str],
              select_metrics: Mapping[str, bool]) -> PbtSpec:
  """config.pbt checked and read into a PbtSpec.

  Args:
    interval ... seed: config.pbt's fields.
    configured: every per-member field as configured (a number, a list or a spec).
    varying: the per-member fields whose resolved values differ between members.
    select_metrics: {metric: higher is better} the task ranks members by.

  Raises:
    ConfigError: naming the config.pbt field and what would work.
  """
  def require(ok: bool, field: str, value: Any, what: str) -> None:
    if not ok:
      raise ConfigError(f'config.pbt.{field}={value!r} {what}.')

  number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
  require(isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1,
          'interval', interval, 'must be an int >= 1 (steps between rounds)')
  require(metric in select_metrics, 'metric', metric, f'use one of {list(select_metrics)}')
  require(number(quantile) and 0 < quantile <= 0.5, 'quantile', quantile,
          'must be a fraction in (0, 0.5], e.g. 0.25 (the worst quarter copy the best quarter)')
  require(len(perturb_factors) >= 1 and all(number(f) and f > 0 for f in perturb_factors),
          'perturb_factors', tuple(perturb_factors), 'must be numbers > 0, e.g. (0.8, 1.2)')
  require(number(resample_probability) and 0 <= resample_probability <= 1,
          'resample_probability', resample_probability, 'must be a probability in [0, 1]')
  require(isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0, 'seed', seed,
          'must be an int >= 0')
  unknown = [f for f in fields if f not in hparams_lib.FIELDS]
  require(not unknown, 'fields', tuple(fields),
          f'names fields that are not per member ({unknown}); use some of '
          f'{list(hparams_lib.FIELDS)}')
  explored = [f for f in hparams_lib.FIELDS if f in (fields or varying)]
  require(bool(explored), 'fields', tuple(fields),
          'finds nothing to explore: no per-member hyperparameter varies over the members; '
          "sweep one (e.g. --config.optim.learning_rate='loguniform(1e-4,1e-2)') or name it "
          "in pbt.fields (e.g. ('optim.learning_rate',))")
  return PbtSpec(interval, metric, bool(select_metrics[metric]), float(quantile),
                 {f: field_rule(f, configured[f]) for f in explored},
                 tuple(float(f) for f in perturb_factors), float(resample_probability), seed)
