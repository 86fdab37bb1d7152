"""On-device augmentation: per-example keys, crop and flip semantics, the registry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dist_ens.data import augment
from dist_ens.errors import ConfigError

H, W, C = 6, 7, 2


def _images(n, seed=0):
  return jax.random.normal(jax.random.key(seed), (n, H, W, C))


def _keys(index, seed=0, member=0, step=0):
  return augment.example_keys(seed, member, step, jnp.asarray(index))


# Jitted: one compile each instead of one per eager op (seconds each on a busy CPU).
_batch = jax.jit(augment.augment_batch, static_argnums=2)
_crop = jax.jit(augment.crop_flip, static_argnums=(2, 3))


def test_same_key_same_output_and_keys_differ():
  x = _images(1)[0]
  key = _keys(3)
  np.testing.assert_array_equal(_crop(key, x), _crop(key, x))
  outs = _batch(jnp.broadcast_to(x, (32, H, W, C)), _keys(jnp.arange(32)), augment.crop_flip)
  assert len({np.asarray(o).tobytes() for o in outs}) > 16


def test_example_keys_depend_on_each_argument_only():
  data = lambda *args: np.asarray(jax.random.key_data(augment.example_keys(*args)))
  base = data(0, 1, 2, 3)
  np.testing.assert_array_equal(data(0, 1, 2, 3), base)
  for other in [(1, 1, 2, 3), (0, 0, 2, 3), (0, 1, 3, 3), (0, 1, 2, 4)]:
    assert not np.array_equal(data(*other), base), other
  keys = augment.example_keys(0, 1, 2, jnp.array([[3, 4], [5, 6]]))
  assert keys.shape == (2, 2)
  np.testing.assert_array_equal(jax.random.key_data(keys[0, 0]), base)
  # A member traced under vmap gets the keys a loop over members gets.
  by_vmap = jax.vmap(lambda m: augment.example_keys(0, m, 2, 3))(jnp.arange(3))
  for m in range(3):
    np.testing.assert_array_equal(jax.random.key_data(by_vmap[m]), data(0, m, 2, 3))


def test_an_example_is_augmented_the_same_alone_or_anywhere_in_a_batch():
  x = _images(16)
  index = jnp.arange(100, 116)
  full = _batch(x, _keys(index, member=2, step=7), augment.crop_flip)
  # Alone.
  alone = _crop(_keys(109, member=2, step=7), x[9])
  np.testing.assert_array_equal(full[9], alone)
  # In a shuffled batch.
  perm = np.random.default_rng(0).permutation(16)
  shuffled = _batch(x[perm], _keys(index[perm], member=2, step=7), augment.crop_flip)
  np.testing.assert_array_equal(shuffled, full[perm])
  # With the batch split over the 8 devices of a mesh.
  sharding = NamedSharding(Mesh(np.array(jax.devices()), ('data',)), PartitionSpec('data'))
  sharded = jax.jit(lambda x, i: augment.augment_batch(x, _keys(i, member=2, step=7)))(
      jax.device_put(x, sharding), jax.device_put(index, sharding))
  np.testing.assert_array_equal(sharded, full)


def _ramp():
  """An image whose pixels are all distinct and positive, so a crop reveals its offset."""
  return 1.0 + jnp.arange(H * W * C, dtype=jnp.float32).reshape(H, W, C)


def _shifted(x, dy, dx):
  """x moved so that out[i, j] = x[i + dy, j + dx], zero outside."""
  out = np.zeros_like(x)
  for i in range(H):
    for j in range(W):
      if 0 <= i + dy < H and 0 <= j + dx < W:
        out[i, j] = x[i + dy, j + dx]
  return out


def test_crop_is_a_uniform_shift_with_zero_fill():
  x = np.asarray(_ramp())
  n, padding = 400, 2
  crop = jax.vmap(lambda k: augment.crop_flip(k, _ramp(), padding, flip=False))
  outs = np.asarray(jax.jit(crop)(_keys(jnp.arange(n))))
  shifts = []
  for out in outs:
    # The centre pixel is inside the image for every shift up to `padding`.
    value = int(out[H // 2, W // 2, 0]) - 1
    dy, dx = value // (W * C) - H // 2, value % (W * C) // C - W // 2
    assert max(abs(dy), abs(dx)) <= padding
    np.testing.assert_array_equal(out, _shifted(x, dy, dx))
    shifts.append((dy, dx))
  counts = np.unique(np.array(shifts), axis=0, return_counts=True)[1]
  assert len(counts) == (2 * padding + 1)**2  # Every offset occurs,
  assert counts.min() > 0.3 * n / len(counts)  # about equally often.


def test_flip_is_an_exact_mirror_half_the_time():
  x = _images(1)[0]
  outs = _batch(jnp.broadcast_to(x, (64, H, W, C)), _keys(jnp.arange(64)),
                lambda k, e: augment.crop_flip(k, e, padding=0))
  flipped = [bool(np.array_equal(o, x[:, ::-1])) for o in outs]
  assert all(f or np.array_equal(o, x) for f, o in zip(flipped, outs))
  assert 16 < sum(flipped) < 48


def test_constant_image_keeps_values_from_zero_and_the_constant():
  x = jnp.full((32, H, W, C), 5.0)
  out = np.asarray(_batch(x, _keys(jnp.arange(32)), augment.crop_flip))
  assert set(np.unique(out)) <= {0.0, 5.0}
  assert (out == 0).any() and (out == 5.0).any()
  assert out.shape == x.shape and out.dtype == x.dtype


def test_one_dimensional_signals_shift_without_flipping_by_default():
  signal = 1.0 + jnp.arange(40.0).reshape(40, 1)
  keys = _keys(jnp.arange(64))
  crop = jax.jit(jax.vmap(lambda k, x: augment.crop_flip(k, x, 4)))
  outs = np.asarray(crop(keys, jnp.broadcast_to(signal, (64, 40, 1))))
  assert outs.shape == (64, 40, 1)
  for out in outs:
    nonzero = out[out > 0]
    # A contiguous, increasing run of the signal: a shift, never a reversal.
    assert np.all(np.diff(nonzero) == 1) and len(nonzero) >= 36
  flips = jax.jit(jax.vmap(lambda k: augment.crop_flip(k, signal, 0, flip=True)))(keys)
  assert any(np.array_equal(f, signal[::-1]) for f in flips)


def test_members_and_dtypes_under_jit_and_vmap():
  x = _images(12).reshape(3, 4, H, W, C).astype(jnp.bfloat16)

  @jax.jit
  def per_member(x):
    def one(member, xm):
      return augment.augment_batch(xm, augment.example_keys(0, member, 5, jnp.arange(4)))
    return jax.vmap(one)(jnp.arange(3), x)

  out = per_member(x)
  assert out.shape == x.shape and out.dtype == jnp.bfloat16
  expected = _crop(augment.example_keys(0, 1, 5, 2), x[1, 2])
  np.testing.assert_array_equal(out[1, 2], expected)


def test_registry_and_user_transforms():
  x = _images(4)
  keys = _keys(jnp.arange(4))
  assert augment.get_augmentation('none') is augment.identity
  np.testing.assert_array_equal(augment.augment_batch(x, keys, augment.get_augmentation('none')), x)
  assert augment.get_augmentation('crop_flip') is augment.crop_flip
  unknown = r"config.data.augment='mixup'.*\['crop_flip', 'none'\]"
  with pytest.raises(ConfigError, match=unknown):
    augment.get_augmentation('mixup')

  def noise(key, example):
    return example + 0.1 * jax.random.normal(key, example.shape, example.dtype)

  assert augment.get_augmentation(noise) is noise
  out = augment.augment_batch(x, keys, noise)
  np.testing.assert_array_equal(out[2], noise(keys[2], x[2]))
  with pytest.raises(ValueError, match=r'must keep an example.s shape'):
    augment.augment_batch(x, keys, lambda k, e: e[:3])
  with pytest.raises(ValueError, match='one key per example'):
    augment.augment_batch(x, keys[:3])
  with pytest.raises(ValueError, match=r'\[H, W, C\] or \[L, C\]'):
    augment.crop_flip(keys[0], x)
