"""Evaluation under shift and for decisions, wired into a run: one compiled program for
every corruption x severity, the same corrupted examples on any mesh and M, the config's
errors, and a short digits run writing 'shift', 'aurc', 'selective' and 'conformal'."""

import csv
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dist_ens import data
from dist_ens.run import assemble, initial_state
from dist_ens.config.loading import load_config
from dist_ens.config.checks import validate
from dist_ens.data import corruptions
from dist_ens.errors import ConfigError
from dist_ens import Ensemble
from dist_ens.eval import metrics, shift, shift_spec
from dist_ens.training.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def _images(n, seed):
  rng = np.random.default_rng(seed)
  return rng.random((n, 8, 8, 1), dtype=np.float32), rng.integers(0, 10, n).astype(np.int32)


def _run(num_members, devices, member=-1, data_axis=1):
  """A run of small MLP members on random 8x8 images, and its initial state."""
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.data.batch_size = num_members, 16
  config.model.widths = (16,)
  config.mesh.member, config.mesh.data = member, data_axis
  config.eval.shift = 'gaussian_noise:2,contrast:1-5,elastic_transform:4'
  run = assemble.build_run(config, devices=devices,
                           dataset=data.from_arrays(*_images(64, 0), *_images(37, 1)))
  return run, initial_state.init_sharded(run.parts)


def _evaluator(run, eval_batch=metrics.eval_batch, batch_size=16):
  parts, test = run.parts, run.data.dataset.test
  frame = shift.InputFrame.fit(test.x)
  step = shift.make_predict_step(parts.model, parts.mesh, eval_batch, seed=3, frame=frame)
  return shift.PredictionEvaluator(step, parts.mesh, batch_size, run.evaluator().view)


def test_one_compiled_program_serves_every_corruption_severity_and_split(devices):
  run, state = _run(4, devices[:4], member=2, data_axis=2)
  traces = []

  def counted(*args):
    traces.append(1)  # runs once per trace, never per call
    return metrics.eval_batch(*args)

  evaluator = _evaluator(run, counted)
  test = run.data.dataset.test
  other = data.Split(*_images(20, 5))  # another split, another length
  pairs = shift_spec.resolve_shift('all', test.x.shape[1:])
  assert len(pairs) == 12 * 5  # every family but saturate (grey images), 5 severities
  clean = evaluator.predict(state, test)
  for name, severity in pairs:
    out = evaluator.predict(state, test, corruptions.corruption_id(name), severity)
    assert out.outputs.shape == clean.outputs.shape
  evaluator.predict(state, other)
  assert len(traces) == 1
  # Severity 0 is the clean split: the same outputs as the run's own evaluator.
  plain = run.evaluator().evaluate(state, test)
  assert clean.metrics['ensemble']['nll'] == pytest.approx(plain['ensemble']['nll'], rel=1e-5)


def test_corrupted_examples_and_metrics_are_the_same_on_any_mesh_and_m(devices):
  small, small_state = _run(2, devices[:1])
  large, large_state = _run(8, devices, member=4, data_axis=2)
  test = small.data.dataset.test
  for name, severity in [('gaussian_noise', 2), ('contrast', 5), ('elastic_transform', 4)]:
    ids = corruptions.corruption_id(name), severity
    a = _evaluator(small).predict(small_state, test, *ids)
    b = _evaluator(large).predict(large_state, test, *ids)
    # Members 0 and 1 are the same networks (init depends on (seed, member) only) and see
    # the same corrupted inputs; only the matmuls' rounding may differ by mesh.
    np.testing.assert_allclose(b.outputs[:2], a.outputs, rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(b.metrics['members']['nll'][:2], a.metrics['members']['nll'],
                               rtol=1e-5)
    clean = _evaluator(small).predict(small_state, test)
    assert not np.allclose(clean.outputs, a.outputs), name  # the corruption did something
  # The corrupted inputs themselves, bitwise: one device against a (member, data) mesh.
  frame = shift.InputFrame.fit(test.x, scale=2.0, offset=-0.5)  # standardised inputs
  x = (test.x[:32] + 0.5) / 2.0
  index = np.arange(100, 132, dtype=np.int32)
  corrupt = jax.jit(lambda x, i, c, s: frame.corrupt(x, i, c, s, 3))
  mesh = Mesh(np.array(devices).reshape(2, 4), ('member', 'data'))
  rows = NamedSharding(mesh, P('data'))
  for name in ('gaussian_noise', 'zoom_blur', 'pixelate'):
    ids = jnp.int32(corruptions.corruption_id(name)), jnp.int32(3)
    one = np.asarray(corrupt(x, index, *ids))
    eight = np.asarray(corrupt(jax.device_put(x, rows), jax.device_put(index, rows), *ids))
    np.testing.assert_array_equal(eight, one, err_msg=name)
    assert not np.array_equal(one, x)
    np.testing.assert_array_equal(np.asarray(corrupt(x, index, ids[0], jnp.int32(0))), x)


def test_input_frame_undoes_standardisation_and_picks_the_value_range():
  images = np.random.default_rng(0).random((10, 4, 4, 3), dtype=np.float32)
  mean, std = np.array([0.4, 0.5, 0.6], np.float32), np.array([0.2, 0.3, 0.25], np.float32)
  frame = shift.InputFrame.fit((images - mean) / std, scale=std, offset=mean)
  assert frame.value_range == (0.0, 1.0)
  signals = np.linspace(-3, 5, 40, dtype=np.float32).reshape(1, 40, 1)
  assert shift.InputFrame.fit(signals).value_range == (-3.0, 5.0)
  # Contrast at severity 5 in raw units, brought back: the same as corrupting the raw images.
  # Jitted with the corruption and severity as constants, XLA folds the switch to contrast's
  # branch; eager, each call compiled the switch of every family (this test alone, with
  # pytest's start: 22 -> 6 CPU s).
  index, ids = jnp.arange(10), (corruptions.corruption_id('contrast'), 5)
  got = jax.jit(lambda x: frame.corrupt(x, index, *ids, 0))((images - mean) / std)
  want = jax.jit(lambda x: corruptions.corrupt_batch(x, index, *ids, 0))(images)
  np.testing.assert_allclose(np.asarray(got) * std + mean, want, atol=1e-5)


def test_config_errors_name_the_field_and_what_works(devices):
  config = load_config(ROOT / 'configs' / 'default.py')
  for spec, message in [('fog', r"eval\.shift='fog'.*valid names: gaussian_noise"),
                        ('contrast:6', r'eval\.shift.*contrast:1-5'),
                        ('contrast:4-2', r'eval\.shift.*severity'),
                        ('contrast:0', r'eval\.shift.*severity 0.*1\.\.5')]:
    config.eval.shift = spec
    with pytest.raises(ConfigError, match=message):
      validate(config)
  with pytest.raises(ConfigError, match=r'eval\.shift=3 must be a string'):
    shift_spec.resolve_shift(3)
  config.eval.shift = 'gaussian_noise:1-2, contrast'
  validate(config)
  assert shift_spec.resolve_shift(config.eval.shift) == (
      [('gaussian_noise', 1), ('gaussian_noise', 2)] + [('contrast', s) for s in range(1, 6)])
  config.eval.conformal_alpha = 1.5
  with pytest.raises(ConfigError, match=r'eval\.conformal_alpha=1\.5.*\(0, 1\)'):
    validate(config)
  config.eval.conformal_alpha = 0.1
  # What applies depends on the inputs: found in build_run, before anything is compiled.
  config.data.name, config.eval.shift = 'digits', 'saturate'
  with pytest.raises(ConfigError, match=r'eval\.shift.*saturate needs 3 channels'):
    assemble.build_run(config, devices=devices[:1])
  with pytest.raises(ConfigError, match=r'eval\.shift.*tabular'):
    shift_spec.resolve_shift('gaussian_noise', example_shape=(8,))


def test_a_digits_run_with_shift_writes_every_section(tmp_path, devices):
  config = load_config(ROOT / 'configs' / 'digits_resnet20.py')
  config.model.name, config.model.widths = 'mlp', (32,)
  config.optim.name, config.optim.learning_rate = 'adam', 1e-2
  config.train.steps, config.train.log_every, config.checkpoint.every = 20, 10, 20
  config.writers = ('jsonl',)
  config.data.validation_size = 300
  config.eval.shift = 'gaussian_noise:1-5,pixelate:3'
  config.mesh.member, config.mesh.data = 2, 2
  train(config, str(tmp_path), devices=devices[:4])
  final = json.loads((tmp_path / 'final_metrics.json').read_text())
  s = final['shift']
  assert s['pairs'] == 6 and set(s['corruptions']) == {'gaussian_noise', 'pixelate'}
  assert set(s['corruptions']['gaussian_noise']) == {'1', '2', '3', '4', '5'}
  per_pair = [r for sev in s['corruptions'].values() for r in sev.values()]
  assert s['cA'] == pytest.approx(np.mean([r['ensemble']['accuracy'] for r in per_pair]))
  assert s['cNLL'] == pytest.approx(np.mean([r['ensemble']['nll'] for r in per_pair]))
  assert s['cCE'] == pytest.approx(np.mean([r['ensemble']['ece'] for r in per_pair]))
  members = np.mean([r['members']['accuracy'] for r in per_pair], axis=0)
  np.testing.assert_allclose(s['mean']['members']['accuracy'], members)
  noise = s['corruptions']['gaussian_noise']
  assert noise['5']['ensemble']['nll'] > final['ensemble']['nll']  # damage shows
  assert set(final['aurc']) == {'confidence', 'entropy', 'mutual_information'}
  assert set(final['selective']['accuracy_at_coverage']['confidence']) == {'90', '95', '99'}
  assert 'aurc' in noise['3']['selective'] and 'coverage' in noise['3']['conformal']
  conformal = final['conformal']
  assert conformal['method'] == 'aps' and conformal['alpha'] == 0.1
  assert conformal['calibration_size'] == 300 and 0 < conformal['coverage'] <= 1
  assert 0 < conformal['mean_set_size'] <= 10
  for row in csv.DictReader((tmp_path / 'members.csv').open()):
    member = int(row['member'])
    assert float(row['shift_accuracy']) == pytest.approx(members[member])
  # Ensemble.predict_sets: the sets calibrated in the run, on the test split again (other
  # draws of APS's randomisation, so the coverage agrees up to sampling).
  ensemble = Ensemble.load(tmp_path, devices=devices[:4])
  test = data.load_dataset('digits').test
  sets = ensemble.predict_sets(test.x, preprocessed=True, seed=5)
  assert sets.shape == (len(test.y), 10) and sets.dtype == bool
  coverage = sets[np.arange(len(test.y)), test.y].mean()
  assert abs(coverage - conformal['coverage']) < 0.06
  assert abs(sets.sum(1).mean() - conformal['mean_set_size']) < 0.5
  ensemble.conformal = None
  with pytest.raises(ValueError, match='validation_size > 0'):
    ensemble.predict_sets(test.x, preprocessed=True)
  events = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').open()]
  assert any(e['split'] == 'test_shift' for e in events)


def test_report_draws_metrics_against_severity(tmp_path):
  pytest.importorskip('matplotlib')
  from dist_ens.report import plots as report_plots  # pylint: disable=g-import-not-at-top
  result = lambda acc: {'members': {'accuracy': [acc - 0.1, acc - 0.2, 9.0],
                                    'nll': [1.0, 2.0, 3.0], 'ece': [0.1, 0.2, 0.3]},
                        'ensemble': {'accuracy': acc, 'nll': 1 - acc, 'ece': 0.1}}
  final = {**result(0.9), 'frozen_members': [2], 'shift': {'corruptions': {
      'contrast': {'1': result(0.8), '3': result(0.6)},
      'gaussian_noise': {'1': result(0.6), '5': result(0.2)}}}}
  curves, families = report_plots.shift_by_severity(final, 'accuracy')
  # Severity 0 is clean; k the mean over the families run at k; frozen member 2 left out.
  np.testing.assert_allclose(curves[1], [0.9, 0.7, np.nan, 0.6, np.nan, 0.2])
  np.testing.assert_allclose(curves[0], [0.75, 0.55, np.nan, 0.45, np.nan, 0.05])
  np.testing.assert_allclose(families['contrast'], [0.9, 0.8, np.nan, 0.6, np.nan, np.nan])
  report_plots.plot_shift(tmp_path, final)
  assert (tmp_path / 'shift.png').stat().st_size > 0 and (tmp_path / 'shift.svg').exists()


# A regression run's conformal intervals in target units: test_regression_run's
# test_a_regression_run_reports_conformal_intervals_in_target_units (its curve runs, on
# y and on 1000 y + 5, calibrate on a validation split; no run of their own).
