"""Post-hoc evaluation: temperature scaling, greedy selection, MC dropout, and their actions."""

import importlib
import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import Mesh

from dist_ens import Ensemble, data, tasks
from dist_ens.config import groups as member_groups, specs
from dist_ens.config.loading import load_config
from dist_ens.core.model import Model
from dist_ens.errors import ConfigError
from dist_ens.ensembles.selection import greedy_select
from dist_ens.tasks import temperature
from dist_ens.eval import calibration, evaluate
from dist_ens.io import tables
from dist_ens.models import layers
from dist_ens.models.base import dense_init
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.evaluators import greedy, mc_dropout, posthoc
from dist_ens.evaluators import temperature as temperature_step
from dist_ens.training.trainer import train

ROOT = Path(__file__).resolve().parents[1]
# The module (dist_ens.tasks re-exports its task function under the same name).
classification_lib = importlib.import_module('dist_ens.tasks.classification')
C = 5


def _run_spec(config):
  return specs.run_spec(config, member_groups.describe(config))


def _logits(seed, n=400, members=None, sharpness=3.0, classes=C):
  """Random labels and logits that favour them: [n] labels, [(members,) n, classes] logits."""
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, classes, n)
  shape = (n, classes) if members is None else (members, n, classes)
  logits = sharpness * (rng.standard_normal(shape) + 1.2 * np.eye(classes)[labels])
  return labels, logits.astype(np.float32)


def _log_softmax(logits):
  """log_softmax over the last axis, in float64 (numpy: no program per shape), as float32."""
  z = logits.astype(np.float64)
  z = z - z.max(-1, keepdims=True)
  return (z - np.log(np.exp(z).sum(-1, keepdims=True))).astype(np.float32)


def _nll64(logits, labels, temperature):
  """NLL at each of the temperatures in float64."""
  t = np.asarray(temperature, np.float64)[..., None, None]
  z = logits.astype(np.float64) / t
  z = z - np.logaddexp.reduce(z, axis=-1, keepdims=True)
  return -z[..., np.arange(len(labels)), labels].mean(-1)


@pytest.mark.parametrize('sharpness', [0.3, 3.0])  # under- and over-confident
def test_fitted_temperature_minimises_nll(sharpness):
  labels, logits = _logits(0, sharpness=sharpness)
  t = float(calibration.fit_temperature(logits, labels))
  assert (t < 1) if sharpness < 1 else (t > 1)
  for eps in (1e-2, 1e-3):
    assert _nll64(logits, labels, t) <= min(_nll64(logits, labels, t * (1 + eps)),
                                            _nll64(logits, labels, t * (1 - eps))) + 1e-7
  # Brute force: a coarse grid over the whole range, then a fine one around its best.
  coarse = np.exp(np.linspace(np.log(calibration.T_MIN), np.log(calibration.T_MAX), 1001))
  best = coarse[np.argmin(_nll64(logits, labels, coarse))]
  fine = best * np.exp(np.linspace(-0.01, 0.01, 2001))
  nlls = _nll64(logits, labels, fine)
  np.testing.assert_allclose(t, fine[np.argmin(nlls)], rtol=1e-4)
  np.testing.assert_allclose(_nll64(logits, labels, t), nlls.min(), atol=1e-7)
  # Logits or their log-softmax: the same temperature; and the same again, bit for bit.
  log_probs = _log_softmax(logits)
  np.testing.assert_allclose(float(calibration.fit_temperature(log_probs, labels)), t, rtol=1e-5)
  assert float(calibration.fit_temperature(logits, labels)) == t


def test_member_and_ensemble_temperatures():
  # The shapes of test_posthoc_steps_in_a_training_run's validation (300) and test (1,000)
  # splits of MNIST-1D's 10 classes, whose temperature scaling then reuses these programs.
  labels, logits = _logits(1, n=300, members=4, classes=10)
  # jax's log_softmax (one program): the run normalises them again the same way, to the bit.
  log_probs = np.array(jax.nn.log_softmax(logits * np.array([0.2, 1, 2, 4])[:, None, None]))
  log_probs[2] = np.nan  # a frozen member
  included = np.array([True, True, False, True])
  test_y, test = _logits(2, n=1000, members=4, classes=10)
  test = _log_softmax(test)
  scorer = evaluate.Scorer.of(classification_lib.classification())
  out = temperature.temperature_scaling(scorer, log_probs, labels, test, test_y, included)
  temps = out['member_temperatures']
  for m in (0, 1, 3):
    assert temps[m] == pytest.approx(float(calibration.fit_temperature(log_probs[m], labels)),
                                     rel=1e-6)
  assert np.isnan(temps[2]) and temps[0] < temps[1] < temps[3]
  pooled = calibration.pooled_log_probs(log_probs, included)
  assert out['ensemble_temperature'] == float(calibration.fit_temperature(pooled, labels))
  val = out['validation_nll']
  assert val['ensemble_after'] <= val['ensemble_before']
  assert all(a <= b + 1e-6 for a, b in zip(np.array(val['members_after'])[included],
                                           np.array(val['members_before'])[included]))
  # Temperature never changes the argmax.
  assert out['after']['ensemble']['accuracy'] == out['before']['ensemble']['accuracy']
  json.dumps(out)


def test_member_temperatures_are_fitted_in_chunks_of_flat_memory():
  """fit_member_temperatures fits members a chunk at a time: its scratch memory does not
  grow with M (all at once it held [M, 64, N, C]: 8 GB of host memory at M=4,096 in
  benchmarks/scaling.py), and each member's temperature is still its own fit, also in a
  last, partial chunk."""
  labels, logits = _logits(3, members=19)
  log_probs = _log_softmax(logits * np.linspace(0.2, 4, 19, dtype=np.float32)[:, None, None])
  temps = np.asarray(calibration.fit_member_temperatures(log_probs, labels))
  for m in (0, 15, 16, 18):
    assert temps[m] == pytest.approx(float(calibration.fit_temperature(log_probs[m], labels)),
                                     rel=1e-6)

  def scratch(members):
    shape = jax.ShapeDtypeStruct((members, *log_probs.shape[1:]), jnp.float32)
    compiled = calibration.fit_member_temperatures.lower(shape, labels).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert scratch(1024) < 1.5 * scratch(64)


def _caruana_reference(log_probs, labels, size, candidates, replacement=True):
  """Caruana's greedy selection, written out: full probability vectors, a loop per candidate
  (without replacement: each member at most once, until none is left)."""
  probs = np.exp(log_probs.astype(np.float64))
  probs /= probs.sum(-1, keepdims=True)
  chosen, path = [], []
  for _ in range(size):
    best, best_nll = None, np.inf
    for m in range(len(probs)):
      if not candidates[m] or (not replacement and m in chosen):
        continue
      mean = np.mean([probs[i] for i in chosen + [m]], axis=0)
      nll = -np.mean(np.log(mean[np.arange(len(labels)), labels]))
      if nll < best_nll:
        best, best_nll = m, nll
    if best is None:
      break
    chosen.append(best)
    path.append(best_nll)
  keep = int(np.argmin(path)) + 1
  return chosen[:keep], path


@pytest.mark.parametrize('seed', [0, 1])
def test_greedy_selection_equals_caruana(seed):
  labels, logits = _logits(seed, n=300, members=7, sharpness=2.0)
  logits *= np.linspace(0.3, 3.0, 7)[:, None, None]  # members from under- to over-confident
  logits[5] = np.nan  # a frozen member is never picked
  candidates = np.arange(7) != 5
  log_likelihood = classification_lib.log_likelihood(logits, labels)
  got = greedy_select(log_likelihood, size=10, candidates=candidates)
  picks, path = _caruana_reference(logits, labels, 10, candidates)
  assert got.picks == picks and 5 not in got.picks
  np.testing.assert_allclose(got.nll_by_size, path, rtol=1e-10)
  assert got.counts.sum() == len(got.picks) and np.array_equal(
      got.counts, np.bincount(picks, minlength=7))
  single = [_nll64(logits[m], labels, 1.0) for m in range(7) if candidates[m]]
  assert got.nll <= min(single) and got.nll == pytest.approx(min(path), rel=1e-12)
  # With replacement: the greedy ensemble repeats a member here.
  assert len(set(got.picks)) < len(got.picks)


@pytest.mark.parametrize('size', [3, 10])
def test_greedy_selection_without_replacement_picks_distinct_members(size):
  labels, logits = _logits(0, n=300, members=7, sharpness=2.0)
  logits *= np.linspace(0.3, 3.0, 7)[:, None, None]
  candidates = np.arange(7) != 5
  log_likelihood = classification_lib.log_likelihood(logits, labels)
  got = greedy_select(log_likelihood, size=size, candidates=candidates, replacement=False)
  picks, path = _caruana_reference(logits, labels, size, candidates, replacement=False)
  assert got.picks == picks and len(set(got.picks)) == len(got.picks) and 5 not in got.picks
  np.testing.assert_allclose(got.nll_by_size, path, rtol=1e-10)
  assert len(got.nll_by_size) == min(size, 6)  # 10 picks stop when the 6 candidates are used
  assert set(np.unique(got.counts)) <= {0, 1} and got.counts.sum() == len(picks)
  # The first pick is the best member either way; with replacement this pool repeats one.
  assert got.picks[0] == greedy_select(log_likelihood, size=size, candidates=candidates).picks[0]


def test_the_config_builds_the_greedy_step_it_asks_for():
  """config.select.method='greedy' builds one GreedySelect of config.select.greedy_size picks,
  with or without replacement as config.select.greedy_replacement says, on the run's shared
  outputs (test_posthoc_steps_in_a_training_run runs a selection without replacement)."""
  from dist_ens.evaluators import evaluator as evaluator_lib  # pylint: disable=g-import-not-at-top
  outputs = posthoc.SplitOutputs()
  config = load_config(ROOT / 'configs' / 'default.py')
  for replacement in (True, False):
    config.data.validation_size = 64
    config.select.method, config.select.greedy_size = 'greedy', 4
    config.select.greedy_replacement = replacement
    session = types.SimpleNamespace(spec=_run_spec(config))
    run = evaluator_lib.EvalRun(types.SimpleNamespace(session=session), None, outputs)
    [step] = greedy.evaluator(run)
    assert isinstance(step, greedy.GreedySelect)
    assert (step.size, step.replacement, step.cache) == (4, replacement, outputs)
  config.select.method = 'top_k'
  session = types.SimpleNamespace(spec=_run_spec(config))
  assert not greedy.evaluator(evaluator_lib.EvalRun(types.SimpleNamespace(session=session),
                                                    None, outputs))


# --- MC dropout -----------------------------------------------------------------------


def dropout_model(num_classes, rate=0.5, width=16):
  """dense -> BatchNorm -> ReLU -> dropout -> dense, on the MC dropout contract:
  dropout draws whenever apply gets an rng; BatchNorm follows `train`."""

  def init(rng, sample_x):
    k1, k2, k3 = jax.random.split(rng, 3)
    d = int(np.prod(sample_x.shape[1:]))
    bn_params, _ = layers.batch_norm_init(width)
    # Non-trivial running statistics, so batch statistics would show.
    state = {'mean': 0.3 * jax.random.normal(k3, (width,)),
             'var': 1.0 + jax.random.uniform(k3, (width,))}
    return ({'hidden': dense_init(k1, d, width), 'bn': bn_params,
             'out': dense_init(k2, width, num_classes)}, {'bn': state})

  def apply(params, state, x, *, train, rng=None):
    h = layers.dense(params['hidden'], x.reshape(x.shape[0], -1))
    h, bn = layers.batch_norm(params['bn'], state['bn'], h, train=train)
    h = layers.dropout(rng, jax.nn.relu(h), rate, train=rng is not None)
    return layers.dense(params['out'], h), {'bn': bn}

  return Model(init, apply)


M, SHAPE = 8, (6,)


def _variables(model, mesh):
  # One jitted program, keys included, that puts each member's variables on its devices
  # (eager keys and a device_put were a program per operation and per leaf).
  def init():
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(3), i))(jnp.arange(M))
    return jax.vmap(lambda k: model.init(k, jnp.zeros((1, *SHAPE))))(keys)
  return jax.jit(init, out_shardings=mesh_lib.member_sharding(mesh))()


def _mesh(devices, member, data_axis):
  return Mesh(np.array(devices[:member * data_axis]).reshape(member, data_axis),
              mesh_lib.AXES)


def _split(n=23):
  rng = np.random.default_rng(4)
  return data.Split(rng.standard_normal((n, *SHAPE)).astype(np.float32),
                    rng.integers(0, C, n).astype(np.int32))


def test_mc_dropout_with_rate_zero_is_plain_evaluation():
  model, split = dropout_model(C, rate=0.0), _split()
  params, state = jax.jit(lambda x: model.init(jax.random.key(0), x))(split.x[:1])
  plain = jax.jit(lambda p, s, x: model.apply(p, s, x, train=False)[0])(params, state, split.x)
  samples = jax.jit(lambda p, s, x: evaluate.mc_sample_logits(
      model, p, s, x, evaluate.mc_key(0, 0), 0, 2))(params, state, split.x)
  # BatchNorm kept its running statistics (one example's own statistics would not match).
  for sample in samples:
    np.testing.assert_allclose(sample, plain, rtol=1e-5, atol=1e-5)


def test_mc_dropout_samples_differ_reproducibly_on_any_mesh(devices):
  model, split = dropout_model(C, rate=0.5), _split()
  mesh = _mesh(devices, 4, 2)
  step = evaluate.make_outputs_step(model, mesh, mc_samples=4, seed=7,
                                   combine=classification_lib.combine)
  # 23 examples over 2 data shards in padded batches of 8.
  variables = _variables(model, mesh)
  sharded = evaluate.split_outputs(step, variables, split, 8, mesh)
  params, state = jax.tree.map(lambda a: np.asarray(a)[2], variables)
  sample = jax.jit(lambda seed: evaluate.mc_sample_logits(
      model, params, state, split.x, evaluate.mc_key(seed, 2), 0, 4))
  samples = np.asarray(sample(7))  # member 2 alone, the whole split in one batch
  assert samples.shape == (4, len(split.y), C)
  assert all(not np.allclose(samples[i], samples[j]) for i in range(4) for j in range(i))
  # Member 2's MC prediction is the mean of exactly these samples, on any mesh and batch.
  log_probs = _log_softmax(samples).astype(np.float64)
  top = log_probs.max(0)
  mean = top + np.log(np.exp(log_probs - top).mean(0))
  np.testing.assert_allclose(sharded[2], mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(sample(7)), samples)
  assert not np.allclose(np.asarray(sample(8)), samples)


def test_posthoc_steps_in_a_training_run(tmp_path, devices):
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.writers = 4, ('jsonl',)
  config.train.steps, config.train.log_every, config.train.eval_every = 30, 30, 0
  config.data.batch_size, config.data.validation_size = 64, 300
  config.model.factory = 'test_posthoc:dropout_model'
  config.model.kwargs = ml_collections.ConfigDict(dict(rate=0.3))
  config.mesh.member, config.mesh.data = 2, 2
  config.eval.ood_dataset = 'mnist1d_noise'
  # MC dropout and temperature scaling as the config asks for them (their evaluators),
  # greedy selection as an action passed in, as docs/ensemble_methods.md shows.
  with config.unlocked():
    config.eval.mc_samples, config.eval.temperature_scaling = 2, True
  # Greedy selection of distinct members (the config's select.greedy_replacement=False
  # builds the same step: test_the_config_builds_the_greedy_step_it_asks_for).
  train(config, str(tmp_path), devices=devices[:4],
        actions=[greedy.GreedySelect(6, replacement=False)])
  final = json.loads((tmp_path / 'final_metrics.json').read_text())
  ts, picked, mc = final['temperature_scaling'], final['greedy'], final['mc_dropout']
  assert ts['validation_nll']['ensemble_after'] <= ts['validation_nll']['ensemble_before']
  assert ts['before']['ensemble']['nll'] == pytest.approx(final['ensemble']['nll'], rel=1e-4)
  assert picked['validation_nll'] <= min(final['validation']['members']['nll']) + 1e-6
  assert picked['validation_nll'] == min(picked['validation_nll_by_size'])
  assert sum(picked['counts']) == len(picked['picks']) <= 4  # distinct: at most M picks
  assert not picked['replacement'] and len(set(picked['picks'])) == len(picked['picks'])
  # Its test NLL is the mixture of the picked members' predictions (dropout off, as
  # evaluation runs them), each counted once.
  test = data.load_dataset('mnist1d').test
  probs = Ensemble.load(str(tmp_path)).predict(test.x).member_probs
  probs = probs[picked['picks']].astype(np.float64).mean(0)
  nll = -np.mean(np.log(probs[np.arange(len(test.y)), test.y]))
  assert picked['ensemble']['nll'] == pytest.approx(nll, rel=1e-4)
  assert mc['samples'] == 2 and mc['ensemble']['nll'] != pytest.approx(final['ensemble']['nll'])
  assert 0 <= mc['ood']['ensemble']['auroc_mi'] <= 1 and len(mc['ood']['members']['auroc_entropy']) == 4
  splits = {json.loads(line)['split'] for line in (tmp_path / 'metrics.jsonl').open()}
  assert {'test_mc_dropout', 'test_temperature_scaled', 'test_greedy'} <= splits


def test_posthoc_fits_need_a_validation_split():
  # Checked at the first step, not after training.
  call = types.SimpleNamespace(
      session=types.SimpleNamespace(run_data=types.SimpleNamespace(validation=None)))
  for action in (temperature_step.TemperatureScale(), greedy.GreedySelect(4)):
    with pytest.raises(ConfigError, match=r'config\.data\.validation_size=0'):
      action.on_step(call)
  mc_dropout.McDropout(2).on_step(call)  # MC dropout needs no validation split.
  config = load_config(ROOT / 'configs' / 'default.py')
  config.select.method = 'best'
  with pytest.raises(ConfigError, match='config.select.method'):
    posthoc.check(_run_spec(config), tasks.get_task('classification'))


def test_log_lines_of_thousands_of_members_stay_one_screen_line():
  """Temperature scaling and greedy selection log a line each: per-member lists printed
  4,096 numbers (28k characters) at M=4,096 (benchmarks/scaling.py); small runs keep
  the full list."""
  rng = np.random.default_rng(0)
  temperatures = rng.uniform(0.5, 20.0, 4096)
  picks = rng.integers(0, 4096, 4096).tolist()
  text, picked = tables.spread_text(temperatures), greedy._picks_text(picks)
  assert len(text) < 80 and len(picked) < 160
  assert text.startswith(f'min {temperatures.min():.3f}') and '4096 members' in text
  assert picked.startswith(f'4,096 of {len(set(picks)):,} distinct members: {picks[:8]}'[:-1])
  assert tables.spread_text([1.23456, 2.0]) == '[1.235, 2.0]'
  assert greedy._picks_text([3, 1, 3]) == '[3, 1, 3]'
