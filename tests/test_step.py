"""The sharded, vmapped train step against the seed article's Python loop over members."""

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import support

import dist_ens
from dist_ens.run import mesh_layout
from dist_ens import data
from dist_ens.run import assemble, initial_state
from dist_ens.tasks.classification import cross_entropy
from dist_ens.parallel import mesh as mesh_lib

NUM_MEMBERS, STEPS, BATCH = 8, 20, 32
DEFAULT = Path(__file__).parent.parent / 'configs' / 'default.py'


def _setup(member, data_axis, optimizer='adam'):
  """The parts of an 8-member MLP run on a member x data mesh (dist_ens.run.assemble), built
  once in this module (the tests only read them; _with makes changed copies)."""
  return _parts(member, data_axis, optimizer)


@functools.cache
def _parts(member, data_axis, optimizer):
  """_setup's parts, uncached."""
  config = dist_ens.load_config(DEFAULT)
  config.num_members = NUM_MEMBERS
  config.model.widths = (64, 64)
  config.optim.name = optimizer
  config.optim.learning_rate = 3e-3 if optimizer == 'adam' else 0.1
  config.optim.weight_decay = 1e-4
  config.optim.schedule, config.optim.warmup_steps = 'cosine', 5
  config.train.steps = STEPS
  config.mesh.member, config.mesh.data = member, data_axis
  config.data.batch_size = BATCH
  mesh = mesh_layout.build_mesh(config)
  return assemble.build_parts(config, mesh, (40, 1), 10)


_BUILT = {}  # (what it is, id(parts), options) -> (parts, the program): built once per parts.


def _built(what, parts, make, **kw):
  """make(parts, **kw), made once per parts object and options in this module (the parts
  are kept beside it, so their id is not reused)."""
  key = (what, id(parts), tuple(sorted(kw.items())))
  if key not in _BUILT:
    _BUILT[key] = parts, make(parts, **kw)
  return _BUILT[key][1]


def _step(parts, per_member_batches=False, form=('vmap', None), **kw):
  """The step of `parts` (one jitted function per parts and options, defaults spelled out
  or not: a test that asserts one trace sees every call this module made of it)."""
  return _built('step', parts, assemble.build_step, per_member_batches=per_member_batches,
                form=form, **kw)


def _init(parts):
  """A fresh initial state of `parts`: init_sharded's program (one stack, no init_from:
  initial_state.compile_init), compiled once per parts (_with's copies share it: step
  options do not change the initial state)."""
  parts = _WITH_BASE.get(id(parts), (None, parts))[1]
  return _built('init', parts, initial_state.compile_init)()


def _batches(dataset, n=STEPS):
  it = data.BatchIterator(dataset.train, BATCH, seed=0)
  return [next(it) for _ in range(n)]


@pytest.fixture(scope='module')
def mnist1d():
  return data.load_dataset('mnist1d')


def _train_sharded(parts, batches, state=None, **step_kw):
  state = state or _init(parts)
  train_step = _step(parts, **step_kw)
  sharding = mesh_lib.batch_sharding(parts.mesh)
  hparams = parts.device_hparams()
  losses = []
  for x, y in batches:
    state, m = train_step(state, hparams, data.to_global(x, sharding), data.to_global(y, sharding))
    losses.append(np.asarray(m.loss))
    jax.block_until_ready(m)  # CPU collectives must not queue up (see training/trainer.py).
  return state, np.stack(losses), train_step


@pytest.mark.parametrize('member,data_axis,optimizer', [
    (4, 2, 'adam'), (2, 4, 'sgd'), (1, 8, 'adam'), (8, 1, 'adam')])  # (8, 1): one per device
def test_matches_python_loop_over_members(mnist1d, member, data_axis, optimizer):
  parts = _setup(member, data_axis, optimizer)
  batches = _batches(mnist1d)
  start = _init(parts)
  init = jax.tree.map(np.asarray, start)  # Copied before the step donates it.
  state, losses, _ = _train_sharded(parts, batches, state=start)

  # The seed article's baseline: each member alone, its own jitted step, one device.
  model, tx = parts.model, parts.optimizer(None)

  @jax.jit
  def single_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(
        lambda p: cross_entropy(model.apply(p, {}, x, train=True)[0], y, 0.0))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  for i in range(NUM_MEMBERS):
    params = jax.tree.map(lambda leaf: leaf[i], init.params)
    opt_state = jax.jit(tx.init)(params)
    member_losses = []
    for x, y in batches:
      params, opt_state, loss = single_step(params, opt_state, x, y)
      member_losses.append(float(loss))
    np.testing.assert_allclose(losses[:, i], member_losses, atol=1e-5, rtol=1e-5)
    # The whole state, optimizer moments included: a gradient scaled by the number of
    # data shards would leave Adam's parameters almost unchanged but not its moments.
    # Adam divides by sqrt(v): where a gradient is ~0, summation-order rounding can
    # move single weights by up to ~1e-4 over 20 steps.
    expected = (params, opt_state)
    got = jax.tree.map(lambda leaf: np.asarray(leaf)[i], (state.params, state.opt_state))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-3),
                 got, expected)


def test_members_keep_their_own_optimizer_state(mnist1d):
  state, _, _ = _train_sharded(_setup(4, 2), _batches(mnist1d, 3))
  mus = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
         if 'mu' in jax.tree_util.keystr(path)]  # Adam's first moments.
  assert mus
  first = np.asarray(mus[0])
  assert first.shape[0] == NUM_MEMBERS
  assert not np.allclose(first[0], first[1])  # Different members, different moments.


def test_step_traces_once_and_state_stays_sharded(mnist1d):
  # SGD with momentum (its trace: one leaf per parameter, per member): the parts, and the
  # one step, of the 2 x 4 mesh that the tests beside it read.
  state, _, train_step = _train_sharded(_setup(2, 4, 'sgd'), _batches(mnist1d, 12))
  assert train_step.traces == 1
  for leaf in jax.tree.leaves(state._replace(step=None)):
    assert leaf.sharding.spec[0] == 'member'
  # The step counter is one replicated scalar (the default per-leaf rule).
  assert state.step.sharding.spec == jax.sharding.PartitionSpec() and int(state.step) == 12


def test_nonfinite_member_is_frozen_and_others_unaffected(mnist1d):
  parts = _setup(4, 2)
  batches = _batches(mnist1d, 6)
  clean, _, _ = _train_sharded(parts, batches)
  before = jax.tree.map(np.array, _init(parts))
  # Member 3's weights become NaN: its loss and gradients are non-finite from step 1.
  for leaf in jax.tree.leaves(before.params):
    leaf[3] = np.nan
  poisoned = jax.device_put(before, parts.state_shardings)
  state, losses, _ = _train_sharded(parts, batches, state=poisoned)
  assert np.asarray(state.frozen).tolist() == [i == 3 for i in range(NUM_MEMBERS)]
  assert not np.isfinite(losses[:, 3]).any()
  # The frozen member's parameters did not move; its optimizer saw only zero
  # gradients, so its state stayed finite.
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a)[3], b[3]),
               state.params, before.params)
  for leaf in jax.tree.leaves(state.opt_state):
    assert np.isfinite(np.asarray(leaf)[3]).all()
  for i in (0, 1, 2, 4, 5, 6, 7):  # Everyone else: bit for bit the clean run.
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a)[i], np.asarray(b)[i]),
                 state.params, clean.params)


def test_one_member_per_device_updates_its_optimizer_state_where_it_lies():
  # 8 members on 8 devices, vmapped: each device's member runs its forward and backward
  # pass on its own slices, and its optimizer on the stored [1, ...] state. Squeezing the
  # state too made XLA:CPU recompute Adam's moments inside the parameter update and copy
  # the moments (and the new parameters) every step.
  # Only the compiled program is read: the state is abstract (its shapes and the shardings
  # a run's state has), so no init program is compiled nor run.
  parts = _setup(8, 1)
  step = _step(parts)
  state = parts.abstract_state
  sharding = mesh_lib.batch_sharding(parts.mesh)
  x = jax.ShapeDtypeStruct((BATCH, 40, 1), jnp.float32, sharding=sharding)
  y = jax.ShapeDtypeStruct((BATCH,), jnp.int32, sharding=sharding)
  hlo = step.fn.lower(state, parts.device_hparams(), x, y).compile().as_text()
  kernels = {leaf.shape[1:] for leaf in jax.tree.leaves(state.params) if leaf.ndim == 3}
  assert kernels  # The MLP's [in, out] kernels, [1, in, out] on each device.
  shapes = '|'.join(rf'f32\[1,{a},{b}\]' for a, b in kernels)
  assert not re.findall(rf'(?:{shapes})\{{[^}}]*\}} copy\(', hlo)


@pytest.mark.parametrize('parallelism,chunk', [('map', None), ('map', 4)])
def test_lax_map_over_members_matches_vmap(mnist1d, parallelism, chunk):
  parts = _setup(2, 4, 'sgd')  # The member forms do not depend on the optimizer.
  batches = _batches(mnist1d, 5)
  results = []
  for how, size in (('vmap', None), (parallelism, chunk)):  # vmap: the module's _step(parts)
    state, _, step = _train_sharded(parts, batches, form=(how, size))
    assert step.traces == 1
    results.append(jax.tree.map(np.asarray, state.params))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), *results)


@pytest.mark.parametrize('per_member', [False, True])
def test_steps_per_call_equals_that_many_calls(mnist1d, per_member):
  """One call of K scanned steps == K calls of the one-step function, on a 4x2 mesh."""
  parts = _setup(4, 2)
  mesh, hparams = parts.mesh, parts.device_hparams()
  k, calls = 3, 2
  rng = np.random.default_rng(0)
  lead = (k * calls, NUM_MEMBERS, BATCH) if per_member else (k * calls, BATCH)
  xs = mnist1d.train.x[rng.integers(0, 1000, lead)]
  ys = mnist1d.train.y[rng.integers(0, 1000, lead)]
  init = lambda: _init(parts)
  spec = ('member', 'data') if per_member else ('data',)
  one_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  many_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, *spec))

  single = _step(parts, per_member_batches=per_member)
  state, losses = init(), []
  for x, y in zip(xs, ys):
    state, m = single(state, hparams, jax.device_put(x, one_sharding),
                      jax.device_put(y, one_sharding))
    losses.append(np.asarray(m.loss))
  scanned = _step(parts, per_member_batches=per_member, steps_per_call=k)
  state_k, losses_k = init(), []
  for c in range(calls):
    block = slice(c * k, (c + 1) * k)
    state_k, m = scanned(state_k, hparams, jax.device_put(xs[block], many_sharding),
                         jax.device_put(ys[block], many_sharding))
    assert m.loss.shape == (k, NUM_MEMBERS)
    losses_k.append(np.asarray(m.loss))
  assert scanned.traces == 1
  np.testing.assert_allclose(np.concatenate(losses_k), np.stack(losses), rtol=1e-6, atol=1e-7)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                                                       atol=1e-7), state_k, state)
  assert jax.tree.leaves(state_k.params)[0].sharding.spec[0] == 'member'
  assert int(state_k.step) == k * calls


def test_steps_per_call_must_be_positive(mnist1d):
  with pytest.raises(ValueError, match='steps_per_call=0'):
    _step(_setup(8, 1), steps_per_call=0)


# id(a copy _with made) -> (the copy, the parts it was made from): _init reads the latter's
# program, and the copy is kept so that its id is not reused.
_WITH_BASE = {}


def _with(parts, **options):
  """The same parts with step options changed (core.step.StepOptions: what the config's
  precision, train.micro_batches and reproducible set); `parts` itself where nothing
  changes (its step, compiled once, serves)."""
  stack = parts.stack
  changed = stack.options._replace(**options)
  if changed == stack.options:
    return parts
  copy = parts._replace(stack=stack._replace(options=changed))
  _WITH_BASE[id(copy)] = copy, parts
  return copy


@pytest.mark.parametrize('reproducible', [False, True])
def test_micro_batches_give_the_full_batch_update(mnist1d, reproducible):
  """K micro-batches of B/K examples average to the gradient of the whole batch (an MLP:
  no BatchNorm, whose statistics would be per micro-batch). The whole batch's update is
  the plain step's, whole and not reproducible, for both modes: one program (the module's
  step of these parts), and a reference that shares no code with reproducible mode's
  canonical sums (which on 4 data shards take at least 4 micro-batches)."""
  parts = _setup(2, 4, 'sgd')
  batches = _batches(mnist1d, 3)
  whole, whole_losses, _ = _train_sharded(parts, batches)
  cut, cut_losses, _ = _train_sharded(_with(parts, reproducible=reproducible, micro_batches=8),
                                      batches)
  np.testing.assert_allclose(cut_losses, whole_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), cut.params, whole.params)
  moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                       cut.params, _init(parts).params)
  assert max(jax.tree.leaves(moved)) > 1e-3  # the steps did train


def test_bfloat16_computes_in_bf16_and_keeps_float32_state(mnist1d):
  parts = _setup(4, 2, 'adam')
  batches = _batches(mnist1d, 5)
  f32, f32_losses, _ = _train_sharded(parts, batches)
  bf16, bf16_losses, _ = _train_sharded(_with(parts, precision='bfloat16'), batches)
  assert {leaf.dtype for leaf in jax.tree.leaves((bf16.params, bf16.opt_state))
          if jnp.issubdtype(leaf.dtype, jnp.floating)} == {jnp.dtype('float32')}
  # bf16 keeps ~3 significant digits: the losses follow float32's, and are not float32's.
  np.testing.assert_allclose(bf16_losses, f32_losses, rtol=2e-2)
  assert not np.array_equal(bf16_losses, f32_losses)


@pytest.mark.parametrize('model', ['mlp', 'cnn'])
def test_init_compiled_faster_on_a_cpu_gives_xlas_default_bits(model, monkeypatch):
  """init_sharded compiles the init program with INIT_COMPILER_OPTIONS on a CPU; the state
  is the one XLA's default optimisation gives, bit for bit (on 8 devices: sharded). The
  tests' XLA_FLAGS set -O0, which once-run programs keep: not here. The reference is
  compiled as runs compile it (support.XLA_DEFAULT: -O3 and XLA:CPU's fusion emitters, which
  the tests' XLA_FLAGS turn off): -O3 without the emitters compiled the init program of a
  (16,) MLP in 6.5 CPU s instead of 1.7, to the same bits."""
  monkeypatch.setenv('XLA_FLAGS', support.xla_flags(8).replace(support.LLVM_O0, ''))
  config = dist_ens.load_config(DEFAULT)
  config.model.name, config.num_members = model, 8
  # The MLP: one hidden layer of 16. Each kernel's draw is elementwise code whatever its size
  # (the default (256, 256) MLP's reference compiled in 4.4 CPU s instead of 1.7, to the
  # same bits).
  config.model.widths = (16,) if model == 'mlp' else config.model.widths
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config), (40, 1), 10)
  fast = initial_state.init_sharded(parts)
  default = jax.jit(parts.init, out_shardings=parts.state_shardings).lower().compile(
      compiler_options=support.XLA_DEFAULT)()
  leaves = jax.tree.leaves(fast)
  assert len(leaves) == len(jax.tree.leaves(default)) > 4
  for a, b in zip(leaves, jax.tree.leaves(default)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  kernel = np.asarray(max(jax.tree.leaves(fast.params), key=lambda a: a.size))
  assert not np.array_equal(kernel[0], kernel[1])  # Members differ: the test can fail.


@functools.cache
def _member_update(tx):
  """core.step's per-member update with optimizer `tx` of fresh params by grads (loss 1.0),
  jitted as in a step: (params, grads) -> (the new Member, its metrics)."""
  from dist_ens.core.step import BatchResult, Member, member_apply_fn
  return jax.jit(lambda params, grads: member_apply_fn(lambda hp: tx)(
      Member(params, {}, tx.init(params), jnp.bool_(False)), {},
      BatchResult(jnp.float32(1.0), jnp.float32(0.5), grads, {})))


def _apply_one(tx, params, grads):
  return _member_update(tx)(params, grads)


_ADAM = optax.adam(0.1)  # One optimizer object: the four cases below share one program.


@pytest.mark.parametrize('bad', [[np.nan], [np.inf], [-np.inf], [np.inf, -np.inf]])
def test_a_nonfinite_gradient_with_a_finite_loss_freezes_the_member(bad):
  """The guard reads each gradient leaf's sum: any NaN or infinity (opposite infinities
  included, whose sum is NaN) freezes the member before its state moves."""
  params = {'w': np.ones((3, 4), np.float32), 'b': np.zeros(4, np.float32)}
  w = np.full((3, 4), 0.5, np.float32)
  w[0, :len(bad)] = bad
  new, metrics = _apply_one(_ADAM, params, {'w': w, 'b': np.ones(4, np.float32)})
  new_params, opt_state, frozen = new.params, new.opt_state, new.frozen
  assert bool(frozen) and bool(metrics.nonfinite)
  jax.tree.map(np.testing.assert_array_equal, new_params, params)
  assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(opt_state))


def test_large_finite_half_precision_gradients_do_not_freeze():
  """A float16 leaf whose elements sum past float16's range (65504) is summed wider."""
  params = {'w': np.ones(8, np.float16)}
  new, _ = _apply_one(optax.sgd(1e-6), params, {'w': np.full(8, 60000.0, np.float16)})
  new_params, frozen = new.params, new.frozen
  assert not bool(frozen)
  assert not np.array_equal(np.asarray(new_params['w']), params['w'])
