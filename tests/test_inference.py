"""Ensemble.load / predict / member / export against what training computed."""

import json

import jax
import ml_collections
import numpy as np
import pytest

from dist_ens import data
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.eval.evaluate import evaluate_split, make_eval_step
from dist_ens import Ensemble, load_member

M = 4  # tiny_run's members: 4 of a (16,) MLP, trained 8 steps on 4 devices (4 x 1)


@pytest.fixture(scope='module')
def run(tiny_run):
  """The session's shared tiny run (tests/runs.py): (workdir, final metrics); read only."""
  return tiny_run


@pytest.fixture(scope='module')
def ensemble(run):
  return Ensemble.load(run[0])


@pytest.fixture(scope='module')
def test_split():
  return data.load_dataset('mnist1d').test


def test_predict_reproduces_the_final_test_metrics(run, ensemble, test_split):
  _, final = run
  # Loaded on all 8 devices, a layout training (mesh.data=1: 4 x 1) did not have.
  assert ensemble.step == 8 and ensemble.mesh.shape == {'member': 4, 'data': 2}
  assert ensemble.config.mesh.data == 1
  out = ensemble.predict(test_split.x)
  rows = np.arange(len(test_split.y))
  assert out.probs.shape == (1000, 10) and out.member_probs.shape == (M, 1000, 10)
  np.testing.assert_allclose(out.probs.sum(-1), 1.0, rtol=1e-5)
  ens = final['ensemble']
  np.testing.assert_allclose(-np.log(out.probs[rows, test_split.y]).mean(), ens['nll'], rtol=1e-5)
  assert np.mean(out.probs.argmax(-1) == test_split.y) == ens['accuracy']
  np.testing.assert_allclose(out.entropy.mean(), ens['entropy'], rtol=1e-5)
  np.testing.assert_allclose(out.mutual_information.mean(), ens['mutual_information'],
                             rtol=1e-4)
  member_nll = -np.log(out.member_probs[:, rows, test_split.y]).mean(-1)
  np.testing.assert_allclose(member_nll, final['members']['nll'], rtol=1e-5)
  # The ensemble is the mean of its members.
  np.testing.assert_allclose(out.probs, out.member_probs.mean(0), rtol=1e-5, atol=1e-7)


def test_13_examples_on_8_devices_and_on_1_match_the_eval_step(run, ensemble, test_split):
  x, y = test_split.x[:13], test_split.y[:13]
  eight = ensemble.predict(x)
  one_device = Ensemble.load(run[0], devices=jax.devices()[:1])
  assert one_device.mesh.size == 1
  one = one_device.predict(x)
  # Several padded chunks (8 + 5) on a member-and-data mesh (M=4 on 6 devices: 2 x 3).
  six = Ensemble.load(run[0], devices=jax.devices()[:6])
  assert six.mesh.shape == {'member': 2, 'data': 3}
  chunked = six.predict(x, batch_size=8)
  for other in (one, chunked):
    np.testing.assert_allclose(other.probs, eight.probs, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(other.member_probs, eight.member_probs, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(other.entropy, eight.entropy, rtol=1e-5)
    np.testing.assert_allclose(other.mutual_information, eight.mutual_information, atol=1e-6)

  # Training's eval step on the same params and examples (padded to 16 over 'data').
  mesh = ensemble.mesh
  step = make_eval_step(ensemble.model, mesh)
  stats = evaluate_split(step, (ensemble.params, ensemble.model_state), data.Split(x, y), 16, mesh,
                         jax.device_put(~ensemble.frozen, mesh_lib.member_sharding(mesh))).examples
  np.testing.assert_allclose(eight.probs.max(-1), stats.ensemble_confidence, rtol=1e-6)
  np.testing.assert_allclose(eight.member_probs.max(-1), stats.member_confidence, rtol=1e-6)
  np.testing.assert_allclose(eight.entropy, stats.entropy, rtol=1e-6)
  np.testing.assert_allclose(eight.mutual_information, stats.mutual_information, atol=1e-6)
  np.testing.assert_array_equal(eight.probs.argmax(-1) == y, stats.ensemble_correct.astype(bool))


def test_preprocess_accepts_raw_signals_and_names_the_shape(ensemble, test_split):
  x = test_split.x[:5]
  np.testing.assert_array_equal(ensemble.predict(x[..., 0]).probs, ensemble.predict(x).probs)
  with pytest.raises(ValueError, match=r'\[N, \*\(40, 1\)\]'):
    ensemble.predict(np.zeros((5, 8, 8, 1)))


def test_predict_applies_the_configs_preprocessing(ensemble, test_split):
  config = ml_collections.ConfigDict(ensemble.config.to_dict())
  config.data.mean, config.data.std = (0.25,), (3.0,)
  normalising = Ensemble(config, ensemble.model, ensemble.params, ensemble.frozen, ensemble.step,
                         ensemble.input_shape, ensemble.num_classes, ensemble.mesh)
  raw = test_split.x[:6]
  by_hand = normalising.predict((raw - 0.25) / 3.0, preprocessed=True).probs
  np.testing.assert_allclose(normalising.predict(raw).probs, by_hand, rtol=1e-6)
  assert not np.allclose(normalising.predict(raw, preprocessed=True).probs, by_hand, atol=1e-3)


def test_member_is_the_unstacked_params_and_applies_alone(ensemble, test_split):
  x = test_split.x[:7]
  member = ensemble.member(3)
  assert isinstance(member, list) and member[0]['w'].shape == (40, 16)
  np.testing.assert_array_equal(member[1]['b'], np.asarray(ensemble.params[1]['b'])[3])
  probs = jax.nn.softmax(ensemble.model.apply(member, {}, x, train=False)[0])
  np.testing.assert_allclose(probs, ensemble.predict(x).member_probs[3], rtol=1e-5, atol=1e-7)
  with pytest.raises(IndexError, match='0..3'):
    ensemble.member(4)


def test_frozen_members_are_left_out_of_the_mean(ensemble, test_split):
  frozen = np.zeros(M, bool)
  frozen[[1, 2]] = True
  partial = Ensemble(ensemble.config, ensemble.model, ensemble.params, frozen, ensemble.step,
                     ensemble.input_shape, ensemble.num_classes, ensemble.mesh)
  out = partial.predict(test_split.x[:9])
  np.testing.assert_allclose(out.probs, out.member_probs[~frozen].mean(0), rtol=1e-5, atol=1e-7)
  assert not np.allclose(out.probs, out.member_probs.mean(0), atol=1e-4)


def test_export_writes_one_numpy_file_per_member(ensemble, tmp_path):
  paths = ensemble.export(tmp_path / 'members')
  assert [p.name for p in paths] == [f'member_{i}.npz' for i in range(M)]
  meta = json.loads((tmp_path / 'members' / 'ensemble.json').read_text())
  assert meta['num_members'] == M and meta['input_shape'] == [40, 1]
  assert meta['model']['widths'] == [16] and meta['frozen_members'] == []
  for i in (0, 3):
    jax.tree.map(np.testing.assert_array_equal, load_member(paths[i]), ensemble.member(i))
  with np.load(paths[3]) as f:  # numpy alone is enough to read it.
    assert sorted(f.files) == ['0/b', '0/w', '1/b', '1/w']
    np.testing.assert_array_equal(f['1/w'], ensemble.member(3)[1]['w'])


def test_load_explains_a_missing_run(tmp_path):
  with pytest.raises(FileNotFoundError, match='not a dist_ens workdir'):
    Ensemble.load(tmp_path)
