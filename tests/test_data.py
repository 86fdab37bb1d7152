"""Embedded datasets, member orders, per-host slices, resumable positions, prefetching."""

import random

import jax
import numpy as np
import pytest

from dist_ens import data
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.data import sources
from dist_ens.errors import ConfigError


@pytest.fixture(scope='module')
def mnist1d():
  return data.load_dataset('mnist1d')


def _mesh_and_order(dataset, kind, shape):
  """A member x data mesh of `shape` and a 32-example order of `kind` over `dataset`."""
  mesh = mesh_lib.make_mesh(mesh_lib.MeshSpec(member=shape[0], data=shape[1]))
  return mesh, data.Order(kind, dataset.train.num_examples, 32, seed=1)


def test_mnist1d_split_and_shapes(mnist1d):
  assert mnist1d.train.x.shape == (4000, 40, 1) and mnist1d.test.x.shape == (1000, 40, 1)
  assert mnist1d.train.x.dtype == np.float32 and mnist1d.train.y.dtype == np.int32
  assert set(np.unique(mnist1d.train.y)) == set(range(10))
  assert mnist1d.input_shape == (40, 1) and mnist1d.num_classes == 10


def test_mnist1d_generation_leaves_global_rng_alone(tmp_path, monkeypatch):
  monkeypatch.setenv('DIST_ENS_CACHE', str(tmp_path))  # Force a fresh generation.
  np.random.seed(123)
  random.seed(123)
  expected_np, expected_py = np.random.rand(), random.random()
  np.random.seed(123)
  random.seed(123)
  fresh = sources.load_mnist1d()
  assert (np.random.rand(), random.random()) == (expected_np, expected_py)
  cached = sources.load_mnist1d()  # Now from the cache file: identical.
  np.testing.assert_array_equal(fresh.train.x, cached.train.x)
  assert list(tmp_path.iterdir())[0].suffix == '.npz'


def test_digits():
  ds = data.load_dataset('digits')
  assert ds.input_shape == (8, 8, 1) and ds.train.num_examples + len(ds.test.y) == 1797
  assert 0.0 <= ds.train.x.min() and ds.train.x.max() <= 1.0


def test_normalisation_from_config():
  config = data.DataSpec(name='digits', mean=(0.5,), std=(0.25,))
  raw, normed = data.load_dataset('digits'), data.load_dataset('digits', config)
  np.testing.assert_allclose(normed.test.x, (raw.test.x - 0.5) / 0.25, rtol=1e-6)
  assert data.preprocess(np.array([0, 255], np.uint8), config).tolist() == [-2.0, 2.0]


def test_unknown_names_are_refused():
  with pytest.raises(ConfigError, match=r"config.data.name='a/b' is not a known dataset.*mnist1d"):
    data.load_dataset('a/b')


def _split(n=50):
  return data.Split(np.arange(n, dtype=np.float32)[:, None], np.arange(n, dtype=np.int32))


def test_each_epoch_is_a_permutation_dropping_the_remainder():
  it = data.BatchIterator(_split(50), batch_size=8, seed=0)
  assert it.batches_per_epoch == 6
  epoch0 = np.concatenate([next(it)[1] for _ in range(6)])
  assert len(set(epoch0)) == 48
  epoch1 = np.concatenate([next(it)[1] for _ in range(6)])
  assert it.state == data.IteratorState(epoch=2, index=0)
  assert not np.array_equal(epoch0, epoch1)


def test_shared_order_depends_only_on_seed_and_is_resumable():
  a = data.BatchIterator(_split(), 8, seed=3)
  first = [next(a)[1] for _ in range(9)]
  saved = a.state
  rest = [next(a)[1] for _ in range(5)]
  b = data.BatchIterator(_split(), 8, seed=3, state=saved)
  for expected in rest:
    np.testing.assert_array_equal(next(b)[1], expected)
  c = data.BatchIterator(_split(), 8, seed=4)
  assert not np.array_equal(next(c)[1], first[0])


def _epoch(order, epoch, members=None):
  return np.concatenate([order.indices(data.IteratorState(epoch, i), members)
                         for i in range(order.batches_per_epoch)], axis=-1)


def test_shuffled_members_each_see_every_example_in_their_own_order():
  order = data.Order('shuffled', 100, 10, seed=0)
  e0 = _epoch(order, 0, range(4))
  assert e0.shape == (4, 100)
  for m in range(4):
    assert sorted(e0[m]) == list(range(100))  # A permutation per member and epoch.
  assert len({tuple(row) for row in e0}) == 4  # Different members, different orders.
  assert not np.array_equal(_epoch(order, 1, range(4)), e0)


def test_bootstrap_members_resample_with_replacement():
  order = data.Order('bootstrap', 1000, 100, seed=0)
  e0, e1 = _epoch(order, 0, range(3)), _epoch(order, 1, range(3))
  for m in range(3):
    # Bagging: about 1 - 1/e = 63% of the examples appear in a resample.
    assert 0.58 < len(set(e0[m])) / 1000 < 0.68
    # Each epoch visits the same resample in a new order.
    np.testing.assert_array_equal(np.sort(e0[m]), np.sort(e1[m]))
    assert not np.array_equal(e0[m], e1[m])
  assert not np.array_equal(np.sort(e0[0]), np.sort(e0[1]))


@pytest.mark.parametrize('kind', ['shuffled', 'bootstrap'])
def test_member_stream_does_not_depend_on_m_or_host(kind):
  order = data.Order(kind, 200, 16, seed=5)
  for state in (data.IteratorState(0, 3), data.IteratorState(2, 7)):
    eight = order.indices(state, range(8))
    np.testing.assert_array_equal(order.indices(state, range(3)), eight[:3])
    np.testing.assert_array_equal(order.indices(state, range(4, 6)), eight[4:6])
  again = data.Order(kind, 200, 16, seed=5)
  np.testing.assert_array_equal(again.indices(data.IteratorState(1, 1), range(8)),
                                order.indices(data.IteratorState(1, 1), range(8)))


def _two_process_mesh(member, data_axis, hosts_along):
  mesh = mesh_lib.make_mesh(
      mesh_lib.MeshSpec(member=member, data=data_axis, hosts_along=hosts_along))
  # Simulated processes: devices 0-3 are process 0, devices 4-7 process 1 (what
  # jax.devices() gives for 2 processes x 4 devices).
  processes = [[d for d in jax.devices() if d.id // 4 == p] for p in range(2)]
  return mesh, processes


@pytest.mark.parametrize('hosts_along,member,data_axis', [('member', 2, 4), ('data', 2, 4),
                                                           ('data', 1, 8)])
def test_host_slices_of_shared_batches_cover_the_split(hosts_along, member, data_axis):
  mesh, processes = _two_process_mesh(member, data_axis, hosts_along)
  order = data.Order('shared', 96, 16, seed=0)
  sharding = mesh_lib.batch_sharding(mesh)
  per_process = []
  for devices in processes:
    block = data.host_block(sharding, (16,), 1, devices)
    per_process.append(np.concatenate([
        data.local_indices(order, data.IteratorState(0, i), block)
        for i in range(order.batches_per_epoch)]))
  if hosts_along == 'data':
    # Each process reads its half of every batch: together, the split exactly once.
    assert all(len(p) == 48 for p in per_process)
    assert sorted(np.concatenate(per_process)) == list(range(96))
  else:
    # Members across hosts, shared batches: each host needs every example of the epoch.
    for p in per_process:
      assert sorted(p) == list(range(96))


@pytest.mark.parametrize('hosts_along', ['member', 'data'])
def test_host_slices_of_per_member_batches(hosts_along):
  mesh, processes = _two_process_mesh(2, 4, hosts_along)
  order = data.Order('shuffled', 96, 16, seed=0)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('member', 'data'))
  state = data.IteratorState(0, 2)
  full = order.indices(state, range(4))  # M=4 members.
  seen = np.zeros_like(full)
  for devices in processes:
    block = data.host_block(sharding, (4, 16), 2, devices)
    seen[block] += 1
    np.testing.assert_array_equal(data.local_indices(order, state, block), full[block])
    if hosts_along == 'member':
      assert block[1] == slice(0, 16) and block[0].stop - block[0].start == 2
    else:
      assert block[0] == slice(0, 4) and block[1].stop - block[1].start == 8
  assert np.all(seen == 1)  # Every (member, row) read by exactly one process.


@pytest.mark.parametrize('kind,shape', [('shared', (4, 2)), ('shuffled', (2, 4)),
                                        ('bootstrap', (8, 1))])
def test_batches_are_global_arrays_and_resume_exactly(mnist1d, kind, shape):
  mesh, order = _mesh_and_order(mnist1d, kind, shape)
  batches = data.Batches(mnist1d.train, order, mesh, 8, prefetch=2)
  got = [next(batches) for _ in range(5)]
  saved = batches.state
  after = [next(batches) for _ in range(3)]
  batches.close()
  assert saved == data.IteratorState(0, 5)  # Prefetching ran ahead; the state did not.
  x, y = got[0]
  lead = (32,) if kind == 'shared' else (8, 32)
  assert x.shape == lead + (40, 1) and y.shape == lead
  assert tuple(x.sharding.spec) == (('data',) if kind == 'shared' else ('member', 'data'))
  expected = order.indices(data.IteratorState(0, 0), range(8) if order.per_member else None)
  np.testing.assert_array_equal(np.asarray(y), mnist1d.train.y[expected])
  np.testing.assert_array_equal(np.asarray(x), mnist1d.train.x[expected])
  resumed = data.Batches(mnist1d.train, order, mesh, 8, state=saved, prefetch=0)
  for xa, ya in after:
    xb, yb = next(resumed)
    np.testing.assert_array_equal(np.asarray(xa), np.asarray(xb))
    np.testing.assert_array_equal(np.asarray(ya), np.asarray(yb))
  assert resumed.stats.examples == 3 * int(np.prod(lead))  # Its speed: benchmarks/input_pipeline.py.


def test_pipeline_errors_surface_in_the_consumer(mnist1d):
  class Broken:
    num_examples = 100

    def read(self, indices):
      raise OSError('disk gone')

  mesh = mesh_lib.make_mesh(mesh_lib.MeshSpec(member=8, data=1))
  batches = data.Batches(Broken(), data.Order('shared', 100, 10, 0), mesh, 8)
  with pytest.raises(OSError, match='disk gone'):
    next(batches)
  batches.close()


@pytest.mark.parametrize('shape', [(8, 1), (4, 2), (1, 8)])
def test_to_global_holds_the_batch(shape):
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(shape), ('member', 'data'))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  batch = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
  arr = data.to_global(batch, sharding)
  np.testing.assert_array_equal(np.asarray(arr), batch)
  assert arr.sharding == sharding
  assert data.host_rows(sharding, batch.shape) == slice(0, 32)  # One process holds every row.


@pytest.mark.parametrize('kind,shape', [('shared', (4, 2)), ('shuffled', (2, 4))])
def test_batches_for_several_steps_per_call_stack_consecutive_batches(mnist1d, kind, shape):
  mesh, order = _mesh_and_order(mnist1d, kind, shape)
  single = data.Batches(mnist1d.train, order, mesh, 8, prefetch=0)
  expected = [next(single) for _ in range(6)]
  stacked = data.Batches(mnist1d.train, order, mesh, 8, prefetch=2, steps_per_call=3)
  got = [next(stacked) for _ in range(2)]
  assert stacked.state == single.state == data.IteratorState(0, 6)
  stacked.close()
  x, y = got[0]
  assert x.shape == (3,) + expected[0][0].shape and y.shape == (3,) + expected[0][1].shape
  assert x.sharding.spec[0] is None and tuple(x.sharding.spec[1:]) == tuple(
      expected[0][0].sharding.spec)
  for i, (xe, ye) in enumerate(expected):
    np.testing.assert_array_equal(np.asarray(got[i // 3][0])[i % 3], np.asarray(xe))
    np.testing.assert_array_equal(np.asarray(got[i // 3][1])[i % 3], np.asarray(ye))
