"""Embedded datasets, the batch order, and host-local slices."""

import random

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dist_ens import data
from dist_ens.data import sources
from dist_ens.errors import ConfigError


@pytest.fixture(scope='module')
def mnist1d():
  return data.load_dataset('mnist1d')


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
  assert ds.input_shape == (8, 8, 1) and len(ds.train.y) + len(ds.test.y) == 1797
  assert 0.0 <= ds.train.x.min() and ds.train.x.max() <= 1.0


def test_unknown_dataset():
  with pytest.raises(ConfigError, match=r"config.data.name='imagenet'.*\['digits', 'mnist1d'\]"):
    data.load_dataset('imagenet')


def _split(n=50):
  return data.Split(np.arange(n, dtype=np.float32)[:, None], np.arange(n, dtype=np.int32))


def test_each_epoch_is_a_permutation_dropping_the_remainder():
  it = data.BatchIterator(_split(50), batch_size=8, seed=0)
  assert it.batches_per_epoch == 6
  epoch0 = np.concatenate([next(it)[1] for _ in range(6)])
  assert len(set(epoch0)) == 48
  epoch1 = np.concatenate([next(it)[1] for _ in range(6)])
  assert it.state == data.IteratorState(epoch=1, index=6)
  assert not np.array_equal(epoch0, epoch1)


def test_order_depends_only_on_seed_and_is_resumable():
  a = data.BatchIterator(_split(), 8, seed=3)
  first = [next(a)[1] for _ in range(9)]
  saved = a.state
  rest = [next(a)[1] for _ in range(5)]
  b = data.BatchIterator(_split(), 8, seed=3, state=saved)
  for expected in rest:
    np.testing.assert_array_equal(next(b)[1], expected)
  c = data.BatchIterator(_split(), 8, seed=4)
  assert not np.array_equal(next(c)[1], first[0])


@pytest.mark.parametrize('shape', [(8, 1), (4, 2), (1, 8)])
def test_to_global_holds_the_batch(shape):
  mesh = Mesh(np.array(jax.devices()).reshape(shape), ('member', 'data'))
  sharding = NamedSharding(mesh, P('data'))
  batch = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
  arr = data.to_global(batch, sharding)
  np.testing.assert_array_equal(np.asarray(arr), batch)
  assert arr.sharding == sharding
  # One process holds every row.
  assert data.host_rows(sharding, batch.shape) == slice(0, 32)
