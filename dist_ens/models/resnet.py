"""Residual networks for 1-D signals [B, L, C] and 2-D images [B, H, W, C].

  make_resnet        CIFAR ResNet (He et al. 2016, section 4.2): depth 6n+2 (20,
                     32, 56, ...), a 3x3 stem of 16 channels, 3 stages of n basic
                     blocks with 16/32/64 channels, the first block of stages 2-3
                     striding by 2. ResNet-20: 0.27M parameters.
  make_resnet18      the CIFAR ResNet-18 (as in kuangliu/pytorch-cifar): a 3x3 stem
                     of 64 channels and no max-pool, 4 stages of 2 basic blocks with
                     64/128/256/512 channels. 11.17M parameters.
  make_wide_resnet   WRN-d-k (Zagoruyko & Komodakis 2016): pre-activation blocks,
                     depth 6n+4, widths 16k/32k/64k, optional dropout between the two
                     convs of a block. WRN-28-10: 36.5M parameters.

Where a block changes the shape, its shortcut is a 1x1 conv (+ BatchNorm in the
post-activation nets; WRN's projection takes the already normalised input, as
in the authors' code) instead of the paper's zero-padding option A for CIFAR, so
ResNet-20 has 272,474 parameters rather than option A's 269,722 (both "0.27M").
The spatial rank follows the input, so the same code gives 1-D ResNets (kernels
3 and 1) for MNIST-1D.

Convs have no bias (each feeds a BatchNorm); BatchNorm running statistics are the
model's state. In make_resnet and make_resnet18, spec.dropout applies to the
pooled features before the classifier.

Each factory also takes `widths`, the channels of the stem and of each stage
(`default_widths`; None: the network's own), to build the same network thinner or
wider: a Packed-Ensemble's members (ensembles/packed.py) are the run's ResNet at
int(alpha * C) / M channels.

Defaults for the ModelSpec's Optional fields (None) live here and only here:
RESNET_DEPTH, WRN_DEPTH and WRN_WIDEN_FACTOR.
"""

from typing import NamedTuple

import jax

from dist_ens.core.model import Model
from dist_ens.errors import ConfigError
from dist_ens.models import layers
from dist_ens.models.spec import ModelSpec

RESNET_DEPTH = 20  # spec.depth None: ResNet-20
WRN_DEPTH, WRN_WIDEN_FACTOR = 28, 10  # spec.depth / widen_factor None: WRN-28-10


class _Block(NamedTuple):
  """The static shape of one residual block."""
  in_ch: int
  out_ch: int
  stride: int


def _plan(in_ch: int, widths: tuple[int, ...], blocks_per_stage: int) -> tuple[_Block, ...]:
  """Blocks stage by stage; every stage after the first halves the resolution."""
  plan = []
  for stage, width in enumerate(widths):
    for i in range(blocks_per_stage):
      plan.append(_Block(in_ch, width, 2 if stage > 0 and i == 0 else 1))
      in_ch = width
  return tuple(plan)


def _blocks_per_stage(depth: int | None, default: int, offset: int, family: str) -> int:
  """n from depth (config.model.depth; None: default) = 6n + offset, or a ConfigError
  listing valid depths."""
  depth = default if depth is None else depth
  if (not isinstance(depth, int) or isinstance(depth, bool) or depth < 6 + offset
      or (depth - offset) % 6):
    valid = [6 * n + offset for n in (1, 2, 3, 4, 5, 6, 9, 18)]
    hint = ' (ResNet-18 is its own model, make_resnet18)' if offset == 2 else ''
    raise ConfigError(f'config.model.depth={depth!r} is not 6n+{offset} with n >= 1, as '
                      f'{family} needs{hint}; use one of {valid}.')
  return (depth - offset) // 6


def _check_widths(widths: tuple[int, ...] | None, default: tuple[int, ...],
                  family: str) -> tuple[int, ...]:
  """`widths` (stem, stage 1, ...) checked against the network's stage count, or
  `default` when None."""
  if widths is None:
    return default
  widths = tuple(widths)
  if len(widths) != len(default) or not all(
      isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths):
    raise ValueError(f'{family} takes widths of the stem and its {len(default) - 1} stages, '
                     f'{len(default)} positive ints like {default}, not {widths!r}.')
  return widths


def _norm(params, state, new_state, name, x, train):
  """BatchNorm `name`, recording its new running statistics in new_state."""
  y, new_state[name] = layers.batch_norm(params[name], state[name], x, train=train)
  return y


def _basic_init(rank, block):
  """A post-activation basic block: conv-BN-ReLU-conv-BN (+ shortcut), ReLU."""
  params = {'conv1': layers.conv_kernel(3, rank, block.in_ch, block.out_ch),
            'conv2': layers.conv_kernel(3, rank, block.out_ch, block.out_ch)}
  names = ['bn1', 'bn2']
  if block.stride != 1 or block.in_ch != block.out_ch:
    params['proj'] = layers.conv_kernel(1, rank, block.in_ch, block.out_ch)
    names.append('proj_bn')
  state = {}
  for name in names:
    params[name], state[name] = layers.batch_norm_init(block.out_ch)
  return params, state


def _basic_apply(conv, params, state, x, stride, train):
  new_state = {}
  h = conv(x, params['conv1'], stride)
  h = jax.nn.relu(_norm(params, state, new_state, 'bn1', h, train))
  h = _norm(params, state, new_state, 'bn2', conv(h, params['conv2'], 1), train)
  shortcut = x
  if 'proj' in params:
    shortcut = _norm(params, state, new_state, 'proj_bn', conv(x, params['proj'], stride), train)
  return jax.nn.relu(h + shortcut), new_state


def _resnet_v1(spec: ModelSpec, num_classes: int, widths: tuple[int, ...],
               blocks_per_stage: int) -> Model:
  """Stem conv-BN-ReLU, basic blocks, global average pool, dropout, dense; widths:
  (stem, stage 1, ...)."""
  conv = layers.conv_for(spec.conv_impl)
  rate = layers.dropout_rate_for(spec.dropout)
  stem_width, widths = widths[0], widths[1:]
  plan = _plan(stem_width, widths, blocks_per_stage)

  def init(rng, sample_x):
    rank = layers.spatial_rank(sample_x, 'resnet')
    params = {'stem': layers.conv_kernel(3, rank, sample_x.shape[-1], stem_width)}
    state = {}
    params['stem_bn'], state['stem_bn'] = layers.batch_norm_init(stem_width)
    blocks = [_basic_init(rank, block) for block in plan]
    params['blocks'] = [p for p, _ in blocks]
    state['blocks'] = [s for _, s in blocks]
    params['head'] = layers.dense_params(widths[-1], num_classes)
    return layers.he_normal_init(rng, params), state

  def features(params, state, x, *, train, rng=None):
    layers.check_dropout_rng(rate, train, rng)
    new_state = {'blocks': []}
    h = conv(x, params['stem'], 1)
    h = jax.nn.relu(_norm(params, state, new_state, 'stem_bn', h, train))
    for block, p, s in zip(plan, params['blocks'], state['blocks']):
      h, s = _basic_apply(conv, p, s, h, block.stride, train)
      new_state['blocks'].append(s)
    h = layers.dropout(rng, layers.global_avg_pool(h), rate, train=train)
    return layers.dense(params['head'], h), h, new_state if train else state

  def apply(params, state, x, *, train, rng=None):
    logits, _, state = features(params, state, x, train=train, rng=rng)
    return logits, state

  return Model(init, apply, features=features)


def default_widths(spec: ModelSpec) -> tuple[int, ...]:
  """The channels of the stem and of each stage of config.model.name's ResNet:
  (16, 16, 32, 64) for 'resnet', (64, 64, 128, 256, 512) for 'resnet18', (16, 16k, 32k,
  64k) for 'wide_resnet'."""
  if spec.name == 'resnet18':
    return (64, 64, 128, 256, 512)
  if spec.name == 'wide_resnet':
    k = _widen_factor(spec)
    return (16, 16 * k, 32 * k, 64 * k)
  return (16, 16, 32, 64)


def make_resnet(spec: ModelSpec, num_classes: int,
                widths: tuple[int, ...] | None = None) -> Model:
  """CIFAR ResNet of depth spec.depth (6n+2; None: RESNET_DEPTH, 20); widths: the stem's
  and the 3 stages' channels (None: 16, 16, 32, 64).

  Reads spec.depth, spec.dropout and spec.conv_impl.

  Example:
    >>> spec = ModelSpec(name='resnet', factory='', kwargs={}, widths=(), channels=(),
    ...                  kernel_sizes=(), strides=(), conv_impl='auto', dropout=0.0, depth=20)
    >>> model = make_resnet(spec, num_classes=10)
    >>> params, state = model.init(jax.random.key(0), jax.numpy.zeros((1, 32, 32, 3)))
    >>> x = jax.numpy.zeros((8, 32, 32, 3))
    >>> logits, state = model.apply(params, state, x, train=True)
  """
  n = _blocks_per_stage(spec.depth, default=RESNET_DEPTH, offset=2, family='a CIFAR ResNet')
  widths = _check_widths(widths, (16, 16, 32, 64), 'a CIFAR ResNet')
  return _resnet_v1(spec, num_classes, widths, n)


def make_resnet18(spec: ModelSpec, num_classes: int,
                  widths: tuple[int, ...] | None = None) -> Model:
  """The CIFAR ResNet-18; reads spec.dropout and spec.conv_impl; widths: the stem's and
  the 4 stages' channels (None: 64, 64, 128, 256, 512)."""
  widths = _check_widths(widths, (64, 64, 128, 256, 512), 'ResNet-18')
  return _resnet_v1(spec, num_classes, widths, 2)


def _wide_init(rank, block):
  """A pre-activation block: BN-ReLU-conv-BN-ReLU-dropout-conv (+ shortcut)."""
  params, state = {}, {}
  params['bn1'], state['bn1'] = layers.batch_norm_init(block.in_ch)
  params['conv1'] = layers.conv_kernel(3, rank, block.in_ch, block.out_ch)
  params['bn2'], state['bn2'] = layers.batch_norm_init(block.out_ch)
  params['conv2'] = layers.conv_kernel(3, rank, block.out_ch, block.out_ch)
  if block.stride != 1 or block.in_ch != block.out_ch:
    params['proj'] = layers.conv_kernel(1, rank, block.in_ch, block.out_ch)
  return params, state


def _wide_apply(conv, params, state, x, stride, train, rate, rng):
  new_state = {}
  a = jax.nn.relu(_norm(params, state, new_state, 'bn1', x, train))
  # A projection sees the normalised input, as in the WRN authors' code.
  shortcut = conv(a, params['proj'], stride) if 'proj' in params else x
  h = jax.nn.relu(_norm(params, state, new_state, 'bn2', conv(a, params['conv1'], stride), train))
  h = layers.dropout(rng, h, rate, train=train)
  return conv(h, params['conv2'], 1) + shortcut, new_state


def _widen_factor(spec: ModelSpec) -> int:
  """k: spec.widen_factor (None: WRN_WIDEN_FACTOR), or a ConfigError."""
  k = WRN_WIDEN_FACTOR if spec.widen_factor is None else spec.widen_factor
  if not isinstance(k, int) or isinstance(k, bool) or k < 1:
    raise ConfigError(f'config.model.widen_factor={k!r} must be a positive integer, '
                      f'e.g. {WRN_WIDEN_FACTOR}.')
  return k


def make_wide_resnet(spec: ModelSpec, num_classes: int,
                     widths: tuple[int, ...] | None = None) -> Model:
  """WRN-d-k: d = spec.depth (6n+4; None: WRN_DEPTH, 28), k = spec.widen_factor (None:
  WRN_WIDEN_FACTOR, 10); widths: the stem's and the 3 stages' channels (None: 16, 16k,
  32k, 64k; k is then not read).

  Also reads spec.dropout (between the two convs of every block) and spec.conv_impl.
  """
  n = _blocks_per_stage(spec.depth, default=WRN_DEPTH, offset=4, family='a wide ResNet')
  if widths is None:
    widths = default_widths(spec)
  widths = _check_widths(widths, (16, 16, 32, 64), 'a wide ResNet')
  conv = layers.conv_for(spec.conv_impl)
  rate = layers.dropout_rate_for(spec.dropout)
  plan = _plan(widths[0], widths[1:], n)

  def init(rng, sample_x):
    rank = layers.spatial_rank(sample_x, 'wide_resnet')
    params = {'stem': layers.conv_kernel(3, rank, sample_x.shape[-1], widths[0])}
    blocks = [_wide_init(rank, block) for block in plan]
    params['blocks'] = [p for p, _ in blocks]
    state = {'blocks': [s for _, s in blocks]}
    params['final_bn'], state['final_bn'] = layers.batch_norm_init(plan[-1].out_ch)
    params['head'] = layers.dense_params(plan[-1].out_ch, num_classes)
    return layers.he_normal_init(rng, params), state

  def features(params, state, x, *, train, rng=None):
    layers.check_dropout_rng(rate, train, rng)
    new_state = {'blocks': []}
    h = conv(x, params['stem'], 1)
    for i, (block, p, s) in enumerate(zip(plan, params['blocks'], state['blocks'])):
      block_rng = None if rng is None else jax.random.fold_in(rng, i)
      h, s = _wide_apply(conv, p, s, h, block.stride, train, rate, block_rng)
      new_state['blocks'].append(s)
    h = jax.nn.relu(_norm(params, state, new_state, 'final_bn', h, train))
    h = layers.global_avg_pool(h)
    return layers.dense(params['head'], h), h, new_state if train else state

  def apply(params, state, x, *, train, rng=None):
    logits, _, state = features(params, state, x, train=train, rng=rng)
    return logits, state

  return Model(init, apply, features=features)


# config.model.name -> factory(spec, num_classes, widths=None): what builds a ResNet at
# other widths (a Packed-Ensemble's members).
MAKERS = {'resnet': make_resnet, 'resnet18': make_resnet18, 'wide_resnet': make_wide_resnet}
