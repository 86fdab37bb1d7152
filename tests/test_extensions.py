"""Extension points: your own data, optimizer and loss, by import path or from Python."""

import json

import jax
import numpy as np
import optax
import pytest

import ext_fixtures
import support

import dist_ens
from dist_ens import data
from dist_ens.errors import ConfigError


def _config(**overrides):
  """support.config's run (4 members of a (16,) MLP, batch 32) on ext_fixtures' blobs:
  40 steps at learning rate 1e-2 (enough to separate the blobs: accuracy > 0.8), logged
  every 20 (the margin task's two train events), saved at the end."""
  return support.config({'data.name': 'ext_fixtures:blobs', 'train.steps': 40,
                         'train.log_every': 20, 'checkpoint.every': 40,
                         'optim.learning_rate': 1e-2}, **overrides)


@pytest.fixture(scope='module')
def plain(tmp_path_factory):
  """(workdir, final results) of _config() with ext_fixtures' evaluator added: the run four
  tests read. The evaluator runs after the built-in ones and only adds its own share and
  event, so the run is _config()'s otherwise (the test of the task checks it adds no
  'error')."""
  workdir = tmp_path_factory.mktemp('plain')
  return workdir, dist_ens.train(_config(eval__evaluators=('ext_fixtures:confident_share',)),
                                 str(workdir))


@pytest.fixture(scope='module')
def sgd_by_path(tmp_path_factory):
  """Final results of _config() with ext_fixtures' plain SGD by import path at learning
  rate 0.1 (it reads its rate from the member's values: traced)."""
  return dist_ens.train(_config(optim__name='ext_fixtures:plain_sgd', optim__learning_rate=0.1),
                        str(tmp_path_factory.mktemp('sgd_by_path')))


@pytest.fixture(scope='module')
def from_python(tmp_path_factory):
  """Final results of a run given both its data set and its optimizer as Python objects:
  _config()'s blobs through data.from_arrays and optax.sgd(0.1), sgd_by_path's run with
  neither by import path."""
  arrays = data.from_arrays(*ext_fixtures.blobs())
  return dist_ens.train(_config(data__name='blobs'), str(tmp_path_factory.mktemp('python')),
                        dataset=arrays, optimizer=optax.sgd(0.1))


def test_data_by_import_path_trains_and_loads(plain):
  workdir, final = plain
  assert final['ensemble']['accuracy'] > 0.8  # Two well separated blobs.
  ensemble = dist_ens.Ensemble.load(workdir, devices=jax.devices()[:1])
  assert ensemble.input_shape == (6,) and ensemble.num_classes == 2


def test_dataset_from_python_and_labels_checked(tmp_path, from_python):
  assert from_python['ensemble']['accuracy'] > 0.8
  with pytest.raises(ConfigError, match=r'labels lie outside \[0, 2\)'):
    dist_ens.train(_config(data__name='ext_fixtures:bad_labels'), str(tmp_path / 'b'))
  assert not (tmp_path / 'b').exists()
  with pytest.raises(ConfigError, match=r"config.data.name='ext_fixtures:nothing'"):
    dist_ens.train(_config(data__name='ext_fixtures:nothing'), str(tmp_path / 'c'))


def test_optimizer_by_import_path_equals_the_python_one(plain, sgd_by_path, from_python):
  # The same optimizer on the same blobs (here also the same data set given from Python);
  # the learning rate arrives traced in one, as a constant in the other.
  np.testing.assert_allclose(sgd_by_path['members']['nll'], from_python['members']['nll'],
                             rtol=1e-5)
  _, adam = plain  # _config()'s own optimizer, Adam.
  assert not np.allclose(adam['members']['nll'], sgd_by_path['members']['nll'], rtol=1e-3)


def test_loss_doubling_equals_learning_rate_doubling_for_plain_sgd(tmp_path, sgd_by_path):
  # Plain SGD (ext_fixtures' by import path) at half sgd_by_path's rate on twice the loss.
  doubled = dist_ens.train(_config(train__loss='ext_fixtures:doubled_cross_entropy',
                                   optim__name='ext_fixtures:plain_sgd',
                                   optim__learning_rate=0.05), str(tmp_path / 'a'))
  assert doubled['members'] == sgd_by_path['members']  # x2 is exact in floating point.
  with pytest.raises(ConfigError, match="config.train.loss='hinge'"):
    dist_ens.train(_config(train__loss='hinge'), str(tmp_path / 'c'))


def test_a_task_by_import_path_sets_outputs_metrics_and_results(tmp_path, plain):
  _, plain = plain
  got = dist_ens.train(_config(task='ext_fixtures:margin_task'), str(tmp_path / 'task'))
  # Its finalize ran: the error rate it adds is one minus the accuracy.
  assert got['ensemble']['error'] == 1.0 - got['ensemble']['accuracy']
  assert 'error' not in plain['ensemble']
  events = [json.loads(line) for line in (tmp_path / 'task' / 'metrics.jsonl').open()]
  train = [e for e in events if e['split'] == 'train']
  margins = np.asarray([e['members']['margin'] for e in train])
  assert margins.shape == (2, 4) and (margins > 0).all()  # top-1 minus top-2 logit
  # The model has the task's 3 output units for 2 classes.
  ensemble = dist_ens.Ensemble.load(str(tmp_path / 'task'))
  assert ensemble.predict(np.zeros((5, 6), np.float32)).probs.shape == (5, 3)
  with pytest.raises(ConfigError, match=r"config.select.metric='accuracy'.*\['nll'\]"):
    dist_ens.train(_config(task='ext_fixtures:margin_task', select__metric='accuracy'),
                   str(tmp_path / 'c'))
  with pytest.raises(ConfigError, match=r"config.task='ranking'.*classification"):
    dist_ens.train(_config(task='ranking'), str(tmp_path / 'd'))


def test_an_evaluator_by_import_path_runs_after_the_built_in_ones(tmp_path, plain):
  workdir, got = plain
  # Its share is the loaded ensemble's, computed here from its predictions.
  x, _ = ext_fixtures.blobs()[2:]
  probs = dist_ens.Ensemble.load(str(workdir)).predict(x).probs
  assert got['confident'] == pytest.approx(np.mean(probs.max(axis=-1) >= 0.9), abs=1e-9)
  assert 0 < got['confident'] <= 1
  events = [json.loads(line) for line in (workdir / 'metrics.jsonl').open()]
  assert [e['ensemble']['share'] for e in events if e['split'] == 'test_confident'] == [
      got['confident']]
  for path, match in (('ext_fixtures:no_such', "config.eval.evaluators.*no_such"),
                      ('ext_fixtures:np', "config.eval.evaluators names 'ext_fixtures:np', a "
                                          "module: name a function")):
    with pytest.raises(ConfigError, match=match):
      dist_ens.train(_config(eval__evaluators=(path,)), str(tmp_path / 'bad'))
    assert not (tmp_path / 'bad').exists()  # Refused before anything is written.


@pytest.mark.parametrize('factory,shape', [('ext_fixtures:thirteen_logits', r'\(2, 13\)'),
                                           ('ext_fixtures:one_row_model', r'\(1, 2\)')])
def test_a_model_whose_outputs_do_not_fit_the_task_is_refused_before_anything_runs(
    tmp_path, factory, shape):
  workdir = tmp_path / 'w'
  with pytest.raises(ConfigError, match=rf"config.model.factory='{factory}' \(for config.task="
                                        rf"'classification'\) gives outputs of shape {shape} "
                                        r'.* needs \(2, 2\)'):
    dist_ens.train(_config(model__factory=factory), str(workdir))
  assert not workdir.exists()  # Nothing written.
