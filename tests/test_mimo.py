"""MIMO (config.ensemble.method='mimo').

Its defining property: in training each head sees its own shuffling of the batch
and its logits come back aligned with the labels; in evaluation every slot holds
the same example and the network predicts as its heads' mean. Then: a MIMO ensemble
as a run builds it on a data-split mesh (H input slots and H heads per member) steps
and fits a batch; a 96-step run that learns and loads is in the slow tier. What every
method's run keeps, resume, one trace, predict as reported, the same on one device and
export per member, is the combination matrix's (tests/test_combinations.py, its mimo
case).
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dist_ens.config import specs
from dist_ens import Ensemble, data
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.run import assemble, initial_state, mesh_layout
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


def test_a_mimo_ensemble_has_h_slots_and_heads_and_fits_a_batch_split_over_data():
  """Its sharded init and train step, without a run: each member one network of 3 input
  slots (40 x 3 inputs) and 3 heads of 10 classes; 12 steps on one batch split over
  'data' (each shard shuffles its own rows per head) bring every member's loss, the sum of
  its heads', well down."""
  config = _config('mimo', member=1, data_axis=2)
  config.num_members, config.train.steps, config.optim.schedule = 2, 12, 'constant'
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:2]),
                               (40, 1), 10)
  state = initial_state.init_sharded(parts)
  kernels = [a for a in jax.tree.leaves(state.params) if a.ndim == 3]
  assert kernels[0].shape == (2, 40 * 3, 16) and kernels[-1].shape == (2, 16, 10 * 3)
  step = assemble.build_step(parts, per_member_batches=False, form=('vmap', None))
  sharding = mesh_lib.batch_sharding(parts.mesh)
  x, y = next(data.BatchIterator(data.load_dataset('mnist1d').train, 32, seed=0))
  x, y = data.to_global(x, sharding), data.to_global(y, sharding)
  losses = []
  for _ in range(12):
    state, metrics = step(state, parts.device_hparams(), x, y)
    losses.append(np.asarray(metrics.loss))
  assert losses[0].shape == (2,) and (losses[-1] < 0.75 * losses[0]).all(), losses


# Slow; fast covers: each head's shuffle aligned with the labels and evaluation as the
# heads' mean (the unit tests above); the slots, heads and a fitted batch on a data-split
# mesh (test_a_mimo_ensemble_has_h_slots_and_heads_and_fits_a_batch_split_over_data); a MIMO
# run's resume, load, predict as reported, on one device and export (test_combinations'
# mimo case).
@pytest.mark.slow
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
