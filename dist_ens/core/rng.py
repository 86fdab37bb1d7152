"""Where every random number comes from: (seed, member), then step and example.

Member i's keys never depend on M, the mesh or the process count:
  init         fold_in(key(seed), i)                      (member_keys)
  fresh leaves fold_in(fold_in(key(seed), i), FRESH)       beside init_from's (fresh_keys)
  training     fold_in(fold_in(fold_in(key(seed), i), TRAIN), step)   (train_key)
and a per-example draw (augmentation) folds the example's global index into the
training key. jax's default threefry is partitionable, so a draw of a global
shape gives the same bits however the array is sharded.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp

# Stream tag that keeps training draws apart from the init key's own splits.
_TRAIN = 1
# Stream tag of the leaves a run initialises beside loaded ones (config.model.init_from):
# a pretraining run with the same seed drew its own from member i's init key itself.
_FRESH = 5


def member_keys(seed: int, members: Sequence[int] | jax.Array) -> jax.Array:
  """Per-member PRNG keys: member i's key is fold_in(key(seed), i), whatever M is."""
  base = jax.random.key(seed)
  return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(members, jnp.uint32))


def fresh_keys(keys: jax.Array) -> jax.Array:
  """The init keys of leaves started fresh beside loaded ones, from the members' keys:
  apart from what a run without init_from (a pretraining run) drew from those keys."""
  return jax.vmap(lambda key: jax.random.fold_in(key, _FRESH))(keys)


def train_key(seed: int, member: jax.Array, step: jax.Array) -> jax.Array:
  """The key of member `member`'s stochastic layers at training step `step`."""
  key = jax.random.fold_in(jax.random.key(seed), jnp.asarray(member, jnp.uint32))
  return jax.random.fold_in(jax.random.fold_in(key, _TRAIN), jnp.asarray(step, jnp.uint32))
