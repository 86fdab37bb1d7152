"""The checkpoint checksums (dist_ens/io/checksums.py): on a CPU numpy computes them for
the leaves this process holds whole, with no compile, to the device program's values bit
for bit (every dtype a checkpoint holds, sharded, 0-d, empty, several chunks), so
checkpoints written by either restore with the other; a changed or moved word still
changes a sum; what numpy does not sum (a float8, a Python number) the program does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dist_ens.io import checksums
from dist_ens.parallel import once


def _device_checksum(leaf) -> int:
  """The checksum as the device program computes it (and computed before the host path)."""
  program = checksums._checksum_program(checksums._hashable(once.options_for('cpu')))
  return int(program(leaf))


def _leaves():
  """Leaves of every dtype a checkpoint holds, their bits spread over whole words
  (negative integers, high bits set, NaN and -0.0), named."""
  normal = jax.random.normal(jax.random.key(1), (37, 5))
  return {
      'float32': normal.at[0, 0].set(jnp.nan).at[0, 1].set(-0.0),
      'bfloat16': normal.astype(jnp.bfloat16),
      'float16': normal.astype(jnp.float16),
      'int32': jnp.arange(-40, 41, dtype=jnp.int32) * 53_000_001,
      'uint32': jnp.arange(50, dtype=jnp.uint32) * jnp.uint32(4_000_000_007),
      'int8': jnp.arange(-128, 128, dtype=jnp.int8),
      'uint8': jnp.arange(256, dtype=jnp.uint8),
      'bool': jnp.arange(13) % 3 == 0,
      'keys': jax.random.split(jax.random.key(2), 6),
      'raw_key': jax.random.PRNGKey(3),
      'scalar': jnp.int32(-7),
      'empty': jnp.zeros((0, 3)),
  }


def test_host_sums_are_the_device_programs_for_every_dtype(monkeypatch):
  """At the tests' -O0 and at the -O1 a run compiles the program at (once.py; on a CPU
  checksums() no longer runs it, tests/test_once.py's check included)."""
  leaves = _leaves()
  host = dict(zip(leaves, checksums.checksums(list(leaves.values())), strict=True))
  assert all(checksums._on_host(leaf) for leaf in leaves.values())
  assert host == {name: _device_checksum(leaf) for name, leaf in leaves.items()}
  monkeypatch.setenv('XLA_FLAGS', support.xla_flags(8).replace(support.LLVM_O0, ''))
  assert once.options_for('cpu') == once.ONCE_COMPILER_OPTIONS
  assert host == {name: _device_checksum(leaf) for name, leaf in leaves.items()}
  assert len({v for k, v in host.items() if k != 'empty'}) == len(leaves) - 1


def test_eight_byte_leaves_sum_as_the_device_program_does():
  """float64, int64, uint64 (with jax_enable_x64): each element two words, low first."""
  with jax.enable_x64(True):
    leaves = [jnp.linspace(-3.0, 1e300, 11, dtype=jnp.float64),
              jnp.arange(-5, 6, dtype=jnp.int64) * (2**40 + 3),
              jnp.arange(7, dtype=jnp.uint64) * jnp.uint64(2**63 + 5)]
    assert all(leaf.dtype.itemsize == 8 and checksums._on_host(leaf) for leaf in leaves)
    assert checksums.checksums(leaves) == [_device_checksum(leaf) for leaf in leaves]


def test_a_leaf_of_several_chunks_sums_as_one(monkeypatch):
  """The host sums a large leaf a chunk at a time, each chunk's factors from its offset:
  chunks of 7 words (not dividing the leaf) give the program's sum."""
  leaf = jax.random.normal(jax.random.key(4), (9, 5)).astype(jnp.bfloat16)
  whole = checksums.checksums([leaf])
  monkeypatch.setattr(checksums, '_HOST_CHUNK_WORDS', 7)
  assert checksums.checksums([leaf]) == whole == [_device_checksum(leaf)]


def test_a_sharded_leaf_sums_to_its_values_sum(devices):
  mesh = Mesh(np.array(devices).reshape(4, 2), ('member', 'data'))
  leaf = jax.random.normal(jax.random.key(2), (8, 6))
  for spec in (P('member', 'data'), P(None, 'data'), P()):  # split, split once, replicated
    sharded = jax.device_put(leaf, NamedSharding(mesh, spec))
    assert checksums._on_host(sharded)
    assert checksums.checksums([sharded]) == [_device_checksum(leaf)] == [
        _device_checksum(sharded)]


@pytest.mark.parametrize('name', ['float32', 'bfloat16', 'int8', 'bool', 'keys'])
def test_a_changed_or_moved_element_changes_the_host_sum(name):
  leaf = _leaves()[name]
  is_key = name == 'keys'
  values = np.array(jax.random.key_data(leaf) if is_key else leaf)
  as_leaf = lambda flat: (jax.random.wrap_key_data if is_key else jnp.asarray)(
      jnp.asarray(flat.reshape(values.shape)))
  changed = values.reshape(-1).copy()
  changed.view(np.uint8)[changed.itemsize * 3] ^= 1  # The lowest bit of element 3.
  moved = values.reshape(-1).copy()
  assert moved[0] != moved[1]
  moved[[0, 1]] = moved[[1, 0]]
  [original] = checksums.checksums([leaf])
  assert checksums.checksums([as_leaf(values.reshape(-1))]) == [original]
  assert checksums.checksums([as_leaf(changed)]) != [original]
  assert checksums.checksums([as_leaf(moved)]) != [original]


def test_the_host_path_compiles_nothing():
  """Shapes no program here has seen: numpy sums them without building one."""
  compiles = []

  def listen(event, duration, **kwargs):
    del duration, kwargs
    if event == '/jax/core/compile/backend_compile_duration':
      compiles.append(event)

  leaves = _leaves()
  new_shapes = [jnp.ones((3, 41, 2), leaf.dtype) if not jax.dtypes.issubdtype(
      leaf.dtype, jax.dtypes.prng_key) else jax.random.split(jax.random.key(5), 17)
                for leaf in leaves.values()]
  jax.block_until_ready(new_shapes)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    checksums.checksums(new_shapes)
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert not compiles


def test_what_numpy_does_not_sum_the_program_does():
  """A float8's widening converts its value (numpy's conversion is not known to be
  XLA's), and a Python number is an int32 to jit but an int64 to numpy: the program sums
  both, as it did before the host path."""
  float8 = jnp.linspace(-2, 2, 9).astype(jnp.float8_e4m3fn)
  assert not checksums._on_host(float8) and not checksums._on_host(7)
  assert checksums.checksums([float8, 7]) == [_device_checksum(float8),
                                               _device_checksum(jnp.int32(7))]
