"""Vision Transformer (Dosovitskiy et al. 2021) for small images [B, H, W, C] (or
signals [B, L, C]): non-overlapping patches, each flattened and projected (a dense
layer, the same as a conv of kernel = stride = patch), a learned position embedding,
pre-norm encoder blocks (dist_ens.models.transformer), a final LayerNorm, then the
class token's features or the mean over tokens into a dense classifier.

Reads from the ModelSpec (None takes the default in brackets, DEFAULTS: ViT-Ti with
patches of 4 for 32x32 inputs):
  patch_size (4)   patch side; it must divide every spatial side of the input.
  hidden (192)     token width; a multiple of heads.
  depth (12)       encoder blocks.
  heads (3)        attention heads.
  mlp_dim (768)    hidden width of each block's MLP.
  pool ('mean')    'mean' over tokens or 'cls' (a learned class token); mean pooling
                   trains better than a class token on small data sets.
  dropout          after the embedding and on each attention and MLP output.

Kernels are LeCun-normal (std sqrt(1 / fan_in)), the position embedding normal with
std 0.02, biases, LayerNorm offsets and the class token zero. No model state.

Sharding over a 'model' mesh axis (dist_ens.parallel.sharding_rules): FSDP by size
needs nothing from the model; VIT_RULES give tensor parallelism instead, for
by_regex(VIT_RULES, default=fsdp(...)).
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dist_ens.core.axes import MODEL
from dist_ens.core.model import Model
from dist_ens.errors import ConfigError
from dist_ens.models import layers, transformer
from dist_ens.models.spec import ModelSpec

# Tensor parallelism over MODEL (Megatron's split): q, k, v and the MLP's first layer
# split their outputs (columns), the attention's output projection and the MLP's second
# layer their inputs (rows), so each block needs one reduction per sublayer and the
# activations between the two halves stay split. The q/k/v columns are heads x
# head_dim, so a split is by whole heads where the axis divides `heads`; elsewhere XLA
# reshards the heads, correct but slower. Unanchored at the start: the optimizer's
# moments ('opt_state/0/mu/blocks/3/attn/q/w') follow their params.
VIT_RULES: tuple[tuple[str, P], ...] = (
    (r'attn/(q|k|v)/w$', P(None, MODEL)),
    (r'attn/(q|k|v)/b$', P(MODEL)),
    (r'attn/out/w$', P(MODEL, None)),
    (r'mlp/fc1/w$', P(None, MODEL)),
    (r'mlp/fc1/b$', P(MODEL)),
    (r'mlp/fc2/w$', P(MODEL, None)),
)

POOLS = ('mean', 'cls')
# The ViT's defaults for the spec's Optional fields (None), here only.
DEFAULTS = {'patch_size': 4, 'hidden': 192, 'depth': 12, 'heads': 3, 'mlp_dim': 768,
            'pool': 'mean'}


def _field(spec: ModelSpec, name: str) -> int | str:
  value = getattr(spec, name)
  return DEFAULTS[name] if value is None else value


def _positive_int(spec: ModelSpec, name: str) -> int:
  value = _field(spec, name)
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ConfigError(f'config.model.{name}={value!r} must be an int >= 1 for the vit, '
                      f'e.g. {DEFAULTS[name]}.')
  return value


def _read_spec(spec: ModelSpec) -> dict[str, int | str]:
  """The ViT's fields (see the module doc), defaulted and checked."""
  fields = {name: _positive_int(spec, name)
            for name in ('patch_size', 'hidden', 'depth', 'heads', 'mlp_dim')}
  if fields['hidden'] % fields['heads']:
    raise ConfigError(f"config.model.hidden={fields['hidden']} must be a multiple of "
                      f"config.model.heads={fields['heads']}.")
  fields['pool'] = _field(spec, 'pool')
  if fields['pool'] not in POOLS:
    raise ConfigError(f"config.model.pool={fields['pool']!r} is not known; use one of "
                      f'{list(POOLS)}.')
  return fields


def _grid(spatial: tuple[int, ...], patch: int) -> tuple[int, ...]:
  """Patches along each spatial side, or a ConfigError when `patch` does not divide it."""
  if any(n % patch for n in spatial):
    raise ConfigError(f'config.model.patch_size={patch} must divide every spatial side of '
                      f'the input, {spatial}; e.g. {math.gcd(*spatial)}.')
  return tuple(n // patch for n in spatial)


def patchify(x: jax.Array, patch: int) -> jax.Array:
  """[B, *spatial, C] -> [B, patches, patch^rank * C], patches in row-major order."""
  rank = x.ndim - 2
  grid = _grid(x.shape[1:-1], patch)
  split = [d for g in grid for d in (g, patch)]
  x = x.reshape(x.shape[0], *split, x.shape[-1])
  # Grid axes first, then the within-patch axes and channels, which flatten together.
  order = [0, *range(1, 2 * rank, 2), *range(2, 2 * rank + 1, 2), 2 * rank + 1]
  return x.transpose(order).reshape(x.shape[0], math.prod(grid), -1)


def _init_fn(f: dict[str, int | str], num_classes: int):
  """init(rng, sample_x) -> (params, {}) of a ViT with fields `f`."""
  hidden = f['hidden']

  def init(rng, sample_x):
    rank = layers.spatial_rank(sample_x, 'the vit')
    grid = _grid(tuple(sample_x.shape[1:1 + rank]), f['patch_size'])
    tokens = math.prod(grid) + (f['pool'] == 'cls')
    tree = {'embed': layers.dense_params(f['patch_size'] ** rank * sample_x.shape[-1], hidden),
            'blocks': [transformer.block_init(hidden, f['mlp_dim']) for _ in range(f['depth'])],
            'norm': transformer.layer_norm_init(hidden),
            'head': layers.dense_params(hidden, num_classes)}
    k_kernels, k_pos = jax.random.split(rng)
    is_placeholder = jax.tree.map(lambda a: isinstance(a, jax.ShapeDtypeStruct), tree)
    # He-normal has std sqrt(2 / fan_in); LeCun's sqrt(1 / fan_in) suits GELU blocks
    # behind LayerNorms, which expect unit-variance residual updates.
    params = jax.tree.map(lambda a, k: a * math.sqrt(0.5) if k else a,
                          layers.he_normal_init(k_kernels, tree), is_placeholder)
    params['pos'] = 0.02 * jax.random.normal(k_pos, (tokens, hidden), jnp.float32)
    if f['pool'] == 'cls':
      params['cls'] = jnp.zeros((1, hidden), jnp.float32)
    return params, {}

  return init


def make_vit(spec: ModelSpec, num_classes: int) -> Model:
  """A ViT as the module doc describes, from the spec's fields.

  Example:
    >>> spec = ModelSpec(name='vit', factory='', kwargs={}, widths=(), channels=(),
    ...                  kernel_sizes=(), strides=(), conv_impl='auto', dropout=0.0,
    ...                  patch_size=2, hidden=32, depth=2, heads=2, mlp_dim=64)
    >>> model = make_vit(spec, num_classes=10)
    >>> params, state = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
    >>> model.apply(params, state, jnp.zeros((4, 8, 8, 1)), train=False)[0].shape
    (4, 10)
  """
  f = _read_spec(spec)
  rate = layers.dropout_rate_for(spec.dropout)

  def features(params, state, x, *, train=False, rng=None):
    layers.check_dropout_rng(rate, train, rng)
    h = layers.dense(params['embed'], patchify(x, f['patch_size']))
    if f['pool'] == 'cls':
      h = jnp.concatenate([jnp.broadcast_to(params['cls'], (h.shape[0], 1, h.shape[-1])), h], 1)
    h = h + params['pos']
    keys = ([None] * (f['depth'] + 1) if rng is None or not rate
            else list(jax.random.split(rng, f['depth'] + 1)))
    h = layers.dropout(keys[0], h, rate, train=train)
    for block, key in zip(params['blocks'], keys[1:]):
      h = transformer.block(block, h, f['heads'], rate, train=train, rng=key)
    h = transformer.layer_norm(params['norm'], h)
    h = h[:, 0] if f['pool'] == 'cls' else h.mean(axis=1)
    return layers.dense(params['head'], h), h, state

  def apply(params, state, x, *, train=False, rng=None):
    logits, _, state = features(params, state, x, train=train, rng=rng)
    return logits, state

  return Model(_init_fn(f, num_classes), apply, features=features)
