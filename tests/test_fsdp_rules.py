"""Leaf rules for a 'model' mesh axis (dist_ens.parallel.sharding_rules): FSDP by size,
user regex rules, Flax linen / NNX annotations, and the bytes each device holds, checked
against the shards jax actually places on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dist_ens.core.axes import DATA, MEMBER, MODEL
from dist_ens.models.mlp import make_mlp
from model_specs import model_spec
from dist_ens.parallel import placement, sharding_rules as sr
from dist_ens.parallel.layout import Layout

AXES = (MEMBER, DATA, MODEL)
SIZES = {MEMBER: 2, DATA: 1, MODEL: 4}


def _leaf(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def _path(text):
  return tuple(jax.tree_util.DictKey(k) for k in text.split('/'))


def _mesh():
  return jax.make_mesh((2, 1, 4), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def test_path_str_names_dicts_attributes_indices_and_drops_value_hops():
  tree = {'params': [{'w': 1}], 'box': {'kernel': optax.EmptyState()}}
  state = optax.ScaleByAdamState(count=0, mu={'Dense_0': {'kernel': 1}}, nu={})
  paths = [sr.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path((tree, state))[0]]
  assert paths == ['0/params/0/w', '1/count', '1/mu/Dense_0/kernel']
  value_hop = (jax.tree_util.DictKey('k'), jax.tree_util.GetAttrKey('value'))
  assert sr.path_str(value_hop) == 'k'


def test_fsdp_splits_the_largest_divisible_dim_and_replicates_small_leaves():
  rule = sr.fsdp(axis_size=4)
  assert rule((), _leaf(64, 512)) == P(None, MODEL)
  assert rule((), _leaf(512, 10)) == P(MODEL, None)  # 10 is not divisible by 4
  assert rule((), _leaf(3, 3, 64, 64)) == P(None, None, None, MODEL)  # ties: the last
  assert rule((), _leaf(512)) == P()  # below min_size
  assert rule((), _leaf(63, 65)) == P()  # nothing divisible
  assert sr.fsdp(axis_size=4, min_size=1)((), _leaf(8)) == P(MODEL)
  assert sr.fsdp(axis_size=1)((), _leaf(64, 512)) == P()
  assert sr.fsdp('x', axis_size=2)((), _leaf(4096, 2)) == P('x', None)
  with pytest.raises(ValueError, match='axis_size'):
    sr.fsdp(axis_size=0)


def _abstract_mlp_state(members=2):
  model = make_mlp(model_spec(widths=(512,)), 10)
  x = jnp.zeros((4, 64))

  def init(keys):
    def one(key):
      params, _ = model.init(key, x)
      return {'params': params, 'opt_state': optax.adam(1e-3).init(params)}
    return jax.vmap(one)(keys)

  keys = jax.random.split(jax.random.key(0), members)
  return init, keys, jax.eval_shape(init, keys)


def test_fsdp_layout_places_each_large_leaf_as_a_quarter_per_device():
  init, keys, abstract = _abstract_mlp_state()
  mesh = _mesh()
  layout = Layout(axes=AXES, rule=sr.fsdp(axis_size=4))
  state = jax.jit(init, out_shardings=layout.state_shardings(abstract, mesh))(keys)
  kernel = state['params'][0]['w']
  assert kernel.shape == (2, 64, 512)
  assert kernel.sharding.spec == P(MEMBER, None, MODEL)
  assert kernel.sharding.shard_shape(kernel.shape) == (1, 64, 128)
  assert {s.data.shape for s in kernel.addressable_shards} == {(1, 64, 128)}
  head = state['params'][1]['w']
  assert head.sharding.shard_shape(head.shape) == (1, 128, 10)
  # Adam's moments mirror the params' shapes, so the same rule places them alike.
  for moment in (state['opt_state'][0].mu, state['opt_state'][0].nu):
    assert moment[0]['w'].sharding.spec == P(MEMBER, None, MODEL)
  bias = state['params'][0]['b']
  assert bias.sharding.shard_shape(bias.shape) == (1, 512)  # small: replicated over model
  assert state['opt_state'][0].count.sharding.spec == P(MEMBER)
  # Sharding changes where the numbers live, not what they are.
  plain = jax.jit(init)(keys)
  np.testing.assert_array_equal(np.asarray(kernel), np.asarray(plain['params'][0]['w']))


def test_describe_bytes_match_the_shards_jax_places():
  init, keys, abstract = _abstract_mlp_state()
  mesh = _mesh()
  layout = Layout(axes=AXES, rule=sr.fsdp(axis_size=4))
  specs = layout.state_specs(abstract)
  rows = placement.describe(specs, abstract, mesh.shape)
  by_path = {r.path: r for r in rows}
  assert by_path['params/0/w'].shape == (2, 64, 512)
  assert by_path['params/0/w'].spec == P(MEMBER, None, MODEL)
  assert by_path['params/0/w'].bytes_per_device == 64 * 128 * 4
  assert by_path['params/0/b'].bytes_per_device == 512 * 4
  state = jax.jit(init, out_shardings=layout.state_shardings(abstract, mesh))(keys)
  device = jax.devices()[0]
  placed = sum(s.data.nbytes for leaf in jax.tree.leaves(state)
               for s in leaf.addressable_shards if s.device == device)
  assert placement.state_bytes_per_device(specs, abstract, mesh.shape) == placed
  whole = placement.state_bytes_per_device(Layout(axes=AXES).state_specs(abstract), abstract,
                                    mesh.shape)
  assert placed < whole / 3  # most bytes are in the kernels, split 4 ways


def test_by_regex_first_match_decides_and_default_takes_the_rest():
  rule = sr.by_regex([(r'attn/qkv/w$', P(None, MODEL)),
                      (r'mlp/.*/w$', sr.fsdp(axis_size=4, min_size=1)),
                      (r'qkv', P(MODEL))], axis_sizes=SIZES)
  assert rule(_path('params/attn/qkv/w'), _leaf(8, 24)) == P(None, MODEL)
  # Unanchored at the start: the optimizer's moment of the param matches too.
  assert rule(_path('opt_state/0/mu/attn/qkv/w'), _leaf(8, 24)) == P(None, MODEL)
  assert rule(_path('params/mlp/fc1/w'), _leaf(8, 32)) == P(None, MODEL)
  assert rule(_path('params/attn/qkv/b'), _leaf(24)) == P(MODEL)
  assert rule(_path('params/head/w'), _leaf(8, 10)) == P()
  fallback = sr.by_regex([], default=sr.fsdp(axis_size=4, min_size=1))
  assert fallback(_path('params/head/w'), _leaf(8, 10)) == P(MODEL, None)


def test_by_regex_errors_name_the_path():
  too_long = sr.by_regex([('b$', P(None, MODEL))])
  with pytest.raises(ValueError, match=r"'params/dense/b' of shape \(24,\).*2 entries"):
    too_long(_path('params/dense/b'), _leaf(24))
  uneven = sr.by_regex([('w$', P(None, MODEL))], axis_sizes=SIZES)
  with pytest.raises(ValueError, match=r"'params/head/w'.*dimension 1 \(10\).*does not divide"):
    uneven(_path('params/head/w'), _leaf(8, 10))
  unknown = sr.by_regex([('w$', P('tensor'))], axis_sizes=SIZES)
  with pytest.raises(ValueError, match="'tensor' is not a mesh axis"):
    unknown(_path('params/head/w'), _leaf(8, 10))
  with pytest.raises(ValueError, match='not a regular expression'):
    sr.by_regex([('(', P())])
  with pytest.raises(ValueError, match='PartitionSpec or a rule'):
    sr.by_regex([('w', ('model',))])


def _linen_module():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      init = nn.initializers.lecun_normal()
      x = nn.Dense(64, kernel_init=nn.with_partitioning(init, (None, MODEL)))(x)
      x = nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ('mlp', 'embed')))(x)
      return nn.Dense(10)(nn.relu(x))

  return Net()


def test_from_flax_metadata_gives_linen_annotations_to_params_and_moments():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  module, x = _linen_module(), jnp.zeros((2, 16))
  boxed = jax.eval_shape(module.init, jax.random.key(0), x)
  rule = sr.from_flax_metadata(boxed, logical_rules=[('embed', MODEL), ('mlp', None)])

  def init(keys):
    def one(key):
      params = nn.unbox(module.init(key, x))['params']
      return {'params': params, 'opt_state': optax.adam(1e-3).init(params)}
    return jax.vmap(one)(keys)

  abstract = jax.eval_shape(init, jax.random.split(jax.random.key(0), 2))
  specs = Layout(axes=AXES, rule=rule).state_specs(abstract)
  assert specs['params']['Dense_0']['kernel'] == P(MEMBER, None, MODEL)
  assert specs['params']['Dense_1']['kernel'] == P(MEMBER, None, MODEL)
  assert specs['params']['Dense_2']['kernel'] == P(MEMBER)  # not annotated: default
  assert specs['params']['Dense_0']['bias'] == P(MEMBER)
  assert specs['opt_state'][0].mu['Dense_0']['kernel'] == P(MEMBER, None, MODEL)
  assert specs['opt_state'][0].nu['Dense_1']['kernel'] == P(MEMBER, None, MODEL)
  # The 'params' collection alone gives the same paths; other logical rules, other specs.
  by_params = sr.from_flax_metadata(boxed['params'], logical_rules=[('mlp', MODEL)])
  assert by_params(_path('params/Dense_1/kernel'), _leaf(64, 32)) == P(MODEL, None)


def test_from_flax_metadata_suffix_matching_is_by_whole_param_paths():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  boxed = {'params': {
      'Dense_0': {'kernel': nn.Partitioned(_leaf(8, 16), (None, MODEL))},
      'Block_0': {'Dense_0': {'kernel': _leaf(8, 16)}}}}
  rule = sr.from_flax_metadata(boxed, default=lambda path, leaf: P('fallback'))
  assert rule(_path('opt_state/0/mu/Dense_0/kernel'), _leaf(8, 16)) == P(None, MODEL)
  # An unannotated param whose path ends like an annotated one keeps the default.
  assert rule(_path('params/Block_0/Dense_0/kernel'), _leaf(8, 16)) == P('fallback')
  # A statistic of another shape (a factored second moment) keeps the default.
  assert rule(_path('opt_state/0/v_row/Dense_0/kernel'), _leaf(8)) == P('fallback')


def test_from_flax_metadata_reads_nnx_variable_sharding():
  from flax import nnx  # pylint: disable=import-outside-toplevel

  class Net(nnx.Module):
    def __init__(self, rngs):
      init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, MODEL))
      self.up = nnx.Linear(16, 64, kernel_init=init, rngs=rngs)
      self.out = nnx.Linear(64, 10, rngs=rngs)

  mesh = jax.make_mesh((2, 4), (DATA, MODEL), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    abstract = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))
  rule = sr.from_flax_metadata(nnx.state(abstract, nnx.Param))
  assert rule(_path('params/up/kernel'), _leaf(16, 64)) == P(None, MODEL)
  assert rule(_path('opt_state/0/mu/up/kernel'), _leaf(16, 64)) == P(None, MODEL)
  assert rule(_path('params/out/kernel'), _leaf(64, 10)) == P()
