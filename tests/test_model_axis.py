"""Members larger than one device: a third mesh axis, 'model', splits each member's leaves.

The layout prepends 'member' to a per-leaf rule (FSDP by default, the model's own Flax
annotations, or config.mesh.rules); the step stays global-view over 'data' and
'model'. Checked on 8 fake CPU devices: the same members on every mesh shape, each
large leaf's shard a quarter of it with model=4, the compiled step's arguments a
quarter, a resume onto another 'model' size, and a Flax model's annotations kept.
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dist_ens
from dist_ens.run import mesh_layout
from dist_ens import data
from dist_ens.run import assemble, initial_state
from dist_ens.errors import ConfigError
from dist_ens.parallel import mesh as mesh_lib

DEFAULT = Path(__file__).parent.parent / 'configs' / 'default.py'
STEPS, BATCH, MIN_SIZE = 8, 32, 1024


def _config(member, data_axis, model, num_members=8, widths=(64, 64)):
  config = dist_ens.load_config(DEFAULT)
  config.num_members = num_members
  config.model.widths = widths
  config.optim.learning_rate = 3e-3
  config.train.steps = STEPS
  config.data.batch_size = BATCH
  config.mesh.member, config.mesh.data, config.mesh.model = member, data_axis, model
  config.mesh.fsdp_min_size = MIN_SIZE
  return config


def _parts(config):
  return assemble.build_parts(config, mesh_layout.build_mesh(config), (40, 1), 10)


def _train(parts, batches):
  state = initial_state.init_sharded(parts)
  step = assemble.build_step(parts, per_member_batches=False, form=('vmap', None))
  sharding, hparams, losses = mesh_lib.batch_sharding(parts.mesh), parts.device_hparams(), []
  for x, y in batches:
    state, m = step(state, hparams, data.to_global(x, sharding), data.to_global(y, sharding))
    losses.append(np.asarray(m.loss))
    jax.block_until_ready(m)
  return state, np.stack(losses)


@pytest.fixture(scope='module')
def batches():
  it = data.BatchIterator(data.load_dataset('mnist1d').train, BATCH, seed=0)
  return [next(it) for _ in range(STEPS)]


@pytest.fixture(scope='module')
def reference(batches):
  parts = _parts(_config(8, 1, 1))
  assert parts.mesh.axis_names == ('member', 'data')  # model=1: today's two axes.
  return _train(parts, batches)


@pytest.mark.parametrize('shape', [(2, 2, 2), (2, 1, 4), (1, 1, 8)])
def test_members_follow_the_same_trajectory_on_every_mesh(batches, reference, shape):
  parts = _parts(_config(*shape))
  assert dict(parts.mesh.shape) == dict(zip(('member', 'data', 'model'), shape))
  state, losses = _train(parts, batches)
  ref_state, ref_losses = reference
  # Only the reduction order differs (docs/mesh.md states these tolerances).
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_with_model_4_each_large_leaf_is_a_quarter_per_device():
  parts = _parts(_config(2, 1, 4))
  state = initial_state.init_sharded(parts)
  large = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path((state.params, state.opt_state))[0]:
    member_size = leaf.size // leaf.shape[0]
    shard = leaf.addressable_shards[0].data.shape
    if member_size >= MIN_SIZE:
      large += 1
      # One member per member group (4 members / 2), a quarter of its leaf.
      assert np.prod(shard) * 4 * 2 == leaf.size, jax.tree_util.keystr(path)
      assert 'model' in leaf.sharding.spec
    elif leaf.ndim:
      assert np.prod(shard) * 2 == leaf.size  # Small leaves: whole on each model device.
  assert large == 3 * 2  # The two big kernels, their params and Adam's mu and nu.


@pytest.fixture(scope='module')
def plan_model_4():
  """(config, its plan): 4 members of a (512, 512) MLP, batch 8, on member=2 x data=1 x
  model=4; the plan compiles the run's step (and one of twice the members), runs nothing."""
  from dist_ens import plan as plan_lib  # pylint: disable=import-outside-toplevel
  config = _config(2, 1, 4, num_members=4, widths=(512, 512))
  config.data.batch_size = 8
  return config, plan_lib.make_plan(config, jax.devices(), measure_programs=False)


def test_the_compiled_step_holds_a_quarter_of_the_state_per_device(plan_model_4):
  config, plan = plan_model_4
  # What a device holds with its member group's members whole (model=1): their share of
  # every leaf of the state, counted from its shapes.
  state = _parts(config).abstract_state
  whole = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state)) // 2
  quarter = plan.step.argument  # XLA's: the compiled step's arguments on one device.
  assert 0.25 * 0.9 <= quarter / whole <= 0.25 * 1.1, (quarter, whole)


def _events(workdir):
  return [json.loads(line) for line in (Path(workdir) / 'metrics.jsonl').open()]


def test_a_run_resumes_onto_another_model_size(tmp_path):
  def run(workdir, model, steps):
    config = _config(-1, 1, model, num_members=4)
    config.train.steps, config.train.log_every, config.train.eval_every = steps, 4, 0
    config.checkpoint.every = 8
    return dist_ens.train(config, str(workdir))

  whole = run(tmp_path / 'whole', 1, 16)
  run(tmp_path / 'moved', 2, 8)
  moved = run(tmp_path / 'moved', 4, 16)  # Resumed from step 8 on a 2 x 1 x 4 mesh
  # (model=2 trained it on 4 x 1 x 2; the whole run on 4 x 1 on 4 of the devices).
  assert moved['train_step_traces'] == 1  # One compile on the new mesh, shardings kept.
  steps = [e['step'] for e in _events(tmp_path / 'moved') if e['split'] == 'train']
  assert steps == [4, 8, 12, 16]  # Continued, not restarted.
  np.testing.assert_allclose(moved['members']['nll'], whole['members']['nll'], rtol=1e-4)
  ensemble = dist_ens.Ensemble.load(str(tmp_path / 'moved'), devices=jax.devices()[:1])
  probs = ensemble.predict(np.zeros((3, 40, 1), np.float32)).probs
  assert probs.shape == (3, 10) and np.allclose(probs.sum(-1), 1, atol=1e-5)


def test_a_flax_models_own_annotations_are_honoured():
  config = _config(2, 1, 4)
  config.model.factory = 'ext_fixtures:annotated_linen_mlp'
  parts = _parts(config)
  params = parts.abstract_state.params
  specs = {jax.tree_util.keystr(p): leaf.sharding.spec
           for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  annotated = next(s for k, s in specs.items() if 'Dense_0' in k and 'kernel' in k)
  fsdp = next(s for k, s in specs.items() if 'Dense_1' in k and 'kernel' in k)
  assert annotated == P('member', 'model', None)  # Its own: the input dimension.
  assert fsdp == P('member', None, 'model')  # FSDP: the largest divisible dimension, 96.


def test_a_model_axis_that_does_not_divide_the_devices_is_refused():
  with pytest.raises(ConfigError, match=r'config\.mesh\.model=3 must divide the 8 devices'):
    _parts(_config(-1, 1, 3))


def test_plan_prints_each_leafs_spec_and_the_state_bytes_per_device(plan_model_4):
  from dist_ens import plan as plan_lib  # pylint: disable=import-outside-toplevel
  config, plan = plan_model_4
  # The layout's bytes per device equal what XLA aliases of the donated state.
  assert plan.state_bytes_per_device == plan.step.alias
  kernel = next(p for p in plan.param_leaves if p.path.endswith('1/w'))
  assert kernel.spec == P('member', None, 'model') and kernel.shape == (4, 512, 512)
  assert kernel.bytes_per_device == 2 * 512 * 128 * 4  # 2 members, a quarter of 512 columns
  assert plan.to_dict()['state_bytes_per_device'] == plan.state_bytes_per_device
  assert "P('member', None, 'model')" in plan_lib.format_plan(plan, config)


@pytest.mark.parametrize('shape', [(2, 2, 2), (4, 2, 1)])
def test_fsdp_over_data_splits_leaves_over_data_too_and_trains_the_same(
    batches, reference, shape):
  """ZeRO-3 (mesh.fsdp_over_data): a large leaf is split over data x model devices; the
  members follow the reference trajectory."""
  config = _config(*shape)
  config.mesh.fsdp_over_data = True
  parts = _parts(config)
  split = shape[1] * shape[2]
  state, losses = _train(parts, batches)
  kernel = state.params[1]['w']  # [M, 64, 64]: 4096 elements, split 4 ways.
  assert kernel.addressable_shards[0].data.size * split * shape[0] == kernel.size
  assert 'data' in str(kernel.sharding.spec)
  ref_state, ref_losses = reference
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_reproducible_mode_refuses_fsdp_over_data():
  """ZeRO-3's split follows mesh.data, so reproducible mode (bit-identical on any mesh)
  refuses it; a fixed mesh.model is allowed (tests/test_reproducible.py checks it)."""
  config = _config(4, 2, 1)
  config.reproducible, config.train.micro_batches = True, 2
  config.mesh.fsdp_over_data = True
  with pytest.raises(ConfigError, match='reproducible=True .* fsdp_over_data=False'):
    mesh_layout.build_mesh(config)
  config.mesh.fsdp_over_data, config.mesh.data, config.mesh.model = False, 1, 2
  assert mesh_layout.build_mesh(config).shape['model'] == 2


def test_model_groups_that_span_processes_are_named():
  """With model dividing the devices per host every group stays on one host; else the
  groups that cross are found (the mesh warns with them)."""
  from types import SimpleNamespace  # pylint: disable=import-outside-toplevel
  devices = [SimpleNamespace(process_index=i // 4, id=i) for i in range(8)]  # 2 hosts x 4
  by = lambda k: [devices[i:i + k] for i in range(0, 8, k)]
  assert mesh_lib.groups_across_hosts(by(2)) == [] == mesh_lib.groups_across_hosts(by(4))
  assert mesh_lib.groups_across_hosts(by(8)) == [[0, 1]]
  odd = [devices[i:i + 3] for i in (0, 3)]  # model=3 on 4-device hosts: the second crosses.
  assert mesh_lib.groups_across_hosts(odd) == [[0, 1]]


# --- config.mesh.rules (issue 45 item 2) ---------------------------------------------------

VIT_RULES_PATH = 'dist_ens.models.vit:VIT_RULES'


def _vit_config(config):
  config.model.name, config.model.patch_size, config.model.hidden = 'vit', 4, 64
  config.model.depth, config.model.heads, config.model.mlp_dim = 1, 4, 128
  return config


def _megatron_split(parts):
  """The specs VIT_RULES give (FSDP would split attn/out/w's columns, never fc1/b)."""
  block = parts.abstract_state.params['blocks'][0]
  assert block['attn']['out']['w'].sharding.spec == P('member', 'model', None)
  assert block['mlp']['fc1']['b'].sharding.spec == P('member', 'model')
  assert block['mlp']['fc2']['w'].sharding.spec == P('member', 'model', None)


def test_mesh_rules_take_an_import_path_from_python():
  config = _vit_config(_config(2, 1, 4, num_members=2))
  config.mesh.rules = VIT_RULES_PATH  # A TypeError before: the field was typed as a tuple.
  _megatron_split(_parts(config))


def test_mesh_rules_take_an_import_path_from_the_command_line():
  from absl import flags  # pylint: disable=import-outside-toplevel
  from dist_ens.config.command_line import define_config_flag  # pylint: disable=import-outside-toplevel
  argv = ['dist-ens', f'--config={DEFAULT}', f'--config.mesh.rules={VIT_RULES_PATH}']
  fv = flags.FlagValues()
  define_config_flag(fv, sys_argv=argv)
  fv(argv)
  assert fv.config.mesh.rules == VIT_RULES_PATH  # Not ('dist_ens.models.vit:VIT_RULES',).
  config = _config(2, 1, 4, num_members=2)
  config.mesh.rules = fv.config.mesh.rules
  _megatron_split(_parts(_vit_config(config)))
  # A tuple of pairs still parses as one.
  argv = ['dist-ens', f'--config={DEFAULT}', "--config.mesh.rules=(('fc1/w$', (None, 'model')),)"]
  fv = flags.FlagValues()
  define_config_flag(fv, sys_argv=argv)
  fv(argv)
  assert fv.config.mesh.rules == (('fc1/w$', (None, 'model')),)


def _one_line_refusal(config, match):
  with pytest.raises(ConfigError, match=match) as refused:
    _parts(config)
  assert '\n' not in str(refused.value)
  return str(refused.value)


def test_a_rule_whose_axis_does_not_divide_the_dimension_is_one_line():
  config = _config(2, 1, 4, num_members=2)
  config.mesh.rules = (('2/w$', (None, 'model')),)  # The head [64, 10]: 4 does not divide 10.
  message = _one_line_refusal(config, r"config\.mesh\.rules: .*'2/w\$'.*does not divide")
  assert "'params/2/w' of shape (64, 10)" in message


def test_a_rule_that_matches_no_leaf_is_refused_naming_leaf_paths():
  config = _config(2, 1, 4, num_members=2)
  config.mesh.rules = (('^0/w$', (None, 'model')),)  # Paths begin with 'params/'.
  message = _one_line_refusal(config, r"config\.mesh\.rules: '\^0/w\$' matches no leaf")
  assert 'params/0/w' in message
  config.mesh.rules = 'dist_ens.models.vit:NO_SUCH_RULES'
  _one_line_refusal(config, 'has no attribute')
  config.mesh.rules = (('0/w$',),)
  _one_line_refusal(config, r'config\.mesh\.rules.*\(regex, spec\) pairs')


# --- loading a run whose members are split over 'model' (issue 45 item 1) -------------------


@pytest.fixture(scope='module')
def split_run(tmp_path_factory):
  """Two members, each split over model=2 devices (2 x 2 x 2), 4 steps."""
  config = _config(2, 2, 2, num_members=2)
  config.train.steps, config.train.log_every, config.train.eval_every = 4, 4, 0
  config.checkpoint.every = 4
  workdir = tmp_path_factory.mktemp('split_run')
  dist_ens.train(config, str(workdir))
  return config, workdir


def _shards(tree):
  return {jax.tree_util.keystr(p): leaf.addressable_shards[0].data.shape
          for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_a_run_split_over_model_loads_predicts_and_exports_split(split_run, tmp_path):
  from dist_ens.parallel import load_mesh  # pylint: disable=import-outside-toplevel
  config, workdir = split_run
  trained = _parts(config).abstract_state  # The training layout, 2 x 2 x 2.
  budget = load_mesh.held_bytes(trained)  # A device's share of the params, as trained.
  # One member whole exceeds that budget (what `dist-ens plan` says of a member's params).
  member_bytes = sum(leaf.size * leaf.dtype.itemsize
                     for leaf in jax.tree.leaves(trained.params)) // 2
  assert member_bytes > budget

  ens = dist_ens.Ensemble.load(workdir, memory_gb=budget / 1e9)
  assert dict(ens.mesh.shape) == {'member': 2, 'data': 2, 'model': 2}  # As trained.
  want = {k: leaf.sharding.shard_shape(leaf.shape) for k, leaf in
          ((jax.tree_util.keystr(p), leaf)
           for p, leaf in jax.tree_util.tree_flatten_with_path(trained.params)[0])}
  assert _shards(ens._stored) == want  # pylint: disable=protected-access
  assert want['[1][\'w\']'] == (1, 64, 32) and want['[2][\'w\']'] == (1, 64, 10)

  # Members whole on a member x data mesh: the same predictions, to rounding.
  whole = dist_ens.Ensemble.load(workdir, mesh={'member': 2, 'data': 4})
  assert dict(whole.mesh.shape) == {'member': 2, 'data': 4}
  assert _shards(whole._stored)['[1][\'w\']'] == (1, 64, 64)  # pylint: disable=protected-access
  x = data.load_dataset('mnist1d').test.x[:50]
  split_out, whole_out = ens.predict(x, preprocessed=True), whole.predict(x, preprocessed=True)
  np.testing.assert_allclose(split_out.member_probs, whole_out.member_probs, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(split_out.probs, whole_out.probs, rtol=1e-5, atol=1e-6)
  paths = ens.export(tmp_path / 'members')
  exported = dist_ens.load_member(paths[1])
  for got, want_leaf in zip(jax.tree.leaves(exported), jax.tree.leaves(whole.member(1))):
    np.testing.assert_array_equal(got, want_leaf)

  # That mesh cannot hold a whole member within the budget: refused, naming what fits.
  with pytest.raises(ConfigError) as refused:
    dist_ens.Ensemble.load(workdir, mesh={'member': 2, 'data': 4}, memory_gb=budget / 1e9)
  message = str(refused.value)
  assert '\n' not in message
  assert 'the mesh member=2 x data=4 cannot hold the members' in message
  assert "mesh={'model': 2} (member=2 x data=2 x model=2) fits" in message


def test_a_mesh_that_cannot_split_the_members_is_refused_in_one_line(split_run):
  _, workdir = split_run
  for mesh, match in [({'member': 4, 'data': 2}, 'does not divide them'),
                      ({'member': 2, 'model': 3}, r'model=3 must divide the 8 devices'),
                      ({'members': 2}, "unknown field 'members'"),
                      # The run's rules: FSDP's never fail; a model axis of 8 splits all.
                      ]:
    with pytest.raises(ConfigError, match=match) as refused:
      dist_ens.Ensemble.load(workdir, mesh=mesh)
    assert '\n' not in str(refused.value) and str(refused.value).startswith('Ensemble.load')


class _Loaded(Exception):
  """Ends a report right after its Ensemble.load (what the fast test below reads)."""


def _report_loads(workdir, monkeypatch, then_stop):
  """[(mesh shape, the first hidden kernel's shard shape)] of each Ensemble.load that
  report.make_report(workdir) makes; with `then_stop` the report ends after its load,
  else it is written and its page checked."""
  pytest.importorskip('matplotlib')
  from dist_ens.report import build as report  # pylint: disable=import-outside-toplevel
  load, seen = dist_ens.Ensemble.load.__func__, []

  def spy(cls, *args, **kwargs):
    ensemble = load(cls, *args, **kwargs)
    stored = ensemble._stored  # pylint: disable=protected-access
    seen.append((dict(ensemble.mesh.shape), _shards(stored)["[1]['w']"]))
    if then_stop:
      raise _Loaded
    return ensemble

  monkeypatch.setattr(report.Ensemble, 'load', classmethod(spy))
  if then_stop:
    with pytest.raises(_Loaded):
      report.make_report(workdir)
  else:
    assert (report.make_report(workdir) / 'report.html').is_file()
  return seen


def test_the_report_loads_a_split_run_split(split_run, monkeypatch):
  """The report's Ensemble.load keeps the run's model split (stopped there: what follows,
  predict on that mesh and the drawing, is the slow test's below)."""
  seen = _report_loads(split_run[1], monkeypatch, then_stop=True)
  assert seen == [({'member': 2, 'data': 2, 'model': 2}, (1, 64, 32))]


# Slow: predicting the test split and drawing every figure (matplotlib). Fast covers:
# test_the_report_loads_a_split_run_split (the report's load, split), predict on the split
# mesh in test_a_run_split_over_model_loads_predicts_and_exports_split, and test_report
# (every figure drawn).
@pytest.mark.slow
def test_the_report_of_a_split_run_is_written(split_run, monkeypatch):
  seen = _report_loads(split_run[1], monkeypatch, then_stop=False)
  assert seen == [({'member': 2, 'data': 2, 'model': 2}, (1, 64, 32))]
