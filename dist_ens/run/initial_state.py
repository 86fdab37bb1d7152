"""A run's initial state: the init program compiled (once per run) and the state born
sharded, each device materialising only its own members, from config.model.init_from's
file where it names one; and what that file's headers show init would refuse, refused
before the workdir is claimed.

  state = init_sharded(run.parts)     # the train state at step 0, on the mesh
"""

from typing import Any

import jax

from dist_ens.core.state import Pretrained, TrainState
from dist_ens.io import init_from
from dist_ens.parallel import once
from dist_ens.run.assemble import Parts


# The init program runs once per run: on a CPU it compiles at LLVM -O1 (parallel/once.py:
# its random draws compile much faster there, to the same bits; BENCHMARKS.md, "The init
# program"; tests/test_step.py checks two).
INIT_COMPILER_OPTIONS = once.ONCE_COMPILER_OPTIONS


def compile_init(parts: Parts, *pretrained: Pretrained) -> jax.stages.Compiled:
  """The init program (parts.init with the state's shardings), compiled; on a CPU with
  INIT_COMPILER_OPTIONS. Given Pretrained leaves it takes them as its argument."""
  lowered = jax.jit(parts.init, out_shardings=parts.state_shardings).lower(*pretrained)
  return once.compile_once(lowered, parts.mesh.devices.flat[0].platform)


def init_sharded(parts: Parts) -> TrainState:
  """The initial state, born sharded: each device materialises only its own members,
  from config.model.init_from's leaves where it names a file (io/init_from.py). With
  joined stacks, each stack's own (its init_from, model and layout), joined."""
  return parts.places.join([_init_stack(one) for one in parts.stacks])


def _init_stack(parts: Parts) -> TrainState:
  """init_sharded of one stack."""
  pretrained = init_from.pretrained_leaves(*_init_from_args(parts), parts.mesh, parts.layout,
                                           owned=parts.method.owned,
                                           under=parts.method.wrapped_under)
  args = () if pretrained is None else (pretrained,)
  return compile_init(parts, *args)(*args)


def check_init_from(parts: Parts) -> None:
  """What config.model.init_from's file headers show that init_sharded would refuse (a
  cut file, a missing or misshapen weight), refused now: init_sharded reads the file
  only once the workdir is claimed."""
  for one in parts.stacks:
    init_from.check_pretrained(*_init_from_args(one), owned=one.method.owned,
                               under=one.method.wrapped_under)


def _init_from_args(parts: Parts) -> tuple[Any, ...]:
  """(spec, model, input shape, outputs per example) of a member's init from a file."""
  return (parts.stack.init_from, parts.model, parts.input_shape,
          parts.num_outputs * parts.method.outputs_per_output)
