"""config.ensemble.member_parallelism: explicit choices, 'auto' by the rule table, bad values."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

from dist_ens.parallel import strategy as parallelism
from dist_ens.core.step import MEMBER_PARALLELISM, over_members
from dist_ens.errors import ConfigError
from model_specs import model_spec


def _ensemble(member_parallelism='auto', map_batch_size=0):
  """config.ensemble's two fields, as strategy.resolve takes them."""
  return member_parallelism, map_batch_size


@pytest.mark.parametrize('choice,chunk,expected', [
    ('vmap', 0, ('vmap', None)),
    ('map', 0, ('map', None)),
    ('map', 4, ('map', 4)),
])
def test_an_explicit_choice_is_taken_as_given(choice, chunk, expected):
  for platform in ('cpu', 'gpu', 'tpu'):
    assert parallelism.resolve(*_ensemble(choice, chunk), 'mlp', platform, 16) == expected


@pytest.mark.parametrize('key', sorted(parallelism.AUTO_RULES))
@pytest.mark.parametrize('members', [1, 4, 16, 64, None])
def test_auto_follows_the_table(key, members):
  platform, model = key
  # The table read by hand: the first bucket whose bound covers the members (a
  # bound of None covers any count, and is the only one an unknown count takes).
  expected = parallelism.DEFAULT_FORM
  for bound, form in parallelism.AUTO_RULES[key]:
    if bound is None or (members is not None and members <= bound):
      expected = form
      break
  assert parallelism.resolve(*_ensemble('auto'), model, platform, members) == expected


def test_auto_picks_the_bucket_of_the_members_per_device(monkeypatch):
  monkeypatch.setattr(parallelism, 'AUTO_RULES', {
      ('cpu', 'mlp'): ((8, ('vmap', None)), (32, ('map', 4)), (None, ('map', None)))})
  resolve = lambda m: parallelism.resolve(*_ensemble('auto'), 'mlp', 'cpu', m)
  assert [resolve(m) for m in (1, 8, 9, 32, 33)] == [
      ('vmap', None), ('vmap', None), ('map', 4), ('map', 4), ('map', None)]
  assert resolve(None) == ('map', None)  # Unknown count: the rule for the most members.


def test_auto_without_a_rule_is_vmap():
  assert parallelism.resolve(*_ensemble('auto'), 'mlp', 'some_new_backend', 8) == ('vmap', None)
  assert parallelism.resolve(*_ensemble('auto'), 'transformer', 'cpu', 8) == ('vmap', None)


def test_auto_ignores_map_batch_size():
  assert parallelism.resolve(*_ensemble('auto', 7), 'cnn', 'cpu', 8) == parallelism.auto_form(
      'cnn', 'cpu', 8)


def test_every_form_in_the_table_runs():
  for rules in parallelism.AUTO_RULES.values():
    for bound, (form, chunk) in rules:
      assert bound is None or (isinstance(bound, int) and bound >= 1)
      assert form in MEMBER_PARALLELISM
      assert chunk is None or (isinstance(chunk, int) and chunk > 1)
      f = over_members(lambda w, x: w * x, form, in_axes=(0, None), map_batch_size=chunk)
      assert f(jnp.arange(4.0), 2.0).tolist() == [0.0, 2.0, 4.0, 6.0]


def test_map_updates_the_stacked_state_where_it_lies():
  # A donated 'map' step over stacked MLP members with Adam: the loop must write each
  # member's new state into the state's buffers, never copy a whole stacked array (XLA:CPU
  # did, every iteration, when the optimizer's arithmetic fused into the writes).
  members, sizes = 4, (12, 32, 32, 3)
  params = [0.1 * jax.random.normal(jax.random.key(i), (members, a, b))
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]
  opt = optax.adam(1e-3)
  opt_state = jax.vmap(opt.init)(params)

  def update(p, o, x):
    loss = lambda p: jnp.sum(jax.nn.relu(x @ p[0]) @ p[1] @ p[2])
    updates, o = opt.update(jax.grad(loss)(p), o, p)
    return optax.apply_updates(p, updates), o

  step = jax.jit(over_members(update, 'map', in_axes=(0, 0, None), in_place=2),
                 donate_argnums=(0, 1))
  hlo = step.lower(params, opt_state, jnp.ones((8, sizes[0]))).compile().as_text()
  stacked = '|'.join(rf'f32\[{members},{a},{b}\]' for a, b in zip(sizes[:-1], sizes[1:]))
  assert re.search(r'while\(', hlo)  # Still one loop over the members,
  assert not re.findall(rf'(?:{stacked})\{{[^}}]*\}} copy\(', hlo)  # and no stack copied.


@pytest.mark.parametrize('value', ['pmap', 'VMAP', '', None, 3])
def test_a_bad_parallelism_is_rejected_naming_the_field(value):
  with pytest.raises(ConfigError, match=r'config\.ensemble\.member_parallelism') as e:
    parallelism.resolve(*_ensemble(value), 'mlp', 'cpu', 8)
  assert "'auto'" in str(e.value)  # And says what would work.


@pytest.mark.parametrize('value', [-1, 1.5, '4', True, None])
def test_a_bad_map_batch_size_is_rejected_naming_the_field(value):
  for choice in ('map', 'vmap', 'auto'):
    with pytest.raises(ConfigError, match=r'config\.ensemble\.map_batch_size'):
      parallelism.resolve(*_ensemble(choice, value), 'mlp', 'cpu', 8)


def _train_config(**train):
  from pathlib import Path
  from dist_ens.config.loading import load_config
  config = load_config(Path(__file__).resolve().parents[1] / 'configs' / 'default.py')
  config.train.update(train)
  return config


def _steps_per_call(config, platform, start_step=0, cadences=(), **kw):
  """strategy.steps_per_call with the cadences the trainer passes for `config`."""
  every = (config.train.steps, config.train.log_every, config.train.eval_every,
           config.checkpoint.every, start_step, *cadences)
  return parallelism.steps_per_call(config.train.steps_per_call, every, platform, **kw)


def test_auto_steps_per_call_divides_every_cadence():
  # default.py: steps 2000, log_every 250, eval_every 1000, checkpoint.every 500: the
  # largest divisor of their gcd (250) up to 100 is 50.
  config = _train_config(steps_per_call=0)
  assert _steps_per_call(config, 'gpu') == 50
  # On a CPU, K steps must hold at most AUTO_CPU_CALL_FLOPS: unknown FLOPs give 1, a
  # step of 1/20 of the budget the largest divisor of 250 up to 20, a bigger step 1.
  budget = parallelism.AUTO_CPU_CALL_FLOPS
  assert _steps_per_call(config, 'cpu') == 1
  assert _steps_per_call(config, 'cpu', step_flops=lambda: budget / 20) == 10
  assert _steps_per_call(config, 'cpu', step_flops=lambda: budget * 0.6) == 1
  # A user's periodic action joins the cadences: gcd(250, 30) = 10.
  assert _steps_per_call(config, 'gpu', cadences=(30,)) == 10
  # Resuming from step 30: calls must land on it too.
  assert _steps_per_call(config, 'tpu', start_step=30) == 10
  # An eval_every of 0 adds no cadence; a log_every of 7 leaves only 1.
  assert _steps_per_call(_train_config(steps_per_call=0, eval_every=0,
                                                  log_every=200), 'gpu') == 100
  assert _steps_per_call(_train_config(steps_per_call=0, log_every=7), 'gpu') == 1
  # K batches of input must stay under AUTO_INPUT_BYTES: 16 MiB a step allows 4, and
  # the largest divisor of 250 up to 4 is 2.
  assert _steps_per_call(config, 'gpu', input_bytes_per_step=16 * 2**20) == 2
  # An explicit value is taken as given, on any platform.
  assert _steps_per_call(_train_config(steps_per_call=5), 'gpu') == 5
  assert _steps_per_call(_train_config(steps_per_call=5), 'cpu') == 5


def test_members_are_vmapped_or_chunked_by_the_bytes_they_touch():
  vmap_budget, chunk_budget, _ = parallelism.MEMBER_BUDGETS[('cpu', 'cnn')]
  form = lambda members, per_member, platform='cpu': parallelism.auto_form(
      'cnn', platform, members,
      None if per_member is None else lambda: parallelism.MemberSize(per_member, 0))
  assert form(16, vmap_budget // 16) == ('vmap', None)  # All 16 fit the vmap budget.
  assert form(17, vmap_budget // 16)[0] == 'map'  # One more does not.
  assert form(64, chunk_budget // 8) == ('map', 8)  # 8 fit a chunk: chunks of 8.
  assert form(64, chunk_budget // 3) == ('map', 2)  # 3 fit: chunks of the power of two below.
  assert form(64, chunk_budget * 2) == ('map', None)  # Not even one fits: one at a time.
  assert form(64, 2**20, 'gpu') == ('vmap', None)  # No budgets there: the table.
  assert form(64, None) == ('map', None)  # Size unknown: the table's fallback.


def test_one_member_per_device_is_vmapped_from_its_parameter_bytes():
  budget = parallelism.MEMBER_BUDGETS[('cpu', 'mlp')].one_member
  form = lambda params: parallelism.auto_form(
      'mlp', 'cpu', 1, lambda: parallelism.MemberSize(step=10**9, params=params))
  # Touching more than the vmap budget does not matter with one member; its parameters do.
  assert form(budget) == ('vmap', None)
  assert form(budget - 1) == ('map', None)


def test_member_size_counts_the_parameters_once():
  from dist_ens import models
  mlp = models.get_model(model_spec(name='mlp', widths=(16,)), 10)
  params = 4 * ((8 * 16 + 16) + (16 * 10 + 10))
  size = parallelism.member_size(mlp, (8,), 32)
  assert size.params == params
  assert size.step == parallelism.member_bytes(mlp, (8,), 32)


def test_member_bytes_count_the_forward_pass_and_four_copies_of_the_parameters():
  from dist_ens import models
  cnn = models.get_model(model_spec(
      name='cnn', channels=(4,), kernel_sizes=(3,), strides=(1,), conv_impl='xla'), 10)
  params = 4 * ((3 * 1 * 4 + 4) + (40 * 10 + 10))  # The conv's kernel and bias, the head's.
  # One conv layer on [B, 10, 1] with lax.conv, float32: conv out [B,10,4], the bias
  # broadcast [1,1,4], + bias, relu, flatten [B,40], head dot [B,10], its bias
  # broadcast [1,10], + bias.
  for batch in (8, 16):
    floats = batch * 40 + 4 + batch * 40 + batch * 40 + batch * 40 + batch * 10 + 10 + batch * 10
    size = parallelism.member_size(cnn, (10, 1), batch)
    assert size.params == params
    assert size.step == parallelism.member_bytes(cnn, (10, 1), batch) == 4 * floats + 4 * params


def test_forward_flops_count_the_matmuls():
  from dist_ens import models
  mlp = models.get_model(model_spec(name='mlp', widths=(16,)), 10)
  for batch in (8, 32):
    matmuls = 2 * batch * (40 * 16 + 16 * 10)  # [B, 40] @ [40, 16], [B, 16] @ [16, 10]
    # XLA also counts the bias adds and the relu: a few percent more.
    assert 1.0 <= parallelism.forward_flops(mlp, (40, 1), batch) / matmuls < 1.1
