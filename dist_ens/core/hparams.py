"""Per-member hyperparameters: scalars, lists and sweep specs, resolved to [M] arrays.

A hyperparameter field of the config may hold
  * a number: every member gets it;
  * a list of M numbers: member i gets the i-th;
  * a spec string, expanded here for M = num_members:
      'linspace(lo, hi)', 'logspace(lo, hi)'   evenly spaced (log-spaced) from lo to hi;
      'uniform(lo, hi)', 'loguniform(lo, hi)'  random; member i's draw depends only on
                                               (seed, field, i), never on M;
      'grid(v1, v2, ...)'                      one axis of a grid: all fields given as
                                               grid(...) form their cartesian product (the
                                               field listed first in FIELDS varies slowest),
                                               and M must equal its size.
On the command line: --config.optim.learning_rate='[0.001,0.002]' or
--config.optim.learning_rate='loguniform(1e-4,1e-2)'.

The resolved values are ONE pytree, {field: [M] float32}, sharded over 'member' like
the state and handed to the train step; inside its vmap every consumer reads its
member's scalar from the same dict: the optimizer (optim.*, core/optim.py), the loss
(train.label_smoothing, core/losses.py) and init (model.init_scale, core/state.py).
Adding a per-member hyperparameter is one entry in FIELDS (plus its config field)
and a read of hparams['section.name'] where it is used. resolve takes an HparamsSpec,
those fields as configured (dist_ens.config.specs.hparams_spec reads them).
"""

import ast
import itertools
import math
import re
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np


# Fields that may vary per member, with the lowest value each accepts and whether
# that bound is inclusive.
FIELDS: dict[str, tuple[float, bool]] = {
    'optim.learning_rate': (0.0, False),
    'optim.weight_decay': (0.0, True),
    'optim.b1': (0.0, True),
    'optim.momentum': (0.0, True),
    'train.label_smoothing': (0.0, True),
    'model.init_scale': (0.0, False),
}
# Upper bounds (exclusive) where a field has one.
_UPPER = {'optim.b1': 1.0, 'optim.momentum': 1.0, 'train.label_smoothing': 1.0}

_SPEC = re.compile(r'^\s*(\w+)\s*\((.*)\)\s*$')
_RANDOM = ('uniform', 'loguniform')
_SPACED = ('linspace', 'logspace')


class HparamsError(ValueError):
  """A per-member field's value that cannot be resolved. The message starts with the field
  as FIELDS names it ('optim.learning_rate=...') or with num_members; the edge that built
  the HparamsSpec from a config says it as the config's field (config.specs.resolve_hparams).
  """

  def __init__(self, field: str, message: str):
    super().__init__(message)
    self.field = field


class HparamsSpec(NamedTuple):
  """What resolve reads: the ensemble's size, the seed that random specs draw from, and
  each of FIELDS ('section.name') as configured (a number, a list or a spec string)."""
  num_members: int  # config.num_members: M, the length of every resolved array
  seed: int  # config.seed: uniform/loguniform draw from (seed, field, member)
  fields: Mapping[str, Any]  # {'optim.learning_rate': 1e-3, ...}, every key of FIELDS


def _parse_spec(field: str, value: str) -> tuple[str, list[float]]:
  match = _SPEC.match(value)
  if not match:
    raise HparamsError(
        field, f'{field}={value!r} is not a number, a list of numbers or a sweep spec; use '
        "e.g. 1e-3, '[1e-3,3e-3]', 'logspace(1e-4,1e-2)', 'loguniform(1e-4,1e-2)' or "
        "'grid(1e-3,3e-3)'.")
  name, args = match.group(1), match.group(2)
  if name not in _RANDOM + _SPACED + ('grid',):
    raise HparamsError(field, f'{field}={value!r}: unknown spec {name!r}; use one of '
                       f'{list(_SPACED + _RANDOM + ("grid",))}.')
  try:
    parsed = ast.literal_eval(f'({args},)') if args.strip() else ()
    numbers = [float(a) for a in parsed]
  except (ValueError, SyntaxError, TypeError):
    raise HparamsError(field, f'{field}={value!r}: the arguments of {name}(...) must be '
                       'numbers.') from None
  if name != 'grid' and len(numbers) != 2:
    raise HparamsError(field, f'{field}={value!r}: {name} takes two numbers, (lo, hi).')
  if name == 'grid' and not numbers:
    raise HparamsError(field, f'{field}={value!r}: grid(...) needs at least one value.')
  if name in ('logspace', 'loguniform') and min(numbers) <= 0:
    raise HparamsError(field, f'{field}={value!r}: {name} needs lo and hi > 0.')
  return name, numbers


def parse_spec(field: str, value: str) -> tuple[str, list[float]]:
  """A sweep spec string as (its name, its numbers), e.g. ('loguniform', [1e-4, 1e-2]);
  population-based training explores within it (dist_ens/ensembles/pbt.py).

  Raises:
    HparamsError: naming the field, for a string that is not a known spec.
  """
  return _parse_spec(field, value)


def legal_range(field: str) -> tuple[float, bool, float | None]:
  """(lowest value, whether it is allowed, exclusive upper bound or None) of one of FIELDS."""
  low, inclusive = FIELDS[field]
  return low, inclusive, _UPPER.get(field)


def _member_uniform(seed: int, field: str, num_members: int) -> np.ndarray:
  """u in [0, 1) for each member, from (seed, field, member) only."""
  field_id = zlib.crc32(field.encode())
  return np.array([np.random.default_rng([seed, field_id, i]).random() for i in range(num_members)])


def float32_normal(values: Any) -> bool:
  """Whether every value survives float32: finite, and 0 or of normal size (a 1e-300
  learning rate would silently become 0, a 1e300 one infinity)."""
  values = np.abs(np.asarray(values, np.float64))
  tiny, big = np.finfo(np.float32).tiny, np.finfo(np.float32).max
  return bool(np.all(np.isfinite(values) & ((values == 0) | ((values >= tiny) & (values <= big)))))


def _check_range(field: str, values: np.ndarray, shown: Any) -> None:
  low, inclusive = FIELDS[field]
  if not float32_normal(values):
    raise HparamsError(field, f'{field}={shown!r}: every value must be 0 or between '
                       f'{np.finfo(np.float32).tiny:.2g} and {np.finfo(np.float32).max:.2g} in '
                       'size (members train in float32).')
  ok = np.all(np.isfinite(values)) and (np.all(values >= low) if inclusive else np.all(values > low))
  high = _UPPER.get(field)
  if high is not None:
    ok = ok and np.all(values < high)
  if not ok:
    bound = f'{">=" if inclusive else ">"} {low}' + (f' and < {high}' if high is not None else '')
    raise HparamsError(field, f'{field}={shown!r}: every value must be finite and {bound}.')


def as_written(values: np.ndarray) -> list[float]:
  """float32 values as the shortest decimals that round to them (0.001, not
  0.0010000000474974513), for results files and tables."""
  return [float(str(v)) for v in np.asarray(values, np.float32).reshape(-1)]


def resolve(spec: HparamsSpec) -> dict[str, np.ndarray]:
  """Each of FIELDS as a float32 array [spec.num_members], sweep specs expanded.

  Raises:
    HparamsError: naming the field, for a value that is not a number, a list of M
      numbers or a known spec, for out-of-range values, or for a grid whose size
      is not num_members.
  """
  m, seed = spec.num_members, spec.seed
  values: dict[str, np.ndarray] = {}
  grids: dict[str, list[float]] = {}
  for field in FIELDS:
    value = spec.fields[field]
    if isinstance(value, bool):
      raise HparamsError(field, f'{field}={value!r} must be a number, not a bool.')
    if isinstance(value, (int, float)):
      values[field] = np.full(m, float(value))
    elif isinstance(value, (list, tuple)):
      if len(value) != m or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                    for v in value):
        raise HparamsError(
            field, f'{field} has {len(value)} values {list(value)!r}; a per-member list needs '
            f'exactly num_members={m} numbers.')
      values[field] = np.asarray(value, float)
    elif isinstance(value, str):
      name, args = _parse_spec(field, value)
      if name == 'grid':
        grids[field] = args
        continue
      lo, hi = args
      if name == 'linspace':
        values[field] = np.linspace(lo, hi, m)
      elif name == 'logspace':
        values[field] = np.geomspace(lo, hi, m)
      elif name == 'uniform':
        values[field] = lo + (hi - lo) * _member_uniform(seed, field, m)
      else:
        values[field] = np.exp(math.log(lo) + (math.log(hi) - math.log(lo))
                               * _member_uniform(seed, field, m))
    else:
      raise HparamsError(field, f'{field}={value!r} ({type(value).__name__}) must be a number, '
                         f'a list of num_members={m} numbers, or a sweep spec string.')
    _check_range(field, values[field], value)
  if grids:
    size = math.prod(len(v) for v in grids.values())
    if size != m:
      shape = ' x '.join(f'{len(v)} ({f})' for f, v in grids.items())
      raise HparamsError('num_members', f'num_members={m}: the grid over {", ".join(grids)} '
                         f'has {shape} = {size} points; set num_members={size}.')
    for field, column in zip(grids, zip(*itertools.product(*grids.values()))):
      values[field] = np.asarray(column, float)
      _check_range(field, values[field], spec.fields[field])
  return {f: values[f].astype(np.float32) for f in FIELDS}


def varying(resolved: dict[str, np.ndarray]) -> list[str]:
  """The fields whose value is not the same for every member."""
  return [f for f, v in resolved.items() if np.unique(v).size > 1]
