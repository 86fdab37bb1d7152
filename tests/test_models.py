"""Single-member models: shapes, registry, config errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dist_ens import models
from dist_ens.errors import ConfigError
from model_specs import model_spec


def _init(model, shape, key=0):
  """One member's params (the built-in models keep no model state)."""
  params, state = model.init(jax.random.key(key), jnp.zeros((1, *shape)))
  assert state == {}
  return params


def _apply(model, params, x):
  logits, state = model.apply(params, {}, x, train=False)
  assert state == {}
  return logits


def _cfg(**kw):
  return model_spec(**{**dict(name='mlp', widths=(16, 8), channels=(4, 6), kernel_sizes=(5, 3),
                              strides=(2, 2)), **kw})


@pytest.mark.parametrize('name,input_shape', [
    ('mlp', (40, 1)), ('mlp', (8, 8, 1)), ('cnn', (40, 1)), ('cnn', (8, 8, 1)), ('cnn', (28, 28, 3))])
def test_logits_shape(name, input_shape):
  model = models.get_model(_cfg(name=name), num_classes=7)
  params = _init(model, input_shape)
  logits = _apply(model, params, jnp.ones((5, *input_shape)))
  assert logits.shape == (5, 7)
  assert np.all(np.isfinite(logits))


def test_mlp_layer_sizes_follow_widths():
  params = _init(models.get_model(_cfg(widths=(16, 8)), 10), (40, 1))
  assert [p['w'].shape for p in params] == [(40, 16), (16, 8), (8, 10)]


def test_cnn_uses_2d_kernels_for_images():
  params = _init(models.get_model(_cfg(name='cnn'), 10), (8, 8, 1))
  assert params['convs'][0]['w'].shape == (5, 5, 1, 4)


def test_init_scale_scales_weight_matrices_not_biases():
  from dist_ens.core.state import scale_init  # pylint: disable=g-import-not-at-top
  params = _init(models.get_model(_cfg(), 10), (40, 1))
  params = jax.tree.map(lambda p: p + 1.0, params)  # Non-zero biases, to see them kept.
  halved = scale_init(params, 0.5)
  np.testing.assert_array_equal(halved[0]['w'], 0.5 * params[0]['w'])
  np.testing.assert_array_equal(halved[0]['b'], params[0]['b'])


def test_mlp_matches_hand_computation():
  model = models.get_model(_cfg(widths=(3,)), 2)
  params = _init(model, (4,), key=1)
  x = np.arange(8, dtype=np.float32).reshape(2, 4)
  h = np.maximum(x @ np.asarray(params[0]['w']) + np.asarray(params[0]['b']), 0)
  np.testing.assert_allclose(_apply(model, params, x), h @ params[1]['w'] + params[1]['b'],
                             rtol=1e-5)


def test_unknown_model_and_bad_fields():
  with pytest.raises(ConfigError, match=r"config.model.name='vgg'.*\['cnn', 'lenet5', 'mlp'"):
    models.get_model(_cfg(name='vgg'), 10)
  with pytest.raises(ConfigError, match='config.model.widths'):
    models.get_model(_cfg(widths=()), 10)
  with pytest.raises(ConfigError, match='kernel_sizes'):
    models.get_model(_cfg(name='cnn', kernel_sizes=(3,)), 10)
  with pytest.raises(ConfigError, match='input shape'):
    _init(models.get_model(_cfg(name='cnn'), 10), (40,))


# 1-D and 2-D, odd sizes, several channels, both strides (a 28 x 28 image adds compile
# time, not cases: the patches are cut the same way).
@pytest.mark.parametrize('input_shape,kernels,strides', [
    ((40, 1), (5, 3), (2, 2)), ((37, 3), (3, 5), (1, 2)), ((9, 10, 2), (5, 3), (1, 2))])
def test_conv_impls_compute_the_same_function(input_shape, kernels, strides):
  """'patches' == lax conv in logits and in every gradient, vmapped over members."""
  make = lambda impl: models.get_model(_cfg(name='cnn', kernel_sizes=kernels, strides=strides,
                                            conv_impl=impl), 10)
  xla, patches = make('xla'), make('patches')
  keys = jax.random.split(jax.random.key(1), 3)
  params = jax.jit(jax.vmap(lambda k: xla.init(k, jnp.zeros((1, *input_shape)))[0]))(keys)
  x = jax.random.normal(jax.random.key(2), (5, *input_shape))
  y = jnp.arange(5) % 10

  def loss_and_grads(model):
    def loss(p, x):
      return -jnp.mean(jax.nn.log_softmax(model.apply(p, {}, x, train=True)[0])[jnp.arange(5), y])
    # Jitted: op-by-op dispatch of the vmapped gradients took ~20 s per case.
    return jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)), in_axes=(0, None)))(
        params, x)

  for got, want in zip(jax.tree.leaves(loss_and_grads(patches)),
                       jax.tree.leaves(loss_and_grads(xla))):
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)


def test_conv_impl_is_checked_and_auto_resolves():
  with pytest.raises(ConfigError, match=r"config.model.conv_impl='fft'.*'patches'"):
    models.get_model(_cfg(name='cnn', conv_impl='fft'), 10)
  params = _init(models.get_model(_cfg(name='cnn', conv_impl='xla'), 10), (40, 1))
  x = jnp.ones((2, 40, 1))
  auto = _apply(models.get_model(_cfg(name='cnn', conv_impl='auto'), 10), params, x)
  want = _apply(models.get_model(_cfg(name='cnn', conv_impl='patches'), 10), params, x)
  np.testing.assert_array_equal(auto, want)  # 'auto' is 'patches': the same program.


@pytest.mark.parametrize('name', ['mlp', 'cnn'])
def test_dropout_samples_in_training_and_with_an_rng_in_evaluation_only(name):
  """The model contract: rng=None in evaluation is deterministic; an rng asks for MC dropout."""
  model = models.get_model(_cfg(name=name, dropout=0.5), 3)
  params = _init(model, (40, 1))
  x = jax.random.normal(jax.random.key(3), (4, 40, 1))
  plain = _apply(model, params, x)
  np.testing.assert_array_equal(_apply(models.get_model(_cfg(name=name), 3), params, x), plain)
  key = jax.random.key(1)
  sample = model.apply(params, {}, x, train=False, rng=key)[0]
  assert not np.allclose(sample, plain)
  np.testing.assert_array_equal(sample, model.apply(params, {}, x, train=False, rng=key)[0])
  np.testing.assert_array_equal(sample, model.apply(params, {}, x, train=True, rng=key)[0])
  with pytest.raises(ValueError, match='needs a PRNG key in training'):
    model.apply(params, {}, x, train=True)
