"""Member orders as pure functions of (seed, member, epoch): data.pipeline.Order and
data/orders.py.

The properties the mutation run (docs/testing.md, "Mutation kill rates") found unchecked:
where a saved end-of-epoch position resumes, that pooled orders are drawn from the seed,
that a bootstrap resample can draw every example, and the largest batch allowed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dist_ens.data import orders
from dist_ens.data.pipeline import MEMBER_ORDERS, IteratorState, Order


def _epoch(order: Order, epoch: int, members: range) -> np.ndarray:
  """[members, examples of the epoch] in batch order."""
  batches = [order.indices(IteratorState(epoch, i), members)
             for i in range(order.batches_per_epoch)]
  return np.concatenate(batches, axis=-1)


def test_a_position_saved_at_an_epochs_end_resumes_at_the_next_epochs_start():
  order = Order('shared', 10, 3, seed=0)  # 3 batches an epoch, the last example dropped
  assert order.batches_per_epoch == 3
  assert order.normalize(IteratorState(2, 3)) == IteratorState(3, 0)
  assert order.normalize(IteratorState(2, 4)) == IteratorState(3, 0)
  for inside in (IteratorState(0, 0), IteratorState(2, 2)):
    assert order.normalize(inside) == inside
  # advance rolls over at the same place, so a normalised state is the next batch's.
  assert order.advance(IteratorState(2, 2)) == IteratorState(3, 0)


def test_the_largest_batch_is_one_epoch():
  assert Order('shuffled', 4, 4, seed=0).batches_per_epoch == 1
  with pytest.raises(ValueError, match='batch_size=5 exceeds the 4 training examples'):
    Order('shuffled', 4, 5, seed=0)
  with pytest.raises(ValueError, match="of a member's pool"):
    Order('shuffled', 8, 4, seed=0, pools=[np.arange(3), np.arange(3, 8)], member_pool=[0, 1])


@pytest.mark.parametrize('kind', MEMBER_ORDERS)
@pytest.mark.parametrize('pooled', [False, True])
def test_every_order_is_drawn_from_the_seed_alone(kind, pooled):
  pools = dict(pools=[np.arange(0, 12), np.arange(12, 24)], member_pool=[0, 1, 0, 1])
  make = lambda seed: Order(kind, 24, 4, seed, **(pools if pooled else {}))
  members = range(4)
  for epoch in (0, 3):
    first, again = make(7), make(7)  # two objects: nothing carried between them
    np.testing.assert_array_equal(first.indices(IteratorState(epoch, 1), members),
                                  again.indices(IteratorState(epoch, 1), members))
  assert not np.array_equal(_epoch(make(7), 0, members), _epoch(make(8), 0, members))
  if pooled:  # each member draws only from its own pool
    rows = _epoch(make(7), 0, members)
    assert (rows[[0, 2]] < 12).all() and (rows[[1, 3]] >= 12).all()


@pytest.mark.parametrize('pooled', [False, True])
def test_a_bootstrap_bag_can_hold_every_example_and_stays_the_members_across_epochs(pooled):
  n = 5
  pools = dict(pools=[np.arange(n)], member_pool=[0] * 64) if pooled else {}
  order = Order('bootstrap', n, n, seed=3, **pools)
  members = range(64)
  bags = _epoch(order, 0, members)
  # 64 resamples of 5: every example, the first and the last included, is drawn.
  assert set(bags.ravel().tolist()) == set(range(n))
  # A member's bag is drawn once: each epoch visits the same multiset in a new order.
  later = _epoch(order, 1, members)
  np.testing.assert_array_equal(np.sort(bags, axis=1), np.sort(later, axis=1))
  assert not np.array_equal(bags, later)


_U32 = 0xFFFFFFFF


def _lowbias32(h: int) -> int:
  """data/orders.py's mixing function, in Python integers."""
  h ^= h >> 16
  h = (h * 0x7FEB352D) & _U32
  h ^= h >> 15
  h = (h * 0x846CA68B) & _U32
  return h ^ (h >> 16)


def _documented(kind: str, seed: int, member: int, epoch: int, n: int) -> list[int]:
  """The orders as data/orders.py's docstring defines them, one Python int at a time."""
  absorb = lambda h, word: _lowbias32(h ^ _lowbias32((word + 0x9E3779B9) & _U32))

  def key(stream, epoch):
    h = 0
    for word in (seed & _U32, seed >> 32, stream, member, epoch):
      h = absorb(h, word)
    return h

  position = [_lowbias32((j + 0x9E3779B9) & _U32) for j in range(n)]
  hashes = lambda k: [_lowbias32(k ^ p) for p in position]
  stream = orders.SHUFFLED if kind == 'shuffled' else orders.BOOTSTRAP_ORDER
  by_hash = hashes(key(stream, epoch))
  permutation = sorted(range(n), key=lambda j: (by_hash[j], j))
  if kind == 'shuffled':
    return permutation
  bag = [h % n for h in hashes(key(orders.BOOTSTRAP_DRAW, 0))]
  return [bag[j] for j in permutation]


@pytest.mark.parametrize('kind', ['shuffled', 'bootstrap'])
def test_member_orders_are_the_documented_draws_for_any_block_and_epoch_sequence(kind):
  """Each member's rows are the documented hashes' sort for (seed, member, epoch) alone,
  whichever block of members asks (a process asks for its own) and in whatever order the
  epochs are read (a resume may go back to an epoch the cache has dropped)."""
  n, b, seed = 24, 4, 2 ** 33 + 7  # a seed over 32 bits: both its words count
  order = Order(kind, n, b, seed)
  for epoch, index, members in [(0, 0, range(4)), (0, 5, range(1, 3)), (1, 2, range(4)),
                                (3, 1, range(2, 4)), (0, 3, range(4))]:
    got = order.indices(IteratorState(epoch, index), members)
    want = [_documented(kind, seed, m, epoch, n)[index * b:(index + 1) * b] for m in members]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize('kind', ['shuffled', 'bootstrap'])
def test_the_devices_derive_the_hosts_orders_bit_for_bit(kind):
  """orders.device_block (XLA's integer arithmetic and sort, what resident data runs) gives
  orders.host_block's indices (numpy's) for any members, epoch and seed."""
  members, n = np.arange(3, 11), 1000
  derive = jax.jit(functools.partial(orders.device_block, kind), static_argnums=(0, 3))
  for seed, epoch in [(0, 0), (7, 5), (2 ** 40 + 3, 2 ** 20)]:
    want = orders.host_block(kind, seed, members, epoch, n)
    got = derive(seed, jnp.asarray(members), jnp.int32(epoch), n)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_a_shuffled_order_is_a_uniform_permutation_independent_across_members():
  """The hashes shuffle well enough: over 4,000 members each row is a permutation, where
  example 0 lands is uniform over the 20 positions (chi-square), and two members' orders
  are uncorrelated."""
  n, count = 20, 4000
  rows = orders.host_block('shuffled', 5, np.arange(count), 0, n)
  assert (np.sort(rows, axis=1) == np.arange(n)).all()
  landed = np.bincount(np.argmax(rows == 0, axis=1), minlength=n)
  chi2 = ((landed - count / n) ** 2 / (count / n)).sum()
  assert chi2 < 43.8  # the 0.999 quantile of chi-square with 19 degrees of freedom
  ranks = rows.argsort(axis=1)
  pairs = np.corrcoef(ranks[0::2].ravel(), ranks[1::2].ravel())[0, 1]
  assert abs(pairs) < 0.03
