"""Cyclical SG-MCMC (config.ensemble.method='sgmcmc'; ensembles/sgmcmc.py).

The step size and the sampling phases against Zhang et al. 2020's formula worked out
here by hand; the sampler's real update (its optimizer and its noisy members_update) on
a 1-D Gaussian posterior reaches the posterior's mean and variance, for SGLD and SGHMC;
the noise is each member's own and member m's chain is the same whatever M; then one run
and its resume: resume is exact, Ensemble.load predicts with M x cycles x samples_per_cycle
members, each chain's samples in its own rows (member m's chain in a 2- and a 4-member run
in the slow tier); the refusals. What every method's run keeps, one trace, predict as
reported, the same on one device and export per member, is the combination matrix's
(tests/test_combinations.py, its sgmcmc case).

The convention checked: the loss is a mean over N = sgmcmc.data_size examples, so the
posterior exp(-N L) at T = 1: for L(theta) = mean_i (theta - x_i)^2 / 2 it is
N(mean x, 1 / N).
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runs
import support

import dist_ens
from dist_ens import Ensemble, data
from dist_ens.config import specs
from dist_ens.core.step import BatchResult, Member, member_apply_fn
from dist_ens.ensembles import methods, sgmcmc


def test_the_step_size_and_sampling_phases_are_the_papers_formula():
  # K = 100 steps, M = 4 cycles: ceil(K / M) = 25; beta = 0.8.
  steps, cycles, beta = 100, 4, 0.8
  for k in range(1, steps + 1):
    r = ((k - 1) % 25) / 25
    assert float(sgmcmc.rate(k - 1, steps, cycles)) == pytest.approx(
        (math.cos(math.pi * r) + 1) / 2, abs=1e-6)
    assert bool(sgmcmc.sampling(k - 1, steps, cycles, beta)) == (r >= beta)
  # Cycle 1's sampling updates are k = 21..25 (r = 20/25 = 0.8 on); cycle 2's 46..50.
  assert [k for k in range(1, 51) if sgmcmc.sampling(k - 1, steps, cycles, beta)] == [
      21, 22, 23, 24, 25, 46, 47, 48, 49, 50]
  # 5 sampling updates, 2 samples: every 2 steps back from each cycle's end.
  assert sgmcmc.sample_steps(steps, cycles, beta, 2) == [23, 25, 48, 50, 73, 75, 98, 100]
  assert sgmcmc.sample_steps(steps, cycles, beta, 1) == [25, 50, 75, 100]
  # The optimizer's rate is the member's learning rate times that: a unit gradient moves
  # a weight by -lr * (cos(...) + 1) / 2 (no momentum, no decay).
  optim = specs.optim_spec(support.config({'optim.weight_decay': 0.0}))
  tx = sgmcmc.sampler(optim, steps, cycles, None)({'optim.learning_rate': 0.5,
                                                     'optim.weight_decay': 0.0})
  state = tx.init(jnp.zeros(()))
  for k in range(1, 30):
    update, state = tx.update(jnp.ones(()), state, jnp.zeros(()))
    r = ((k - 1) % 25) / 25
    assert float(update) == pytest.approx(-0.5 * (math.cos(math.pi * r) + 1) / 2, abs=1e-6)


N, XBAR = 50, 0.7


def _chains(kind, members, ids, steps=2000, lr=0.1, friction=0.1, cycles=1, beta=0.0,
            theta0=0.0, grad=True):
  """`members` chains of the method's own update on L = mean (theta - x_i)^2 / 2 (its
  gradient theta - XBAR; with grad=False none), by its members_update and optimizer."""
  method = sgmcmc.chains(kind, steps, cycles, beta, 1, 1.0, 1.0 if kind == 'sgld' else friction,
                         N, seed=0)
  optim = specs.optim_spec(support.config({'optim.weight_decay': 0.0}))
  optimizer = method.optimizer(optim, steps)

  def results(params, model_state, hp, member_id, step, batch):
    del hp, member_id, step, batch
    g = params - XBAR if grad else jnp.zeros_like(params)
    return BatchResult(jnp.zeros(()), {}, g, model_state)

  # vmapped: the update is the same per member under either form, and a map over 2,048
  # members is a loop of 2,048 tiny bodies per step (about 6x the time of the vmap).
  update = method.hooks.members_update(results, member_apply_fn(optimizer), optimizer, 'vmap',
                                       None)
  hp = {'optim.learning_rate': jnp.full((members,), lr), 'optim.weight_decay': jnp.zeros(members)}
  params = jnp.full((members,), theta0)
  opt_state = jax.vmap(lambda h, p: optimizer(h).init(p))(hp, params)
  state = Member(params, jnp.zeros((members,)), opt_state, jnp.zeros((members,), bool))
  ids = jnp.asarray(ids, jnp.uint32)

  def body(step, state):
    return update(state, hp, ids, step, jnp.zeros(()))[0]

  # Hundreds of steps of 2,048 chains' noise draws run long enough for LLVM's -O1 to pay
  # for itself against the tests' -O0 (support.FAST_COMPILE): 2,000 steps run in about
  # half the time at -O1 (the same statistics to float32 rounding); a short chain is
  # compiling, which -O0 does faster.
  options = {'xla_backend_optimization_level': 1} if steps >= 100 else None
  loop = jax.jit(lambda s: jax.lax.fori_loop(0, steps, body, s), compiler_options=options)
  return np.asarray(loop(state).params)


# A chain forgets its start in ~10 steps (SGLD at lr 0.1; SGHMC's momentum 1 - friction
# in ~3 at friction 0.3, ~10 at 0.1), so a 300-step cycle samples long before its step size
# decays: over seeds 0-2, var * N 0.97-1.03 (SGLD) and 0.93-1.00 (SGHMC at friction 0.3),
# the sampling error's spread. At friction 0.1 a 300-step cycle cools SGHMC's chains as
# they settle (var * N 0.86-0.90): that case, the method's default friction, keeps its
# 2000-step cycle (var * N 0.99).
@pytest.mark.parametrize('kind, steps, friction', [
    ('sgld', 300, 0.1), ('sghmc', 300, 0.3), ('sghmc', 2000, 0.1)])
def test_the_chains_end_at_the_gaussian_posteriors_mean_and_variance(kind, steps, friction):
  # 2048 independent chains (each member its noise), one cosine cycle sampling throughout:
  # their last states are draws of N(XBAR, 1 / N) (sd 0.141), within the sampling error
  # (the variance's relative sd sqrt(2 / 2048) = 3%) and the discretisation's.
  final = _chains(kind, 2048, range(2048), steps=steps, lr=0.1 if kind == 'sgld' else 0.02,
                  friction=friction)
  assert final.mean() == pytest.approx(XBAR, abs=0.015)
  assert final.var() * N == pytest.approx(1.0, rel=0.12)


def test_noise_is_each_members_own_and_member_ms_chain_does_not_depend_on_m():
  # No gradient, the same start: the chains differ by their noise alone.
  two = _chains('sgld', 2, [0, 1], steps=20, grad=False)
  four = _chains('sgld', 4, [0, 1, 2, 3], steps=20, grad=False)
  assert len(set(four.tolist())) == 4
  np.testing.assert_array_equal(two, four[:2])
  # Exploration only (beta close to 1, the one sampling update not yet run): no noise.
  quiet = _chains('sgld', 2, [0, 1], steps=20, beta=0.99, grad=False, cycles=1)
  np.testing.assert_array_equal(quiet[:], 0.0 * quiet)


STEPS = 8


def _config(**fields):
  config = support.config({
      'ensemble.method': 'sgmcmc', 'ensemble.sgmcmc.data_size': 1000, 'num_members': 2,
      'ensemble.sgmcmc.cycles': 2, 'ensemble.sgmcmc.beta': 0.5,
      'ensemble.sgmcmc.samples_per_cycle': 2, 'train.steps': STEPS,
      'optim.learning_rate': 0.05, 'mesh.member': 2, 'train.log_every': 4,
      'checkpoint.every': 4})
  return support.override(config, fields)


def _train(config, workdir, actions=()):
  return dist_ens.train(config, str(workdir), devices=jax.devices()[:2], actions=actions)


def test_resume_is_exact_and_load_predicts_with_k_times_m_members(tmp_path):
  """Resumed from what a kill after the step-4 checkpoint leaves (cycle 1's samples
  collected, cycle 2's not) the run ends as the straight one, bit for bit; Ensemble.load
  predicts with the 2 chains x 2 cycles x 2 samples, distinct, at the reported SG-MCMC
  accuracy; each chain's last sample (its rows' last) is its trained member."""
  straight = _train(_config(), tmp_path / 'a')
  resumed = _train(_config(), runs.killed_after(tmp_path / 'a', 4, tmp_path / 'b'))
  assert resumed['step'] == STEPS and resumed['ensemble'] == straight['ensemble']
  assert resumed['sgmcmc'] == straight['sgmcmc']
  ens = Ensemble.load(tmp_path / 'a', devices=jax.devices()[:1])
  support.assert_trees_equal(ens.params, Ensemble.load(tmp_path / 'b',
                                                       devices=jax.devices()[:1]).params)
  # 2 chains x 2 cycles x 2 samples, each chain's four samples distinct.
  kernels = np.asarray(jax.tree.leaves(ens.params)[1])
  assert kernels.shape[0] == 8 and len({k.tobytes() for k in kernels}) == 8
  test = data.load_dataset('mnist1d').test
  prediction = ens.predict(test.x, preprocessed=True)
  accuracy = float(np.mean(prediction.probs.argmax(-1) == test.y))
  assert straight['sgmcmc']['predicting_members'] == 8
  assert accuracy == pytest.approx(straight['sgmcmc']['ensemble']['accuracy'], abs=2e-3)
  # Each chain's last sample is its final params (step 8): the trained member's metrics;
  # member m's samples are rows 4m .. 4m + 3.
  for m in range(2):
    assert straight['sgmcmc']['members']['nll'][4 * m + 3] == pytest.approx(
        straight['members']['nll'][m], rel=1e-5)


# Slow; fast covers: each chain's noise is its member's own and member m's chain the same
# with 2 and 4 members, through the method's own update
# (test_noise_is_each_members_own_and_member_ms_chain_does_not_depend_on_m); a member's
# init and data do not depend on M (test_train's test_member_does_not_depend_on_ensemble_size,
# test_data's test_member_stream_does_not_depend_on_m_or_host); each chain's samples in its
# own rows (test_resume_is_exact_and_load_predicts_with_k_times_m_members).
@pytest.mark.slow
def test_member_ones_chain_is_the_same_in_a_2_and_a_4_member_run(tmp_path):
  fields = {'reproducible': True, 'mesh.member': 1}
  for name, m in (('two', 2), ('four', 4)):
    dist_ens.train(_config(**fields, num_members=m), str(tmp_path / name),
                   devices=jax.devices()[:1])
  p2 = Ensemble.load(tmp_path / 'two', devices=jax.devices()[:1]).params
  p4 = Ensemble.load(tmp_path / 'four', devices=jax.devices()[:1]).params
  # Member m's samples are rows 4m .. 4m + 3: members 0 and 1 alike in both runs.
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[:8]),
               p2, p4)


@pytest.mark.parametrize('fields, match', [
    ({'ensemble.sgmcmc.data_size': 0}, r'sgmcmc\.data_size=0 must be the training set'),
    ({'ensemble.sgmcmc.sampler': 'sgnht'}, r"sgmcmc\.sampler='sgnht'; use one of"),
    ({'ensemble.sgmcmc.cycles': 3}, r'sgmcmc\.cycles=3 must divide train\.steps=8'),
    ({'ensemble.sgmcmc.beta': 1.0}, r'sgmcmc\.beta=1\.0 must be in \[0, 1\)'),
    ({'ensemble.sgmcmc.friction': 0.0}, r'sgmcmc\.friction=0\.0 must be in \(0, 1\]'),
    ({'ensemble.sgmcmc.samples_per_cycle': 3},
     r'samples_per_cycle=3 exceeds the 2 sampling steps'),
    ({'ensemble.sgmcmc.temperature': -1.0}, r'sgmcmc\.temperature=-1\.0 must be'),
])
def test_bad_fields_are_refused_naming_the_field(fields, match):
  config = _config(**fields)
  message = support.one_line_refusal(lambda: methods.from_spec(specs.method_spec(config)))
  assert re.search(match, message), message


@pytest.mark.parametrize('field', ['grad_clip_norm', 'warmup_steps'])
def test_clipping_and_warm_up_are_refused_naming_the_field(field):
  config = _config(**{f'optim.{field}': 1})
  method = methods.from_spec(specs.method_spec(config))
  message = support.one_line_refusal(lambda: method.optimizer(specs.optim_spec(config), STEPS))
  assert f'config.optim.{field}=1' in message and f'optim.{field}=0' in message
