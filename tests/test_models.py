"""Single-member models: shapes, registry, config errors."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from dist_ens import models
from dist_ens.errors import ConfigError


def _cfg(**kw):
  base = dict(name='mlp', widths=(16, 8), channels=(4, 6), kernel_sizes=(5, 3),
              strides=(2, 2), init_scale=1.0)
  base.update(kw)
  return ml_collections.ConfigDict(base)


@pytest.mark.parametrize('name,input_shape', [
    ('mlp', (40, 1)), ('mlp', (8, 8, 1)), ('cnn', (40, 1)), ('cnn', (8, 8, 1)), ('cnn', (28, 28, 3))])
def test_logits_shape(name, input_shape):
  model = models.get_model(_cfg(name=name), num_classes=7)
  params = model.init(jax.random.key(0), input_shape)
  logits = model.apply(params, jnp.ones((5, *input_shape)))
  assert logits.shape == (5, 7)
  assert np.all(np.isfinite(logits))


def test_mlp_layer_sizes_follow_widths():
  params = models.get_model(_cfg(widths=(16, 8)), 10).init(jax.random.key(0), (40, 1))
  assert [p['w'].shape for p in params] == [(40, 16), (16, 8), (8, 10)]


def test_cnn_uses_2d_kernels_for_images():
  params = models.get_model(_cfg(name='cnn'), 10).init(jax.random.key(0), (8, 8, 1))
  assert params['convs'][0]['w'].shape == (5, 5, 1, 4)


def test_init_scale_scales_weights():
  p1 = models.get_model(_cfg(init_scale=1.0), 10).init(jax.random.key(0), (40, 1))
  p2 = models.get_model(_cfg(init_scale=0.5), 10).init(jax.random.key(0), (40, 1))
  np.testing.assert_allclose(p2[0]['w'], 0.5 * p1[0]['w'], rtol=1e-6)


def test_mlp_matches_hand_computation():
  model = models.get_model(_cfg(widths=(3,)), 2)
  params = model.init(jax.random.key(1), (4,))
  x = np.arange(8, dtype=np.float32).reshape(2, 4)
  h = np.maximum(x @ np.asarray(params[0]['w']) + np.asarray(params[0]['b']), 0)
  np.testing.assert_allclose(model.apply(params, x), h @ params[1]['w'] + params[1]['b'], rtol=1e-5)


def test_unknown_model_and_bad_fields():
  with pytest.raises(ConfigError, match=r"config.model.name='resnet'.*\['cnn', 'mlp'\]"):
    models.get_model(_cfg(name='resnet'), 10)
  with pytest.raises(ConfigError, match='config.model.widths'):
    models.get_model(_cfg(widths=()), 10)
  with pytest.raises(ConfigError, match='kernel_sizes'):
    models.get_model(_cfg(name='cnn', kernel_sizes=(3,)), 10)
  with pytest.raises(ConfigError, match='input shape'):
    models.get_model(_cfg(name='cnn'), 10).init(jax.random.key(0), (40,))


def test_per_member_init_scale_must_be_passed_to_init():
  model = models.get_model(_cfg(init_scale=[1.0, 2.0]), 10)
  with pytest.raises(ConfigError, match='init_scale holds per-member values'):
    model.init(jax.random.key(0), (40, 1))
  unit = models.get_model(_cfg(), 10).init(jax.random.key(0), (40, 1))
  doubled = model.init(jax.random.key(0), (40, 1), init_scale=2.0)
  np.testing.assert_allclose(doubled[0]['w'], 2.0 * unit[0]['w'], rtol=1e-6)
