"""Packed-Ensembles (Laurent et al. 2023, ICLR; config.ensemble.method='packed'): M members
as one wider network of grouped layers, with a width factor alpha and gamma groups per
member (config.ensemble.packed.alpha, .gamma; M is config.num_members).

The paper packs the M members into one network whose layers have int(alpha * C) units
(C: the base model's width of that layer) split into M * gamma groups: a group reads only
its own block of the previous layer's units, so the M members never mix and each member's
layer is itself gamma groups. On dist_ens's member axis the M members are already
separate networks stacked and vmapped (vmap is the M-way grouping), so here a
Packed-Ensemble of (M, alpha, gamma) is M members, each the run's model at width

  member_width(C) = int(alpha * C) / M        (torch-uncertainty's rounding: int() of
                                               alpha * C, refused unless M * gamma divides it)

with every hidden-to-hidden layer (the MLP's dense layers between hidden layers, the
CNN's convolutions after the first) a grouped layer of gamma groups: its kernel is stored
[gamma, ..., in / gamma, out / gamma] and group g's outputs read group g's inputs only.
As in the paper's code (torch_uncertainty.layers.PackedLinear/PackedConv2d with
first=True, and its ResNets' last=True layer at gamma=1), the first layer reads the whole
input ungrouped, and the output layer is each member's own dense layer over its whole
last hidden layer. (torch-uncertainty's packed_mlp also groups the output layer by gamma,
which asks the classes to divide by gamma; its ResNets do not: this file follows the
ResNets and the paper's figure.) Its convolutions lower gamma silently while a group would
hold fewer than 64 channels (minimum_channels_per_group, a speed heuristic for large
CNNs); here gamma is what the config says.

The ResNets ('resnet', 'resnet18', 'wide_resnet') are packed as torch-uncertainty's
packed ResNets (models/resnet/packed.py, models/wideresnet/packed.py): every channel
count C (the stem's and each stage's, resnet.default_widths) becomes int(alpha * C) / M
per member (models/resnet.py's `widths`); the stem conv reads the input ungrouped
(first=True); a block's second conv and its 1x1 projection shortcut are grouped in gamma
groups, and so is the wide block's first conv, while the basic block's first conv reads
its member's channels whole (torch-uncertainty passes it no gamma); BatchNorm is per
channel, so per member and per group as in the paper's network of alpha * C channels;
the head is each member's own dense layer (last=True); an identity shortcut adds a
member's channels to its own.

A grouped layer is computed as the block-diagonal dense (or conv) kernel of its groups,
through the model's own apply (models/mlp.py, models/cnn.py at the member width, built
by MethodSpec.build_model; a ResNet by its factory's `widths`): no change to the models,
dropout, conv_impl and features as configured. The function and the trained parameters
are the paper's (a grouped kernel holds alpha^2 C_in C_out / (M^2 gamma) weights per
member); the matmul spends gamma times a grouped one's FLOPs on the zero blocks (equal
at gamma=1, the paper's default). Grouped kernels start He-normal with their group's
fan-in (in / gamma): the diagonal blocks of the member-width model's own init, times
sqrt(gamma).

Each member's params are its own (nothing shared), so everything a deep ensemble does
works as it does there: resume, Ensemble.load, predict, export, shift, joint, PBT
(copyable), Laplace on each member's output layer.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dist_ens.core.model import Model, init_shapes, leaf_at, with_leaf
from dist_ens.ensembles.method import Method, MethodSpec, int_field
from dist_ens.errors import ConfigError
from dist_ens.models import resnet


# config.ensemble.packed: this method's fields, each one's meaning in the comments above
# or beside it (dist_ens/config/schema.py reads them; docs/config.md shows them).
FIELDS = dict(
    alpha=2.0,  # > 0: the packed network's width over the model's
    gamma=1,  # int >= 1: groups in each member's hidden layers
)

PyTree = Any
FIELD = 'config.ensemble.packed'
RESNETS = tuple(resnet.MAKERS)  # config.model.name: the ResNets it packs
# A ResNet block's convs in gamma groups, as torch-uncertainty's packed ResNets: a basic
# block's first conv reads its input in M groups only (gamma=1 there), the wide block's
# in M * gamma.
RESNET_GROUPED = {'resnet': ('conv2', 'proj'), 'resnet18': ('conv2', 'proj'),
                  'wide_resnet': ('conv1', 'conv2', 'proj')}
MODELS = ('mlp', 'cnn', *RESNETS)  # config.model.name: the models whose layers it packs


def check_alpha(value: Any) -> float:
  """ensemble.packed.alpha checked: a finite number > 0."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      math.isfinite(value) and value > 0):
    raise ConfigError(f'{FIELD}.alpha={value!r} must be a finite number > 0 (the packed '
                      "network's width over the base model's), e.g. 2.0.")
  return float(value)


def member_width(width: int, members: int, alpha: float, gamma: int, where: str = '') -> int:
  """A member's units in a layer of the base model's `width`: int(alpha * width) / M,
  where M * gamma divides int(alpha * width) (torch-uncertainty's PackedLinear check).

  Raises:
    ConfigError: it does not divide; `where` names the layer ('config.model.widths[1]=25').
  """
  total = int(width * alpha)
  groups = members * gamma
  if total < groups or total % groups:
    raise ConfigError(
        f'{FIELD}.alpha={alpha:g} and .gamma={gamma} with num_members={members}: '
        f'{where or "a layer"} packs into int({alpha:g} * {width}) = {total} units, which '
        f'num_members * gamma = {groups} groups do not divide; use a width, alpha or gamma '
        f'that makes it a multiple of {groups}.')
  return total // members


def grouped(kernel: jax.Array, gamma: int) -> jax.Array:
  """The diagonal blocks of a kernel [..., in, out] as a grouped kernel [gamma, ..., in /
  gamma, out / gamma], rescaled to He-normal at the group's fan-in (times sqrt(gamma))."""
  *window, c_in, c_out = kernel.shape
  a, b = c_in // gamma, c_out // gamma
  blocks = [kernel[..., g * a:(g + 1) * a, g * b:(g + 1) * b] for g in range(gamma)]
  return jnp.stack(blocks) * math.sqrt(gamma)


def block_diagonal(kernel: jax.Array) -> jax.Array:
  """A grouped kernel [gamma, ..., a, b] as the dense kernel [..., gamma * a, gamma * b]
  whose diagonal block g is group g's and whose other blocks are zero."""
  gamma, *window, a, b = kernel.shape
  eye = jnp.eye(gamma, dtype=kernel.dtype)
  full = jnp.einsum('g...ab,gh->...gahb', kernel, eye)
  return full.reshape(*window, gamma * a, gamma * b)


def _grouped_paths(model: str, params: PyTree) -> list[tuple]:
  """Where the grouped kernels sit: the MLP's layers 1..L-1 (not the head), the CNN's
  convolutions 1.. (the head reads the last one's channels whole); a ResNet's blocks'
  second convs and projections, and the wide ResNet's first convs too (RESNET_GROUPED)."""
  if model == 'mlp':
    return [(i, 'w') for i in range(1, len(params) - 1)]
  if model in RESNETS:
    return [('blocks', i, name) for i, block in enumerate(params['blocks'])
            for name in RESNET_GROUPED[model] if name in block]
  return [('convs', i, 'w') for i in range(1, len(params['convs']))]


def _with_grouped(model_name: str, params: PyTree, fn: Callable[[jax.Array], jax.Array]
                  ) -> PyTree:
  """`params` with `fn` applied to each grouped kernel (a copy)."""
  for path in _grouped_paths(model_name, params):
    params = with_leaf(params, path, fn(leaf_at(params, path)))
  return params


def base_widths(model_name: str, model: Model) -> tuple[int, ...]:
  """The base model's hidden widths (the MLP's units, the CNN's channels), read from the
  shapes of its params (the input's size does not change them)."""
  sample = jax.ShapeDtypeStruct((1, 8, 1), jnp.float32)  # [B, L, C]: the MLP flattens it.
  params = init_shapes(model, sample)[0]
  if model_name == 'mlp':
    return tuple(int(layer['b'].shape[-1]) for layer in params[:-1])
  return tuple(int(conv['b'].shape[-1]) for conv in params['convs'])


def wrap(member_model: Model, model_name: str, gamma: int) -> Model:
  """The member-width model with its hidden-to-hidden kernels grouped into gamma groups
  (stored grouped, applied as their block-diagonal kernels)."""

  def dense(params):
    return _with_grouped(model_name, params, block_diagonal)

  def init(rng, sample_x):
    params, state = member_model.init(rng, sample_x)
    return _with_grouped(model_name, params, lambda kernel: grouped(kernel, gamma)), state

  def apply(params, state, x, *, train=False, rng=None):
    return member_model.apply(dense(params), state, x, train=train, rng=rng)

  def features(params, state, x, *, train=False, rng=None):
    return member_model.features(dense(params), state, x, train=train, rng=rng)

  return Model(init, apply,
               features=None if member_model.features is None else features)


def _member_model(spec: MethodSpec, model: Model, alpha: float, gamma: int) -> Model:
  """The run's model at each layer's member width int(alpha * C) / M (ungrouped)."""
  members = spec.num_members
  if spec.model in RESNETS:
    if spec.model_spec is None:
      raise ValueError('packed needs MethodSpec.model_spec (specs.method_spec).')
    head = init_shapes(model, jax.ShapeDtypeStruct((1, 8, 1), jnp.float32))[0]['head']
    base = resnet.default_widths(spec.model_spec)
    names = ['stem'] + [f'stage {i + 1}' for i in range(len(base) - 1)]
    widths = tuple(member_width(w, members, alpha, gamma,
                                f"config.model.name={spec.model!r}'s {name} ({w} channels)")
                   for name, w in zip(names, base))
    return resnet.MAKERS[spec.model](spec.model_spec, int(head['w'].shape[-1]), widths)
  if spec.build_model is None:
    raise ValueError('packed needs MethodSpec.build_model (specs.method_spec with '
                     'num_outputs).')
  field = 'widths' if spec.model == 'mlp' else 'channels'
  widths = tuple(member_width(w, members, alpha, gamma, f'config.model.{field}[{i}]={w}')
                 for i, w in enumerate(base_widths(spec.model, model)))
  return spec.build_model({field: widths}, f'config.ensemble.method={spec.name!r}')


def make(spec: MethodSpec) -> Method:
  """Packed-Ensembles from config.ensemble.packed (alpha, gamma): each of the
  num_members members the run's MLP, CNN or ResNet at width int(alpha * C) / M, its
  hidden layers in gamma groups (the module doc says which)."""
  alpha = check_alpha(spec.options['alpha'])
  gamma = int_field(spec.options['gamma'], 'packed.gamma', 1)

  def wrap_model(model: Model, task: Any) -> Model:
    if spec.model not in MODELS:
      names = ', '.join(repr(name) for name in MODELS)
      raise ConfigError(f"config.ensemble.method='packed' packs the layers of "
                        f"config.model.name in ({names}), not {spec.model!r} (config.task="
                        f"{task.name!r}); use one of them, or method='deep'.")
    return wrap(_member_model(spec, model, alpha, gamma), spec.model, gamma)

  return Method('packed', wrap_model=wrap_model, copyable=True)


__all__ = ['block_diagonal', 'grouped', 'make', 'member_width']
