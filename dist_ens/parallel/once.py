"""Programs that run once or a few times per run, compiled for a fast compile on a CPU.

XLA:CPU's default LLVM optimisation (-O2) spends seconds on the large unrolled integer
kernels of random draws (threefry) and hashes, for programs whose run time is
negligible: the init program and the checkpoint checksums. At -O1 they compile several
times faster (BENCHMARKS.md, "The init program": 1.0-7.9x) to the same bits
(tests/test_step.py and tests/test_once.py check them). Only programs whose bits -O1
keeps go here: SWAG's weight samples compiled 5x faster at -O1 but moved 7 of 48
weights by 1 ulp (its float arithmetic, not its draws), so they keep XLA's default, as
do the training step and the evaluation programs (they run many times, and their
floating-point reductions are what the cross-mesh comparisons check).
"""

import os
from typing import Any

import jax

ONCE_COMPILER_OPTIONS = {'xla_backend_optimization_level': 1}
_LEVEL_FLAG = '--xla_backend_optimization_level'


def options_for(platform: str) -> dict[str, Any] | None:
  """The compiler options of a once-run program on `platform` (None: XLA's defaults, or
  the level XLA_FLAGS sets: a level the user chose there wins, as the tests' -O0 does)."""
  if platform != 'cpu' or _LEVEL_FLAG in os.environ.get('XLA_FLAGS', ''):
    return None
  return ONCE_COMPILER_OPTIONS


def compile_once(lowered: jax.stages.Lowered, platform: str) -> jax.stages.Compiled:
  """`lowered` compiled with ONCE_COMPILER_OPTIONS on a CPU, XLA's defaults elsewhere."""
  return lowered.compile(compiler_options=options_for(platform))


def platform_of(tree: Any) -> str:
  """The platform of the first jax.Array in `tree` (none: the default backend's)."""
  first = next((a for a in jax.tree.leaves(tree) if isinstance(a, jax.Array)), None)
  return jax.default_backend() if first is None else next(iter(first.devices())).platform
