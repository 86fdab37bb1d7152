"""On-device corruptions: identity at severity 0, monotone severities, keys that ignore the
batch layout, one trace for every corruption x severity, and the families' formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import support

from dist_ens.data import corruptions as cor
from dist_ens.errors import ConfigError

B, H, W, C = 16, 8, 8, 3
SEVERITIES = range(cor.NUM_SEVERITIES + 1)
IMAGE_ONLY = ('motion_blur', 'saturate')  # no 1-D form (saturate: no colour either)

# Bits that only XLA's default compilation keeps (zoom_blur's and elastic_transform's on a
# mesh: the suite's FAST_COMPILE does not) are checked in programs compiled as runs compile
# them (support.XLA_DEFAULT: -O3 and XLA:CPU's fusion emitters, which give other bits than
# the older emitters: every family's program, compiled with and without them, differs in
# places), in this process (no child pytest). With the emitters such a program also
# compiles faster: 8 CPU s instead of 11 for every family.
AS_RUNS_COMPILE = support.XLA_DEFAULT

# The shapes corrupt_batch was traced with through _corrupt (inputs on the default device).
_TRACES = []


def _counted(x, index, corruption, severity, seed, value_range):
  _TRACES.append(x.shape)
  return cor.corrupt_batch(x, index, corruption, severity, seed, value_range)


# Every family's program is most of this file's time (8 CPU s as runs compile it; shot_noise's
# Poisson draw is its largest family). The images' one, compiled as runs compile it, serves every
# test of images: the bitwise tests below need it, and the others (identity, monotone damage,
# value range, one trace) hold at any level. The 1-D signals' program (no test compares its
# bits with another program's) compiles at the suite's -O0: 1.5 CPU s instead of 8.
_images_as_runs_compile = jax.jit(_counted, compiler_options=AS_RUNS_COMPILE)
_signals_at_o0 = jax.jit(_counted)


def _corrupt(x, index, corruption, severity, seed, value_range=(0.0, 1.0)):
  """One jit for every corruption x severity (traced) and value range: one compile a shape
  (images [B, H, W, C] as runs compile them, signals [B, L] at the suite's -O0)."""
  jitted = _images_as_runs_compile if np.ndim(x) == 4 else _signals_at_o0
  return jitted(x, index, np.int32(corruption), np.int32(severity), seed, value_range)


# The tests' batches and indices are host arrays (numpy): a jax.random draw or jnp.arange
# outside a jit compiles a program of its own for each shape.
def _images(n=B, seed=0):
  return np.random.default_rng(seed).uniform(0.05, 0.95, (n, H, W, C)).astype(np.float32)


def _signals(n=B, seed=1):
  return np.random.default_rng(seed).uniform(0.05, 0.95, (n, 40)).astype(np.float32)


def _indices(n=B, start=0):
  return np.arange(start, start + n, dtype=np.int32)


def _all(x, index, corruptions, severities, seed=0):
  """{(name, severity): corrupted batch}, through the one jitted function."""
  return {(n, s): np.asarray(_corrupt(x, index, cor.corruption_id(n), s, seed))
          for n in corruptions for s in severities}


def test_severity_zero_is_the_identity():
  x, x1 = _images(), _signals()
  for name in cor.CORRUPTIONS:
    np.testing.assert_array_equal(_corrupt(x, _indices(), cor.corruption_id(name), 0, 3), x)
    if name not in IMAGE_ONLY:
      np.testing.assert_array_equal(
          _corrupt(x1, _indices(), cor.corruption_id(name), 0, 3), x1)
  # And the table's identity level really is one (the bitwise identity above is a select).
  at_identity = jax.jit(lambda e: {n: f.fn(jax.random.key(0), e, jnp.float32(f.identity))
                                   for n, f in cor.CORRUPTION_TABLE.items()})(x[0])
  for name, out in at_identity.items():
    np.testing.assert_allclose(out, x[0], atol=1e-6, err_msg=name)


def test_levels_move_monotonically_away_from_the_identity():
  for name, family in cor.CORRUPTION_TABLE.items():
    steps = np.diff((family.identity, *family.levels))
    assert len(family.levels) == cor.NUM_SEVERITIES
    assert np.all(steps > 0) or np.all(steps < 0), name
  # And the damage grows with severity: mean |x' - x| over a batch of images, each family.
  x, index = _images(), _indices()
  for name in cor.CORRUPTIONS:
    dist = [float(np.abs(np.asarray(_corrupt(x, index, cor.corruption_id(name), s, 0)) - x)
                  .mean()) for s in SEVERITIES]
    assert dist[0] == 0 and dist[1] > 0 and dist[5] > dist[1], (name, dist)
    # Below ~28 pixels, pixelate's neighbouring severities can cross over (see its doc);
    # it is checked on the 40-long signals (the test below).
    if name != 'pixelate':
      assert np.all(np.diff(dist) > 0), (name, dist)


def test_damage_grows_with_severity_on_signals():
  """The 1-D forms: mean |x' - x| grows with every severity, pixelate's too. (A test of
  its own: the signals' program is the second compile, after the images' one above.)"""
  x1, index = _signals(), _indices()
  for name in cor.CORRUPTIONS:
    if name not in IMAGE_ONLY:
      dist = [float(np.abs(np.asarray(_corrupt(x1, index, cor.corruption_id(name), s, 0)) - x1)
                    .mean()) for s in SEVERITIES]
      assert dist[0] == 0 and np.all(np.diff(dist) > 0), (name, '1-D', dist)


def test_keys_depend_on_seed_corruption_severity_and_index_only():
  # One jit, every argument traced (a run's step traces the corruption and severity):
  # eagerly, each fold_in and conversion compiles a program of its own.
  keys = jax.jit(lambda *args: jax.random.key_data(cor.corruption_keys(*args)))
  data = lambda *args: np.asarray(keys(*(np.int32(a) for a in args)))
  base = data(0, 1, 2, 3)
  for other in [(1, 1, 2, 3), (0, 2, 2, 3), (0, 1, 3, 3), (0, 1, 2, 4)]:
    assert not np.array_equal(data(*other), base), other
  np.testing.assert_array_equal(data(0, 1, 2, 3), base)


def _all_at_default(x, index, corruptions, severities, seed=0):
  """_all's {(name, severity): corrupted batch} of images: from the program of every family
  compiled as runs compile it (_corrupt's for images)."""
  assert np.ndim(x) == 4, 'images: the program compiled as runs compile it'
  return _all(x, index, corruptions, severities, seed)


def _reference():
  """(images, their example indices, every family's output at severity 3): the examples the
  tests of bits below corrupt, from the program of every family compiled as runs compile
  it."""
  x, index = _images(), _indices(start=100)
  return x, index, _all_at_default(x, index, cor.CORRUPTIONS, [3])


def test_examples_ignore_order_and_batch_at_xla_default():
  """Bitwise: an example's corruption is the same in any order and among any other
  examples of a batch."""
  x, index, ref = _reference()
  x, index, names = np.asarray(x), np.asarray(index), cor.CORRUPTIONS  # no eager programs
  perm = np.random.default_rng(0).permutation(B)
  shuffled = _all_at_default(x[perm], index[perm], names, [3])
  # Example 5 at the front of a batch of other examples.
  others, others_index = np.array(_images(seed=7)), np.arange(200, 200 + B, dtype=np.int32)
  others[0], others_index[0] = x[5], index[5]
  elsewhere = _all_at_default(others, others_index, names, [3])
  for key in ref:
    np.testing.assert_array_equal(shuffled[key], ref[key][perm], err_msg=f'permuted {key}')
    np.testing.assert_array_equal(elsewhere[key][0], ref[key][5], err_msg=f'other batch {key}')


def test_named_families_keep_their_bits_at_xla_default():
  """A run compiles only the families eval.shift names (corrupt_batch's families): each
  gives the bits it gives in the program of every family, for every severity."""
  x, index = _images(), _indices()
  named = ('gaussian_noise', 'contrast', 'zoom_blur')
  ids = tuple(cor.corruption_id(n) for n in named)
  alone = jax.jit(lambda x, c, s: cor.corrupt_batch(x, index, c, s, 0, families=ids),
                  compiler_options=AS_RUNS_COMPILE)
  every = _all_at_default(x, index, named, SEVERITIES)
  for name in named:
    for s in SEVERITIES:
      np.testing.assert_array_equal(alone(x, np.int32(cor.corruption_id(name)), np.int32(s)),
                                    every[name, s], err_msg=f'{name}:{s}')
  # A concrete id compiles its own family alone, to the same bits.
  np.testing.assert_array_equal(
      jax.jit(lambda x: cor.corrupt_batch(x, index, ids[1], 2, 0),
              compiler_options=AS_RUNS_COMPILE)(x), every[named[1], 2])


def test_examples_ignore_sharding_and_member_count_at_xla_default():
  """Bitwise: on a run's mesh, as its shift evaluation corrupts (eval/shift.py's predict
  step, before the members' forward), the batch split over 4 devices of 'data' and copied
  to both shards of 'member': every device's copy holds the bits of the program of every
  family without a mesh (M = 1)."""
  x, index, ref = _reference()
  # (The product's layout costs ~60% of a program vmapped over members, which no run uses.)
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ('member', 'data'))
  on_mesh = jax.jit(cor.corrupt_batch, compiler_options=AS_RUNS_COMPILE)
  xs, ids = (jax.device_put(a, NamedSharding(mesh, P('data'))) for a in (x, index))
  for name in cor.CORRUPTIONS:
    got = on_mesh(xs, ids, cor.corruption_id(name), 3, 0)
    assert len(got.addressable_shards) == 8
    for shard in got.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), ref[name, 3][shard.index],
                                    err_msg=f'{name} on {shard.device}')


def test_one_trace_serves_every_corruption_and_severity():
  x, index = _images(), _indices()
  for name, severity in cor.resolve('all') + [(n, 0) for n in cor.CORRUPTIONS]:
    _corrupt(x, index, cor.corruption_id(name), severity, 0)
  assert len(cor.resolve('all')) == len(cor.CORRUPTIONS) * cor.NUM_SEVERITIES
  # Whatever ran before (every test here uses this batch shape): one trace, ever.
  assert _TRACES.count(x.shape) == 1


def test_resolve_names_severities_and_refusals():
  assert cor.resolve(['gaussian_noise:3', 'contrast']) == [
      ('gaussian_noise', 3)] + [('contrast', s) for s in range(1, 6)]
  assert cor.resolve('pixelate:1, pixelate:1') == [('pixelate', 1)]
  with pytest.raises(ConfigError, match='unknown corruption .fog.*gaussian_noise.*elastic'):
    cor.resolve(['fog'])
  with pytest.raises(ConfigError, match='severity'):
    cor.resolve(['contrast:6'])
  one_d = cor.resolve('all', example_shape=(40,))
  assert {n for n, _ in one_d} == set(cor.CORRUPTIONS) - set(IMAGE_ONLY)
  grey = {n for n, _ in cor.resolve('all', example_shape=(8, 8, 1))}
  assert grey == set(cor.CORRUPTIONS) - {'saturate'}
  with pytest.raises(ConfigError, match='motion_blur needs 2-D'):
    cor.resolve(['motion_blur', 'contrast'], example_shape=(40, 1))
  with pytest.raises(ConfigError, match='saturate needs 3 channels'):
    cor.resolve(['saturate:2'], example_shape=(8, 8, 1))
  with pytest.raises(ConfigError, match='motion_blur'):
    cor.corrupt_batch(_signals(2), _indices(2), cor.corruption_id('motion_blur'), 1, 0)
  # Traced, a refused family cannot raise: it answers NaN rather than a plausible batch.
  out = _corrupt(_signals(), _indices(), cor.corruption_id('saturate'), 2, 0)
  assert np.isnan(out).all()


def test_value_range_maps_to_the_unit_families():
  x, index = _images(), _indices()
  for name in ('gaussian_noise', 'contrast', 'brightness', 'zoom_blur'):
    unit = np.asarray(_corrupt(x, index, cor.corruption_id(name), 4, 0))
    wide = _corrupt(3 * x - 1, index, cor.corruption_id(name), 4, 0, (-1.0, 2.0))
    np.testing.assert_allclose(wide, 3 * unit - 1, atol=1e-5, err_msg=name)


def _families(calls, key=0):
  """[(name, example, level)] -> each family's output (numpy), all from one program: a
  jit per family compiles one program each."""
  run = jax.jit(lambda examples, levels: [
      cor.CORRUPTION_TABLE[name].fn(jax.random.key(key), example, level)
      for (name, _, _), example, level in zip(calls, examples, levels)])
  outs = run([x for _, x, _ in calls], [np.float32(level) for _, _, level in calls])
  return [np.asarray(out) for out in outs]


def test_families_against_numpy_formulas():
  rng = np.random.default_rng(0)
  x = rng.uniform(0.1, 0.9, (8, 8, 3)).astype(np.float32)
  grey = np.repeat(x[..., :1], 3, axis=-1)
  big = rng.uniform(0.1, 0.9, (64, 64, 3)).astype(np.float32)
  contrasted, brightened, grey_saturated, sat, pixelated, blurred, out = _families([
      ('contrast', x, 0.3), ('brightness', grey, 0.2), ('saturate', grey, 2.5),
      ('saturate', x, 2.5), ('pixelate', x, 0.5), ('gaussian_blur', x, 0.8),
      ('impulse_noise', big, 0.05)])
  # contrast: per-channel mean kept, deviations scaled.
  mean = x.mean(axis=(0, 1))
  np.testing.assert_allclose(contrasted, (x - mean) * 0.3 + mean, atol=1e-6)
  # brightness on a grey image is x + shift, clipped.
  np.testing.assert_allclose(brightened, np.minimum(grey + 0.2, 1), atol=1e-6)
  # saturate leaves grey pixels alone and keeps each pixel's max (HSV value).
  np.testing.assert_allclose(grey_saturated, grey, atol=1e-6)
  np.testing.assert_allclose(sat.max(-1), x.max(-1), atol=1e-6)
  assert np.all(sat.min(-1) <= x.min(-1) + 1e-6)
  # pixelate keeping half the resolution: 2 x 2 block means.
  blocks = x.reshape(4, 2, 4, 2, 3).mean(axis=(1, 3))
  np.testing.assert_allclose(pixelated, np.repeat(np.repeat(blocks, 2, 0), 2, 1), atol=1e-6)
  # gaussian blur: a normalised, edge-padded separable kernel of radius 3 * max sigma.
  # (8 x 8 is below 32 pixels: CIFAR's pixel parameters, radius 3 x max sigma = 3.)
  sigma, radius = 0.8, 3
  k = np.exp(-np.arange(-radius, radius + 1)**2 / (2 * sigma**2))
  k /= k.sum()
  pad = np.pad(x, [(radius, radius)] * 2 + [(0, 0)], mode='edge')
  rows = sum(k[i] * pad[i:i + H] for i in range(2 * radius + 1))
  ref = sum(k[j] * rows[:, j:j + W] for j in range(2 * radius + 1))
  np.testing.assert_allclose(blurred, ref, atol=1e-6)
  # impulse: about `amount` of the values become 0 or 1, the rest unchanged.
  assert abs(np.isin(out, (0.0, 1.0)).mean() - 0.05) < 0.01


def test_a_traced_id_outside_the_named_families_gives_nan_not_another_family():
  """corrupt_batch's families: the program holds their branches only; an id it does not
  hold cannot be answered, and says so with NaN instead of running the first branch."""
  x, index = _images(), _indices()
  ids = (cor.corruption_id('contrast'), cor.corruption_id('brightness'))
  run = jax.jit(lambda c: cor.corrupt_batch(x, index, c, 3, 0, families=ids))
  assert np.isfinite(np.asarray(run(np.int32(ids[0])))).all()
  assert np.isnan(np.asarray(run(np.int32(cor.corruption_id('gaussian_noise'))))).all()
