"""Programs run once per run compile at LLVM -O1 on a CPU (dist_ens/parallel/once.py) to
the bits XLA's default optimisation gives (compiled with support.XLA_DEFAULT: the
tests themselves compile at -O0, a level set in XLA_FLAGS, which once-run programs then
keep): the checkpoint checksums' device program, which accelerators and leaves spread over
processes run (the init program: tests/test_step.py)."""

import jax
import jax.numpy as jnp
import numpy as np

import support

from dist_ens.io import checksums
from dist_ens.parallel import once


def _leaves():
  return [jax.random.normal(jax.random.key(1), (37, 5)), jnp.arange(9, dtype=jnp.int32),
          jnp.ones((3,), jnp.bfloat16), jnp.array([True, False]),
          jnp.arange(6, dtype=jnp.uint8)]


def _numpy_checksum(leaf) -> int:
  """The saved format's sum, by hand: the leaf's bytes as uint32 words (1- and 2-byte
  elements widened to a word each), each times (2654435761 * position) | 1, mod 2**32."""
  a = np.asarray(leaf)
  words = (a.astype(np.uint32) if a.itemsize == 1 else
           a.view(np.uint16).astype(np.uint32) if a.itemsize == 2 else a.view(np.uint32))
  words = words.ravel().astype(np.uint64)
  factors = (np.arange(words.size, dtype=np.uint64) * 2654435761 % 2**32) | 1
  return int(np.sum(words * factors % 2**32) % 2**32)


def _device_checksums(leaves) -> list[int]:
  """The device program's sums (an accelerator's, or a leaf spread over processes), at the
  level once.options_for picks now."""
  program = checksums._checksum_program(checksums._hashable(once.options_for('cpu')))
  return [int(program(leaf)) for leaf in leaves]


def test_checksums_are_the_saved_formats_sums_at_every_optimisation_level(monkeypatch):
  leaves = _leaves()
  expected = [_numpy_checksum(leaf) for leaf in leaves]
  assert len(set(expected)) == len(expected)
  assert checksums.checksums(leaves) == expected  # On a CPU numpy's (test_checksums).
  assert _device_checksums(leaves) == expected  # The tests' -O0, from XLA_FLAGS.
  monkeypatch.setenv('XLA_FLAGS', support.xla_flags(8).replace(support.LLVM_O0, ''))
  assert _device_checksums(leaves) == expected  # -O1, once.ONCE_COMPILER_OPTIONS.
  default = [int(jax.jit(checksums._checksum).lower(leaf).compile(
      compiler_options=support.XLA_DEFAULT)(leaf)) for leaf in leaves]
  assert default == expected


def test_checksums_of_a_sharded_leaf_are_those_of_its_values(devices):
  mesh = jax.sharding.Mesh(np.array(devices).reshape(4, 2), ('member', 'data'))
  leaf = jax.random.normal(jax.random.key(2), (8, 6))
  sharded = jax.device_put(leaf, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec('member', 'data')))
  assert checksums.checksums({'a': sharded}) == [_numpy_checksum(leaf)]
  moved = leaf.at[3, 1].set(leaf[1, 3])
  assert checksums.checksums([moved]) != [_numpy_checksum(leaf)]


def test_a_level_set_in_xla_flags_wins_over_the_once_options(monkeypatch):
  assert once.options_for('gpu') is None
  assert once.options_for('cpu') is None  # The tests' XLA_FLAGS hold -O0.
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  assert once.options_for('cpu') == once.ONCE_COMPILER_OPTIONS
  monkeypatch.delenv('XLA_FLAGS')
  assert once.options_for('cpu') == once.ONCE_COMPILER_OPTIONS
