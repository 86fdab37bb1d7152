"""stack / unstack and per-member initialisation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dist_ens
from dist_ens.core import rng
from dist_ens.core.step import over_members


def _member(seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {'dense': [{'w': jax.random.normal(k1, (3, 2)), 'b': jnp.zeros(2)}],
          'scale': jax.random.normal(k2, ())}


def test_stack_adds_leading_member_axis_and_unstack_inverts():
  members = [_member(s) for s in range(3)]
  stacked = dist_ens.stack(members)
  assert stacked['dense'][0]['w'].shape == (3, 3, 2)
  assert stacked['scale'].shape == (3,)
  for original, recovered in zip(members, dist_ens.unstack(stacked)):
    jax.tree.map(np.testing.assert_array_equal, original, recovered)


def test_stacked_tree_is_vmappable_where_a_list_is_not():
  members = [_member(s) for s in range(4)]
  x = jnp.ones((5, 3))
  f = lambda p, x: (x @ p['dense'][0]['w']).sum() * p['scale']
  expected = [f(p, x) for p in members]
  np.testing.assert_allclose(jax.vmap(f, in_axes=(0, None))(dist_ens.stack(members), x),
                             expected, rtol=1e-6)


def test_stack_names_first_differing_shape():
  a, b = _member(0), _member(1)
  b['dense'][0]['w'] = jnp.zeros((4, 2))
  with pytest.raises(ValueError, match=r"member 1 .*\['dense'\]\[0\]\['w'\].*\[4, 2\].*\[3, 2\]"):
    dist_ens.stack([a, b])


def test_stack_names_structure_difference():
  a, b = _member(0), _member(1)
  b['extra'] = jnp.zeros(1)
  with pytest.raises(ValueError, match=r"different structure.*\['extra'\]"):
    dist_ens.stack([a, b])


def test_stack_rejects_dtype_difference_and_empty():
  a, b = _member(0), _member(1)
  b['scale'] = b['scale'].astype(jnp.bfloat16)
  with pytest.raises(ValueError, match=r"\['scale'\]"):
    dist_ens.stack([a, b])
  with pytest.raises(ValueError, match='at least one member'):
    dist_ens.stack([])


def test_unstack_rejects_inconsistent_leading_axis():
  with pytest.raises(ValueError, match='leading member axis'):
    dist_ens.unstack({'a': jnp.zeros((2, 3)), 'b': jnp.zeros((3,))})


def test_member_init_does_not_depend_on_ensemble_size():
  init = lambda key: {'w': jax.random.normal(key, (4,))}
  eight = jax.vmap(init)(rng.member_keys(7, range(8)))
  three = jax.vmap(init)(rng.member_keys(7, range(3)))
  np.testing.assert_array_equal(eight['w'][:3], three['w'])
  assert not np.allclose(eight['w'][0], eight['w'][1])


@pytest.mark.parametrize('parallelism,chunk', [('vmap', None), ('map', None), ('map', 2),
                                               ('map', 3)])  # 3: a smaller last chunk.
def test_over_members_matches_a_loop(parallelism, chunk):
  members = [_member(s) for s in range(4)]
  x = jnp.arange(6.0).reshape(2, 3)
  f = lambda p, x, scale: (x @ p['dense'][0]['w']).sum() * p['scale'] * scale
  scales = jnp.array([1.0, 2.0, 3.0, 4.0])
  got = over_members(f, parallelism, in_axes=(0, None, 0), map_batch_size=chunk)(
      dist_ens.stack(members), x, scales)
  np.testing.assert_allclose(got, [f(p, x, s) for p, s in zip(members, scales)], rtol=1e-6)


@pytest.mark.parametrize('chunk', [None, 3])
def test_map_in_place_replaces_the_arguments_it_names(chunk):
  # Results 0 and 1 replace arguments 0 and 1 (a member's new state); result 2 is new.
  step = lambda w, count, x: (w - 0.1 * x * w, count + 1, (w * x).sum())
  w = jax.random.normal(jax.random.key(0), (5, 3))
  count = jnp.arange(5)
  mapped = over_members(step, 'map', in_axes=(0, 0, None), map_batch_size=chunk,
                                 in_place=2)
  got = jax.jit(mapped, donate_argnums=(0, 1))(w.copy(), count.copy(), 2.0)
  want = jax.vmap(step, in_axes=(0, 0, None))(w, count, 2.0)
  for g, v in zip(got, want):
    np.testing.assert_allclose(g, v, rtol=1e-6)
    assert g.dtype == v.dtype


def test_map_in_place_rejects_a_result_unlike_its_argument():
  with pytest.raises(ValueError, match='in_place: result 0'):
    over_members(lambda w: (w.sum(),), 'map', in_place=1)(jnp.zeros((4, 3)))


@pytest.mark.parametrize('parallelism', ['vmap', 'map'])
def test_one_member_runs_as_that_members_own_function(parallelism):
  # One member per device: fn runs on the member's own arrays, not under a vmap or a loop
  # of one (called eagerly, it sees concrete arrays where they would hand it tracers).
  seen = []
  f = lambda p, x: seen.append(isinstance(p['scale'], jax.core.Tracer)) or (
      (x @ p['dense'][0]['w']) * p['scale'])
  member = _member(0)
  x = jnp.arange(6.0).reshape(2, 3)
  over = over_members(f, parallelism, in_axes=(0, None))
  got = over(dist_ens.stack([member]), x)
  assert seen == [False]
  over(dist_ens.stack([member] * 2), x)
  assert seen[1:] and all(seen[1:])  # Two members: vmapped, or traced for the loop.
  np.testing.assert_allclose(got, f(member, x)[None], rtol=1e-6)


def test_over_members_rejects_unknown_parallelism():
  with pytest.raises(ValueError, match="'pmap'"):
    over_members(lambda x: x, 'pmap')
