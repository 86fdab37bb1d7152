"""MIMO (config.ensemble.method='mimo').

Its defining property: in training each head sees its own shuffling of the batch
and its logits come back aligned with the labels; in evaluation every slot holds
the same example and the network predicts as its heads' mean. Then: a MIMO
ensemble learns on a member x data mesh and Ensemble.load predicts with it.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dist_ens.config import specs
from dist_ens import Ensemble, data
from dist_ens.core.model import Model
from dist_ens.ensembles import methods, mimo
from dist_ens.errors import ConfigError
from test_methods import _config, _run

# How classification combines members, and so a MIMO network's heads.
classification_combine = importlib.import_module('dist_ens.tasks.classification').combine

HEADS, CLASSES, B = 3, 4, 64


def _probe(read_slot):
  """A model whose head h's logits are (slot read_slot(h)'s input, 0, 0, 0)."""

  def apply(params, state, x, *, train, rng=None):
    del params, train, rng
    logits = jnp.zeros((x.shape[0], HEADS, CLASSES))
    for h in range(HEADS):
      logits = logits.at[:, h, 0].set(x[:, read_slot(h)])
    return logits.reshape(x.shape[0], -1), state

  return mimo.wrap(Model(lambda rng, x: ({}, {}), apply), HEADS, classification_combine)


def test_each_head_sees_its_own_shuffle_aligned_with_the_labels():
  x = jnp.arange(B, dtype=jnp.float32)[:, None]  # Example i's input is i.
  own = _probe(lambda h: h)
  logits, _ = own.apply({}, {}, x, train=True, rng=jax.random.key(3))
  assert logits.shape == (B, HEADS, CLASSES)
  # Head h's row i is its prediction for example i, whichever row of its slot held it.
  np.testing.assert_array_equal(logits[:, :, 0], np.tile(np.arange(B)[:, None], (1, HEADS)))
  # What sat in slot 0 when head 1's slot held example i: another example (an independent
  # pairing) for nearly every i, and a different pairing for every step key.
  other = _probe(lambda h: 0 if h == 1 else h)
  pairs = lambda key: np.asarray(other.apply({}, {}, x, train=True, rng=key)[0][:, 1, 0])
  assert np.mean(pairs(jax.random.key(3)) != np.arange(B)) > 0.9
  assert not np.array_equal(pairs(jax.random.key(3)), pairs(jax.random.key(4)))


def test_evaluation_predicts_the_heads_mean_probability():
  head_logits = jax.random.normal(jax.random.key(0), (B, HEADS, CLASSES))

  def apply(params, state, x, *, train, rng=None):
    np.testing.assert_array_equal(x, jnp.tile(x[:, :1], (1, HEADS)))  # Every slot the same.
    return head_logits.reshape(B, -1), state

  net = mimo.wrap(Model(lambda rng, x: ({}, {}), apply), HEADS, classification_combine)
  out, _ = net.apply({}, {}, jnp.ones((B, 1)), train=False)
  expected = np.log(np.mean(np.asarray(jax.nn.softmax(head_logits)), axis=1))
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_a_mimo_ensemble_learns_and_ensemble_load_predicts(tmp_path):
  config = _config('mimo', member=1, data_axis=2)  # Each batch split over 'data'.
  config.num_members, config.train.steps = 2, 96  # Three heads learn slower than one.
  result = _run(config, tmp_path)
  ens = Ensemble.load(tmp_path, devices=jax.devices()[:1])
  assert ens.num_members == 2
  test = data.load_dataset('mnist1d').test
  probs = ens.predict(test.x, preprocessed=True).probs
  accuracy = float(np.mean(probs.argmax(-1) == test.y))
  assert accuracy == pytest.approx(result['ensemble']['accuracy'], abs=2e-3)
  assert accuracy > 0.2  # Ten balanced classes: it learned.
  # One network per member: 3 input slots (40 x 3 inputs) and 3 heads of 10 classes.
  kernels = [a for a in jax.tree.leaves(ens.params) if a.ndim == 3]
  assert kernels[0].shape[1] == 40 * 3 and kernels[-1].shape[2] == 10 * 3


@pytest.mark.parametrize('field, value, match', [
    ('mimo.heads', 1, r'mimo.heads=1 must be an int >= 2'),
    ('reproducible', True, "reproducible=True with config.ensemble.method='mimo'"),
])
def test_bad_fields_are_refused(field, value, match):
  config = _config('mimo')
  if field == 'reproducible':
    config.reproducible = value
  else:
    config.ensemble.mimo.heads = value
  with pytest.raises(ConfigError, match=match):
    methods.from_spec(specs.method_spec(config))
