"""Programs run once per run compile at LLVM -O1 on a CPU (dist_ens/parallel/once.py) to
the bits XLA's default optimisation gives (compiled with support.XLA_DEFAULT: the
tests themselves compile at -O0): the checkpoint checksums (the init program:
tests/test_step.py)."""

import jax
import jax.numpy as jnp

import support

from dist_ens import checkpoint
from dist_ens.parallel import once


def test_checksums_compiled_once_are_xlas_default_sums():
  leaves = [jax.random.normal(jax.random.key(1), (37, 5)), jnp.arange(9, dtype=jnp.int32),
            jnp.ones((3,), jnp.bfloat16), jnp.array([True, False])]
  default = [int(c) for c in jax.jit(checkpoint._checksums).lower(leaves).compile(
      compiler_options=support.XLA_DEFAULT)(leaves)]
  assert checkpoint.checksums(leaves) == default
  assert once.options_for('cpu') == once.ONCE_COMPILER_OPTIONS and once.options_for('gpu') is None
