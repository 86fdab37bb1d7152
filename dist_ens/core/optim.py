"""Optimizers from an OptimSpec (config.optim), built per member from that member's
hyperparameters.

`make_optimizer(spec, steps)` returns `optimizer(hparams) -> GradientTransformation`
for ONE member. The train step calls it inside its vmap over members with each
member's own (traced) learning rate, weight decay, b1 or momentum, taken from the
per-member hyperparameters (dist_ens.core.hparams): a sweep over them is data in
one compiled program, not a recompile, and the optimizer state holds only what
the optimizer itself keeps (moments, counts).
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dist_ens import importing
from dist_ens.core.model import is_kernel


class SpecError(ValueError):
  """A field of an OptimSpec that cannot be used: `field`, its `value` and what would work.
  The edge that built the spec from a config (run/assemble.py) says it as the config's
  field; core names only its own spec's fields."""

  def __init__(self, field: str, value: Any, remedy: str):
    super().__init__(f'{field}={value!r}; {remedy}.')
    self.field, self.value, self.remedy = field, value, remedy

SCHEDULES = ('constant', 'cosine', 'linear', 'step')
Hparams = Mapping[str, Any]
Optimizer = Callable[[Hparams | None], optax.GradientTransformation]
# A per-member field as configured: a number, a list of num_members numbers or a sweep
# spec string (core/hparams.py resolves it; the optimizer reads the member's value).
PerMember = float | tuple[float, ...] | list[float] | str


class OptimSpec(NamedTuple):
  """config.optim: every field the optimizer and its schedule read (configs/default.py
  documents each, and holds them all; dist_ens.config.specs.optim_spec reads them).

  learning_rate, weight_decay, b1 and momentum are per-member fields, held as
  configured; the optimizer takes each member's own value from its hyperparameters and
  falls back to the spec's only where that is one number. warmup_steps is in steps
  (config.checks.resolve_epochs turns optim.warmup_epochs into it first).
  """
  name: str  # 'adam', 'sgd', or your own by import path
  learning_rate: PerMember  # peak learning rate
  weight_decay: PerMember  # decoupled: each step subtracts lr * weight_decay * w
  b1: PerMember  # adam
  momentum: PerMember  # sgd; exactly 0 (for every member) is plain SGD
  b2: float  # adam
  eps: float  # adam
  nesterov: bool  # sgd
  grad_clip_norm: float  # global-norm clipping; 0 = none
  decay_mask: str  # which leaves decay: a key of DECAY_MASKS
  schedule: str  # a name in SCHEDULES, or your own by import path
  warmup_steps: int  # linear warm-up from 0 to the peak
  decay_boundaries: tuple[float, ...]  # schedule='step': fractions of the run's steps
  decay_factor: float  # schedule='step': the multiplier at each boundary


# Weight decay is decoupled for every optimizer (Loshchilov & Hutter): each step
# subtracts learning_rate * weight_decay * w from every decayed weight, outside
# momentum and Adam's scaling (AdamW; for SGD, SGDW). Which leaves decay is
# config.optim.decay_mask: 'kernels' (configs/default.py's: weight matrices and convolution
# kernels, core.model.is_kernel; no biases, no normalisation scales) or 'all'.
DECAY_MASKS = {
    'kernels': lambda params: jax.tree.map(is_kernel, params),
    'all': lambda params: jax.tree.map(lambda p: True, params),
}


def _adam(spec: OptimSpec, hp: dict[str, Any]) -> optax.GradientTransformation:
  # With weight_decay=0 this is Adam.
  return optax.adamw(hp['learning_rate'], b1=hp['b1'], b2=spec.b2, eps=spec.eps,
                     weight_decay=hp['weight_decay'], mask=_decay_mask(spec))


def _sgd(spec: OptimSpec, hp: dict[str, Any]) -> optax.GradientTransformation:
  # A momentum of exactly 0 for every member is plain SGD; anything else (including
  # per-member values) keeps a momentum trace.
  plain = isinstance(spec.momentum, (int, float)) and spec.momentum == 0
  parts = [] if plain else [optax.trace(hp['momentum'], nesterov=spec.nesterov)]
  return optax.chain(*parts, optax.add_decayed_weights(hp['weight_decay'], _decay_mask(spec)),
                     optax.scale_by_learning_rate(hp['learning_rate']))


def _decay_mask(spec: OptimSpec):
  name = spec.decay_mask
  if name not in DECAY_MASKS:
    raise SpecError('decay_mask', name, f'use one of {sorted(DECAY_MASKS)}')
  return DECAY_MASKS[name]


# name -> (builder(spec, values) -> GradientTransformation, the fields it takes per
#          member, read from the hyperparameters as 'optim.<field>').
OPTIMIZERS: dict[str, tuple[Callable[[OptimSpec, dict[str, Any]], optax.GradientTransformation],
                            tuple[str, ...]]] = {
    'adam': (_adam, ('learning_rate', 'weight_decay', 'b1')),
    'sgd': (_sgd, ('learning_rate', 'weight_decay', 'momentum')),
}


def _step_decay(spec: OptimSpec, total_steps: int, warmup: int) -> optax.Schedule:
  """Piecewise constant: x decay_factor at each of decay_boundaries, fractions of
  train.steps (0.3, 0.6, 0.8 = epochs 60/120/160 of 200). Fractions, not steps or
  epochs, so that one recipe holds whether the run's length is given in steps or
  epochs, and a shorter run keeps the shape."""
  boundaries, factor = tuple(spec.decay_boundaries), spec.decay_factor
  if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < 1
             for b in boundaries) or list(boundaries) != sorted(set(boundaries)):
    raise SpecError('decay_boundaries', boundaries, 'use increasing fractions of the run\'s '
                    'steps in (0, 1), e.g. (0.3, 0.6, 0.8) for epochs 60/120/160 of 200')
  if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
    raise SpecError('decay_factor', factor, 'use a number in (0, 1], e.g. 0.2')
  # The decay part of a schedule counts its steps from the end of warm-up; a boundary
  # is a step of the whole run, so shift it (one inside warm-up acts at its end).
  steps = [max(round(b * total_steps) - warmup, 0) for b in boundaries]
  scales: dict[int, float] = {}
  for step in steps:
    scales[step] = scales.get(step, 1.0) * factor
  return optax.piecewise_constant_schedule(1.0, scales)


def schedule(spec: OptimSpec, total_steps: int) -> optax.Schedule:
  """Multiplier of the learning rate over steps: linear warmup (spec.warmup_steps), then
  the decay named by `spec.schedule` (or your own, 'my_pkg.sched:fn' with fn(step) ->
  multiplier). It multiplies the member's own (peak) learning rate.

  'step' multiplies by spec.decay_factor at each of spec.decay_boundaries (fractions of
  total_steps); 'cosine' with warmup_steps > 0 is warm-up then cosine.

  Example:
    >>> spec = specs.optim_spec(config)._replace(schedule='step', warmup_steps=0,
    ...     decay_boundaries=(0.3, 0.6, 0.8), decay_factor=0.2)
    >>> round(float(schedule(spec, total_steps=200)(130)), 6)  # past step 120: 0.2 ** 2
    0.04
  """
  warmup = int(spec.warmup_steps)
  name = spec.schedule
  decay = _named_schedule(name)
  if not 0 <= warmup <= total_steps:
    raise SpecError('warmup_steps', warmup,
                    f'use a number of steps in [0, {total_steps}], the run\'s')
  decay_steps = max(total_steps - warmup, 1)
  if name == 'step':
    decay = _step_decay(spec, total_steps, warmup)
  elif name in SCHEDULES:
    decay = {
        'constant': optax.constant_schedule(1.0),
        'cosine': optax.cosine_decay_schedule(1.0, decay_steps),
        'linear': optax.linear_schedule(1.0, 0.0, decay_steps),
    }[name]
  if warmup == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, 1.0, warmup), decay], [warmup])


def _named_schedule(name: str) -> Any:
  """Your schedule function for an import path, None for a built-in name; SpecError for
  a name that is neither."""
  if importing.is_import_path(name):
    return _user_object('schedule', name)
  if name not in SCHEDULES:
    raise SpecError('schedule', name, f'use one of {SCHEDULES}')
  return None


def check_names(spec: OptimSpec) -> None:
  """Raises SpecError unless spec.name and spec.schedule name an optimizer and a schedule
  that exist: built in, or an import path that loads (the user's module is imported)."""
  _builder(spec.name)
  _named_schedule(spec.schedule)


def _member_values(spec: OptimSpec, fields: tuple[str, ...],
                   hp: Hparams | None) -> dict[str, Any]:
  """Each field's value for this member: from `hp` ('optim.<field>'), else the spec's number."""
  values = {}
  for field in fields:
    key, configured = f'optim.{field}', getattr(spec, field)
    if hp is not None and key in hp:
      values[field] = hp[key]
    elif isinstance(configured, (int, float)):
      values[field] = configured
    else:
      raise ValueError(f'{field} holds per-member values; pass this member\'s '
                       f'hyperparameters (with {key!r}) to the optimizer.')
  return values


def _user_object(field: str, path: str) -> Any:
  """The object at the import path a field of the spec holds; one that does not load is
  refused as that field."""
  try:
    return importing.load_object(path, field)
  except importing.ImportPathError as e:
    raise SpecError(field, path, e.reason.rstrip('.')) from None


def _builder(name: str):
  """(builder(spec, values) -> GradientTransformation, per-member fields) of a
  built-in optimizer, or of yours: 'my_pkg.opt:make' with make(values) ->
  GradientTransformation, values this member's {learning_rate, weight_decay, b1,
  momentum}."""
  if importing.is_import_path(name):
    make = _user_object('name', name)
    return (lambda spec, values: make(values)), ('learning_rate', 'weight_decay', 'b1',
                                                   'momentum')
  if name not in OPTIMIZERS:
    raise SpecError('name', name, f'use one of {sorted(OPTIMIZERS)}, or your own by import '
                    "path, 'my_pkg.opt:make_optimizer'")
  return OPTIMIZERS[name]


def _cyclic(one_cycle, before, cycle: int, cycles_from: int, cycle_rate: float):
  """`before` for the first `cycles_from` steps, then `one_cycle` restarting every
  `cycle` steps, scaled by `cycle_rate`."""

  def multiplier(count):
    cyclic = cycle_rate * one_cycle(jnp.maximum(count - cycles_from, 0) % cycle)
    return jnp.where(count < cycles_from, before(count), cyclic) if cycles_from else cyclic

  return multiplier


def make_optimizer(spec: OptimSpec, total_steps: int, cycles: int = 1, cycles_from: int = 0,
                   cycle_rate: float = 1.0) -> Optimizer:
  """`optimizer(hparams) -> GradientTransformation` for ONE member; vmap its use over members.

  Chain: optional global-norm clipping -> the named optimizer, with this member's
  per-member fields from `hparams` -> the learning-rate schedule multiplier. With
  `cycles` > 1 (snapshot ensembles; dist_ens.ensembles.methods) the schedule runs
  over the first `cycles_from` steps, then restarts `cycles` times over the rest,
  each cycle's peak `cycle_rate` times the configured one (fast geometric
  ensembling's short, low-rate cycles). The structure of the optimizer state never
  depends on the values, so one member's state layout is every member's.

  Example:
    >>> optimizer = make_optimizer(specs.optim_spec(config), total_steps=10)
    >>> tx = optimizer({'optim.learning_rate': 0.5, ...})  # this member's values

  Raises:
    SpecError: naming the spec's field (name, schedule, ...) for a value it cannot take.
  """
  build, fields = _builder(spec.name)
  _decay_mask(spec)  # Validates the field before anything is built.
  multiplier = None
  cycle = (total_steps - cycles_from) // cycles
  if spec.schedule != 'constant' or spec.warmup_steps:
    multiplier = schedule(spec, cycle)
    if cycles > 1:
      multiplier = _cyclic(multiplier, schedule(spec, max(cycles_from, 1)), cycle,
                           cycles_from, cycle_rate)
  else:
    schedule(spec, cycle)  # Validates the fields either way.

  def optimizer(hp: Hparams | None = None) -> optax.GradientTransformation:
    parts = []
    if spec.grad_clip_norm:
      parts.append(optax.clip_by_global_norm(spec.grad_clip_norm))
    parts.append(build(spec, _member_values(spec, fields, hp)))
    if multiplier is not None:
      parts.append(optax.scale_by_schedule(multiplier))
    return optax.chain(*parts) if len(parts) > 1 else parts[0]

  return optimizer
