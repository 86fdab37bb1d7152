"""LeNet-5 (LeCun et al. 1998) on the (params, state) model contract.

conv 6@5x5 -> ReLU -> max-pool 2 -> conv 16@5x5 -> ReLU -> max-pool 2 ->
dense 120 -> ReLU -> dense 84 -> ReLU -> dense num_classes.

Choices, against the 1998 paper:
  * Both convolutions are 'VALID' and every spatial axis shorter than 32 is first
    zero-padded (centred) to 32, as LeCun et al. padded 28x28 MNIST to 32x32. On
    28x28 this equals a 'SAME' first convolution, and every input up to 32x32 keeps
    the classic geometry (5x5x16 = 400 features into the first dense layer), so
    small images (8x8 'digits') work too; larger inputs give a larger first dense
    layer. 1-D inputs [B, L, C] get the same layers with 1-D kernels.
  * ReLU and max pooling instead of scaled tanh and trainable average
    subsampling; C3 connects all 6 maps to all 16 (no connection table); the
    output is a dense layer, not RBF units. Parameters for 32x32x1 and 10
    classes: 156 + 2,416 + 48,120 + 10,164 + 850 = 61,706.
  * Optional dropout (config.model.dropout) after each hidden dense layer.

No BatchNorm, so state is {} and the layers keep their biases.
"""

import jax
import jax.numpy as jnp

from dist_ens.core.model import Model
from dist_ens.models import layers
from dist_ens.models.spec import ModelSpec

CLASSIC_SIZE = 32  # Spatial axes are padded up to this.
CONV_CHANNELS = (6, 16)
KERNEL = 5
HIDDEN = (120, 84)


def make_lenet5(spec: ModelSpec, num_classes: int) -> Model:
  """LeNet-5 for inputs [B, H, W, C] or [B, L, C].

  Reads spec.conv_impl and spec.dropout.

  Example:
    >>> spec = ModelSpec(name='lenet5', factory='', kwargs={}, widths=(), channels=(),
    ...                  kernel_sizes=(), strides=(), conv_impl='auto', dropout=0.0)
    >>> model = make_lenet5(spec, num_classes=10)
    >>> params, state = model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    >>> logits, _ = model.apply(params, state, jnp.zeros((4, 28, 28, 1)), train=False)
  """
  conv = layers.conv_for(spec.conv_impl)
  rate = layers.dropout_rate_for(spec.dropout)

  def features(convs, x):
    spatial = x.shape[1:-1]
    pads = [((CLASSIC_SIZE - n) // 2, CLASSIC_SIZE - n - (CLASSIC_SIZE - n) // 2)
            if n < CLASSIC_SIZE else (0, 0) for n in spatial]
    x = jnp.pad(x, [(0, 0), *pads, (0, 0)])
    for layer in convs:
      x = layers.max_pool(jax.nn.relu(conv(x, layer['w'], 1, padding='VALID') + layer['b']))
    return x.reshape(x.shape[0], -1)

  def init(rng, sample_x):
    rank = layers.spatial_rank(sample_x, 'lenet5')
    convs, in_ch = [], sample_x.shape[-1]
    for out_ch in CONV_CHANNELS:
      convs.append({'w': layers.conv_kernel(KERNEL, rank, in_ch, out_ch),
                    'b': jnp.zeros((out_ch,), jnp.float32)})
      in_ch = out_ch
    fan_in = jax.eval_shape(features, convs, sample_x).shape[-1]
    dense = []
    for fan_out in (*HIDDEN, num_classes):
      dense.append(layers.dense_params(fan_in, fan_out))
      fan_in = fan_out
    return layers.he_normal_init(rng, {'convs': convs, 'dense': dense}), {}

  def apply(params, state, x, *, train, rng=None):
    layers.check_dropout_rng(rate, train, rng)
    h = features(params['convs'], x)
    for i, layer in enumerate(params['dense'][:-1]):
      h = jax.nn.relu(layers.dense(layer, h))
      h = layers.dropout(None if rng is None else jax.random.fold_in(rng, i), h, rate,
                         train=train)
    return layers.dense(params['dense'][-1], h), state

  return Model(init, apply)

