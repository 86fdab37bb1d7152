"""Choosing how each device runs its members (vmap or a loop) and how many steps
one call of the compiled step runs, where the config says 'auto'.

The rule is data: for a backend and a model family, which form was fastest at
how many members per device, measured by benchmarks/throughput.py (the table and
its evidence: BENCHMARKS.md, "The 'auto' rule"). Anything not listed gets 'vmap',
the form that is never far off for matmul-bound models.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dist_ens.core.model import init_shapes
from dist_ens.core.step import MEMBER_PARALLELISM
from dist_ens.errors import ConfigError

CHOICES = MEMBER_PARALLELISM + ('auto',)

# A form: (parallelism, map_batch_size or None).
Form = tuple[str, int | None]

# (backend platform, model name) -> ((up to this many members per device, form), ...):
# the first entry whose bound is >= the members per device applies; None means any
# number. For the families MEMBER_BUDGETS covers, the fallback when the sizes are not
# known. A ResNet's members run one at a time on a CPU because that was faster than vmap and
# held far less memory per member (BENCHMARKS.md, "ResNet-20 ensembles on a CPU"); on a GPU
# vmap was the fastest form for every model and M (BENCHMARKS.md, "On a GPU").
AUTO_RULES: dict[tuple[str, str], tuple[tuple[int | None, Form], ...]] = {
    ('cpu', 'mlp'): ((4, ('vmap', None)), (None, ('map', None))),
    ('cpu', 'cnn'): ((4, ('vmap', None)), (None, ('map', None))),
    ('cpu', 'resnet'): ((1, ('vmap', None)), (None, ('map', None))),
    ('gpu', 'mlp'): ((None, ('vmap', None)),),
    ('gpu', 'cnn'): ((None, ('vmap', None)),),
}
DEFAULT_FORM: Form = ('vmap', None)


class Budgets(NamedTuple):
  """Sizes, in bytes, at which 'auto' changes form on a platform (MEMBER_BUDGETS)."""
  vmap: int  # the most member_bytes() a device's members may touch together, vmapped
  chunk: int  # the most a chunk of vmapped members may touch inside 'map'
  one_member: int  # a device's only member: 'vmap' from this many parameter bytes, else 'map'


# (platform, model name) -> Budgets, in bytes of member_bytes(), what one member's step
# touches: all of a device's members run vmapped while together they touch at most the
# vmap budget; beyond, 'map' runs chunks of the largest power of two members that touch
# at most the chunk budget (one at a time where one member is more). A device holding one
# member runs it as 'vmap' (forward and backward on its slices, the optimizer on the stored
# state: no copies of that state) once its parameters reach `one_member` bytes, and as
# 'map' (the whole step on its slices) below. Each budget sits where the fastest form
# changed on the 2-core CPU the rule was measured on (BENCHMARKS.md, "The 'auto' rule" and
# "Today's figures"): empirical constants of that machine, not cache sizes, which
# `dist-ens plan --calibrate` replaces by the user's own measurement.
MEMBER_BUDGETS: dict[tuple[str, str], Budgets] = {
    ('cpu', 'mlp'): Budgets(vmap=64 * 2**20, chunk=16 * 2**20, one_member=2**18),
    ('cpu', 'cnn'): Budgets(vmap=64 * 2**20, chunk=16 * 2**20, one_member=2**18),
}


class MemberSize(NamedTuple):
  """One member's sizes in bytes, as 'auto' reads them (member_size)."""
  step: int  # what its training step touches (member_bytes)
  params: int  # its parameters


def _abstract_forward(model, input_shape: Sequence[int], batch: int, dtype: Any = jnp.float32):
  """One member's training-mode forward pass on `batch` examples (inputs of `dtype`:
  float32, or int32 token ids), and abstract arguments."""
  x = jax.ShapeDtypeStruct((batch, *input_shape), dtype)
  key = jax.eval_shape(lambda: jax.random.key(0))  # abstract: no program compiled or run
  params, state = init_shapes(model, x)
  return lambda p, s, x, k: model.apply(p, s, x, train=True, rng=k), (params, state, x, key)


def _nbytes(avals) -> int:
  return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in avals)


def _forward_activation_bytes(fn, args) -> int:
  jaxpr = jax.make_jaxpr(fn)(*args)  # The key is an input: making it adds no equations.
  return _nbytes(v.aval for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars)


def member_bytes(model, input_shape: Sequence[int], batch: int) -> int:
  """What one member's training step touches, as 'auto' sizes it: its forward activations
  on `batch` examples (every intermediate of the traced program: no compile, nothing run)
  and 4x its parameters' bytes (the parameters, their gradients and an optimizer's two
  moments, as Adam keeps)."""
  return member_size(model, input_shape, batch).step


def member_size(model, input_shape: Sequence[int], batch: int,
                dtype: Any = jnp.float32) -> MemberSize:
  """member_bytes() and the parameters' bytes of one member, from one abstract trace."""
  fn, args = _abstract_forward(model, input_shape, batch, dtype)
  params = _nbytes(jax.tree.leaves(args[0]))
  return MemberSize(_forward_activation_bytes(fn, args) + 4 * params, params)


def forward_flops(model, input_shape: Sequence[int], batch: int,
                  dtype: Any = jnp.float32) -> float | None:
  """FLOPs of one member's forward pass on `batch` examples of `dtype` (float32, or int32
  token ids): XLA's cost analysis of the lowered program (traced and lowered, not
  compiled). None where the backend has none, or the model cannot be traced abstractly:
  a heuristic's input, never an error."""
  try:
    fn, args = _abstract_forward(model, input_shape, batch, dtype)
    cost = jax.jit(fn).lower(*args).cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  flops = (cost or {}).get('flops') if isinstance(cost, dict) else None
  return float(flops) if flops and flops > 0 else None


def auto_form(model_name: str, platform: str, members_per_device: int | None = None,
              sizes: Callable[[], MemberSize] | None = None) -> Form:
  """The form 'auto' picks: by MEMBER_BUDGETS where it has the sizes, else AUTO_RULES
  (with members_per_device unknown, the rule for the most members).

  `sizes` returns member_size() of one member's share of a device's batch; it is called
  only where MEMBER_BUDGETS applies.
  """
  budgets = MEMBER_BUDGETS.get((platform, model_name))
  if budgets and members_per_device and sizes:
    measured = sizes()
    if members_per_device == 1:
      return ('vmap' if measured.params >= budgets.one_member else 'map'), None
    size = max(1, measured.step)
    if members_per_device * size <= budgets.vmap:
      return 'vmap', None
    fit = budgets.chunk // size
    chunk = 1 << (fit.bit_length() - 1) if fit >= 1 else 1  # Largest power of 2 <= fit.
    return 'map', (chunk if chunk > 1 else None)
  for bound, form in AUTO_RULES.get((platform, model_name), ()):
    if bound is None or (members_per_device is not None and members_per_device <= bound):
      return form
  return DEFAULT_FORM


def resolve(choice: str, map_batch_size: int, model_name: str, platform: str,
            members_per_device: int | None = None,
            sizes: Callable[[], MemberSize] | None = None) -> Form:
  """(parallelism, map_batch_size) for the step, resolving 'auto' by auto_form.

  Args:
    choice: config.ensemble.member_parallelism ('vmap', 'map' or 'auto').
    map_batch_size: config.ensemble.map_batch_size (0: one member at a time).
    model_name: config.model.name.
    platform: the devices' platform ('cpu', 'gpu', 'tpu').
    members_per_device: config.num_members // mesh.member, where the rule depends
      on it; None takes the rule for the largest count.
    sizes: returns member_size() of one member's share of a device's batch; called
      only for the families MEMBER_BUDGETS sizes.

  Raises:
    ConfigError: naming config.ensemble.member_parallelism or map_batch_size.
  """
  if not isinstance(choice, str) or choice not in CHOICES:
    raise ConfigError(f'config.ensemble.member_parallelism={choice!r}; use one of {list(CHOICES)}.')
  chunk = map_batch_size
  if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
    raise ConfigError(f'config.ensemble.map_batch_size={chunk!r} must be an int >= 0 (0: one '
                      'member at a time).')
  if choice == 'auto':
    return auto_form(model_name, platform, members_per_device, sizes)
  return choice, (chunk or None)


# train.steps_per_call = 0 ('auto'): the most steps per call up to this many, since one
# dispatch per K steps pays most where the host bounds a step (BENCHMARKS.md,
# "`train.steps_per_call`: the host's share"), while K batches of input stay under
# AUTO_INPUT_BYTES and, on a CPU, K steps' work under AUTO_CPU_CALL_FLOPS.
AUTO_MAX_STEPS_PER_CALL = 100
AUTO_INPUT_BYTES = 64 * 2**20
# On a CPU, the training FLOPs a call of K steps may hold per device: enough that the host's
# work per call (a batch transfer, a dispatch, the loop's bookkeeping) is a small share of
# it (BENCHMARKS.md, "End-to-end overhead"), few enough that a signal or a log line waits
# well under a second (the arithmetic: benchmarks/HISTORY.md, "Figures that lived in code
# comments").
AUTO_CPU_CALL_FLOPS = 1e10


def steps_per_call(chosen: int, cadences: Sequence[int], platform: str,
                   input_bytes_per_step: int = 0,
                   step_flops: Callable[[], float | None] | None = None) -> int:
  """config.train.steps_per_call (`chosen`), with 0 ('auto') resolved.

  'auto' is the largest K <= AUTO_MAX_STEPS_PER_CALL that divides every cadence the
  loop stops at (`cadences`: train.steps, log_every, eval_every, checkpoint.every, the
  step a run resumes from and a user's periodic actions; 0 adds nothing), and whose K
  batches of
  input (input_bytes_per_step each) stay under AUTO_INPUT_BYTES. On a CPU, where a
  step can take seconds, K steps must also hold at most AUTO_CPU_CALL_FLOPS
  (`step_flops()`: a step's training FLOPs per device, asked only when the cadence
  allows K > 1; unknown: K = 1).
  """
  if chosen:
    return chosen
  cadence = 0
  for every in cadences:
    cadence = math.gcd(cadence, every)  # gcd(x, 0) = x: an eval_every of 0 adds nothing.
  largest = lambda bound: max(k for k in range(1, max(bound, 1) + 1) if cadence % k == 0)
  k = largest(min(AUTO_MAX_STEPS_PER_CALL, AUTO_INPUT_BYTES // max(input_bytes_per_step, 1)))
  if platform == 'cpu' and k > 1:
    flops = step_flops() if step_flops else None
    k = largest(min(k, int(AUTO_CPU_CALL_FLOPS // flops) if flops else 1))
  return k
