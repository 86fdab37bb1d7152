"""Masksembles (Durasov et al. 2021): one set of shared weights, M fixed binary masks.

Every hidden layer's outputs get M masks, one per member, drawn once at init and never
trained; member m runs the shared network with mask m on each hidden layer (the dense
units of the MLP, the channels of the CNN's convolutions and of the ResNets' blocks) and
the members' predictive distributions are averaged, as for any ensemble. Masking a
hidden layer's outputs is masking the input axis (-2) of the kernel that reads them, so
the masks are applied to the parameters, in BatchEnsemble's entries
(ensembles/batchensemble.py):

  kernel reading a hidden layer   {'shared': W, 'r': mask [M, in], 's': ones [M, out]}
  every other leaf                {'shared': p}

(the CNN's head reads the last convolution's channels flattened with their positions:
its mask is that layer's channel mask repeated per position). W and the biases are
stored ONCE; the masks are stacked over 'member', so evaluation, checkpoints,
Ensemble.load and export read the members as they read BatchEnsemble's. In the step each
member runs its own batch through its mask; the shared leaves' gradient is the mean of
the members' (those not frozen, over every device: the paper's batch split into M parts
and its mean loss) and they take one optimizer step with member 0's hyperparameters.
The masks take none: they have no optimizer state and never change.

The ResNets ('resnet', 'resnet18', 'wide_resnet') are masked where torch-uncertainty's
masked ResNets (models/resnet/masked.py, models/wideresnet/masked.py) put their
MaskedConv2d and MaskedLinear: on the input channels of every conv of every block (both
convs and the 1x1 projection shortcut) and on the head's input features; the stem reads
the image whole, and an identity shortcut carries a block's input unmasked. Each masked
kernel has its own masks (`layer` k is the k-th masked kernel, blocks in order, then the
head), as each of torch-uncertainty's masked layers draws its own: a block's first conv
and its projection, reading the same input, see different channels.

BatchNorm: the scales and biases are shared leaves like W; the running statistics are
each member's own, as they are in every dist_ens method (the model state is stacked over
'member'), while torch-uncertainty's one BatchNorm pools its statistics over the M
members' copies of the batch. A member's features are those of its masks (a conv that
reads half its input channels has outputs of another scale than one reading the other
half), so a member normalises in training by its own batch's statistics under its own
masks and in evaluation by the running average of exactly those: evaluation matches
training member by member. Pooled statistics would normalise each member by the mixture
of all members' features, in training and in evaluation alike; both are consistent, and
per member is the one the member axis gives without a reduction across members. It
matters: on the digits ResNet-20 (configs/digits_resnet20.py, 4 members, scale 2) the
members' running variances differ by 24% of their mean (relative std across members,
averaged over the BatchNorms), and evaluating the trained ensemble with the pooled
statistics in place of its own drops test accuracy from 0.992 to 0.703 (NLL 0.058 ->
1.05); a network trained with pooled statistics would have learned under them instead.

The masks of a layer of width c (`generate`): each of the M masks has
m = int(c / (s * (1 - (1 - 1/s)**M))) ones (s: ensemble.masksembles.scale), and the M
masks together use every one of the c units. The paper draws each mask's m ones among
int(m * s) positions, keeps the positions some mask uses, and draws again (searching s)
until exactly c are used; every tuple of masks that cover c positions is then equally
likely, whatever the positions' number: `generate` draws them so (and keeps only
distinct masks: identical ones would make identical members). Two masks share m/s
ones on average: scale 1 is one network, a large scale nearly disjoint sub-networks.
They are drawn with numpy from (config.seed, layer).
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dist_ens.core.axes import MEMBER
from dist_ens.core.hooks import MethodHooks
from dist_ens.core.step import Batch, Member, StepMetrics, over_members, update_axes
from dist_ens.ensembles import batchensemble
from dist_ens.ensembles.method import Method, MethodSpec, refuse_reproducible
from dist_ens.errors import ConfigError
from dist_ens.models import resnet


# config.ensemble.masksembles: this method's fields, each one's meaning in the comments above
# or beside it (dist_ens/config/schema.py reads them; docs/config.md shows them).
FIELDS = dict(
    # In (1, 6]: two masks share 1/scale of their units; each has
    # width / (scale * (1 - (1 - 1/scale)**num_members)) ones (1: one network)
    scale=2.0,
)

PyTree = Any
FIELD = 'config.ensemble.masksembles.scale'
RESNETS = tuple(resnet.MAKERS)  # 'resnet', 'resnet18', 'wide_resnet'
MODELS = ('mlp', 'cnn', *RESNETS)  # config.model.name: the models whose hidden layers it masks
# A ResNet block's convs whose inputs are masked (torch-uncertainty's MaskedConv2d).
MASKED_CONVS = ('conv1', 'conv2', 'proj')
SCALES = (1.0, 6.0)  # scale in (1, 6]: the paper's (1: one network; above 6 it refuses)
SHARED = batchensemble.SHARED
# Draws of a layer's masks at once (at most about 2**22 keys), and the most drawn
# before they are refused.
_KEYS, _MOST_DRAWS = 2**22, 100_000
_STREAM = 0x6D61736B  # 'mask': the numpy stream of the masks beside (seed, layer)


def ones_per_mask(width: int, count: int, scale: float) -> int:
  """m: the ones in each of `count` masks of a layer of `width` units (the paper's)."""
  return int(width / (scale * (1 - (1 - 1 / scale) ** count)))


def generate(width: int, count: int, scale: float, rng: np.random.Generator) -> np.ndarray:
  """`count` distinct masks [count, width] (float32 0/1) of ones_per_mask ones each, that
  together use every unit (the module doc).

  As the paper's code does, each draw places each mask's m ones among P positions, and
  a draw whose masks use exactly `width` of them is kept, those positions in order: P is
  the one whose expected number used, P * (1 - (1 - m/P)**count), is nearest `width`, so
  a draw is kept often (the paper searches its scale to the same end).

  Raises:
    ConfigError: masks of m ones that cannot (or almost never) cover `width` units.
  """
  ones = ones_per_mask(width, count, scale)
  if ones < 1 or ones * count < width or (count > 1 and ones >= width):
    raise ConfigError(f'{FIELD}={scale!r} gives {count} masks of {ones} ones for a hidden '
                      f'layer of {width} units, which cannot cover it with distinct masks; '
                      'use a scale nearer 2, or a wider layer.')
  positions = min(range(width, ones * count + 1),
                  key=lambda p: abs(p * (1 - (1 - ones / p) ** count) - width))
  draws = max(1, min(256, _KEYS // (count * positions)))
  for _ in range(-(-_MOST_DRAWS // draws)):
    # Each mask's ones: the `ones` lowest of uniform keys over the positions.
    masks = rng.random((draws, count, positions)).argsort(-1).argsort(-1) < ones
    used = masks.any(1)
    good = used.sum(-1) == width
    if count > 1:
      rows = np.packbits(masks, axis=-1)
      good &= (rows[:, :, None] == rows[:, None]).all(-1).sum((1, 2)) == count
    if good.any():
      i = np.argmax(good)
      return masks[i][:, used[i]].astype(np.float32)
  raise ConfigError(f'{FIELD}={scale!r}: {count} masks of {ones} ones almost never cover a '
                    f'hidden layer of {width} units ({_MOST_DRAWS} draws did not); use a '
                    'smaller scale, or a wider layer.')


@functools.lru_cache(maxsize=256)
def layer_masks(seed: int, layer: int, width: int, count: int, scale: float) -> np.ndarray:
  """Hidden layer `layer`'s masks, a function of (seed, layer, width, count, scale)."""
  return generate(width, count, scale, np.random.default_rng((seed, _STREAM, layer)))


def _masked(kernel: jax.Array, mask: np.ndarray) -> dict[str, jax.Array]:
  """The entry of a kernel [M, ..., in, out] (members stacked) read through `mask` [M, in]."""
  return {SHARED: kernel[0], 'r': jnp.asarray(mask, kernel.dtype),
          's': jnp.ones((kernel.shape[0], kernel.shape[-1]), kernel.dtype)}


def from_members(model: str, scale: float, seed: int, params: PyTree, keys: jax.Array
                 ) -> PyTree:
  """Masksembles entries from M members' initial params (stacked [M, ...]): member 0's
  (a function of the seed), and masks on the kernels that read a hidden layer."""
  count = keys.shape[0]
  entries = jax.tree.map(lambda p: {SHARED: p[0]}, params)
  if model in RESNETS:
    return _resnet_entries(scale, seed, count, params, entries)
  if model == 'mlp':  # [{'w', 'b'}] per layer: layer i > 0 reads hidden layer i - 1.
    for i in range(1, len(params)):
      w = params[i]['w']
      entries[i]['w'] = _masked(w, layer_masks(seed, i - 1, w.shape[-2], count, scale))
    return entries
  convs, head = params['convs'], params['head']['w']  # The CNN's.
  for i in range(1, len(convs)):
    w = convs[i]['w']
    entries['convs'][i]['w'] = _masked(w, layer_masks(seed, i - 1, w.shape[-2], count, scale))
  channels = convs[-1]['w'].shape[-1]
  last = layer_masks(seed, len(convs) - 1, channels, count, scale)
  # Flattened [positions, channels] features: the channel masks repeated per position.
  entries['head']['w'] = _masked(head, np.tile(last, (1, head.shape[-2] // channels)))
  return entries


def _resnet_entries(scale: float, seed: int, count: int, params: PyTree,
                    entries: PyTree) -> PyTree:
  """A ResNet's entries: masks on the inputs of every block's convs and of the head, each
  kernel its own masks (layer k: the k-th masked kernel, blocks in order, then the head)."""
  kernels = [('blocks', i, name) for i, block in enumerate(params['blocks'])
             for name in MASKED_CONVS if name in block] + [('head', 'w')]
  for layer, path in enumerate(kernels):
    *parents, leaf = path
    node, entry = params, entries
    for key in parents:
      node, entry = node[key], entry[key]
    w = node[leaf]
    entry[leaf] = _masked(w, layer_masks(seed, layer, w.shape[-2], count, scale))
  return entries


def init_opt_state(optimizer, params: PyTree, hparams: dict[str, jax.Array]) -> PyTree:
  """{'shared': one optimizer state of the shared leaves, with member 0's hyperparameters};
  the masks have none."""
  shared, _ = batchensemble.split(params)
  return {SHARED: optimizer({k: v[0] for k, v in hparams.items()}).init(shared)}


def _all_finite(tree: PyTree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.isfinite(jnp.sum(x)) for x in jax.tree.leaves(tree)]))


def members_update(results: Callable[..., Any], apply: Callable[..., Any], optimizer,
                   parallelism: str, batch_axis: int | None,
                   map_batch_size: int | None = None) -> Callable[..., Any]:
  """update(members, hp, member_ids, step, batch) -> (members, metrics) over a device's
  block of members (core.hooks.MethodHooks.members_update): each member's forward and
  backward pass on its batch through its masks, then one optimizer step of the shared
  leaves by the mean gradient of the members still training. A member whose loss or
  gradient is not finite is frozen: left out of the mean, its model state kept."""
  del apply  # Members own no trained leaf: the shared step below is the only one.

  def one(shared, masks, model_state, hp, member_id, step, batch):
    params, vjp = jax.vjp(lambda s: batchensemble.member_params(batchensemble.merge(s, masks)),
                          shared)
    result = results(params, model_state, hp, member_id, step, batch)
    (grads,) = vjp(result.grads)
    nonfinite = ~(jnp.isfinite(result.loss) & _all_finite(grads))
    return result._replace(grads=()), grads, nonfinite

  member_results = over_members(one, parallelism, in_axes=(None, 0) + update_axes(batch_axis),
                                map_batch_size=map_batch_size)

  def update(members: Member, hp, member_ids, step, batch: Batch):
    shared, masks = batchensemble.split(members.params)
    result, grads, nonfinite = member_results(shared, masks, members.model_state, hp,
                                              member_ids, step, batch)
    frozen = members.frozen | nonfinite
    keep = lambda old, new: jnp.where(frozen.reshape((-1,) + (1,) * (new.ndim - 1)), old, new)
    model_state = jax.tree.map(keep, members.model_state, result.model_state)
    # The mean over members still training, on every device: frozen members' (maybe
    # non-finite) gradients are left out with a select, not multiplied by zero.
    count = jnp.maximum(jax.lax.psum(jnp.sum(~frozen), MEMBER), 1)
    grad = jax.tree.map(lambda g: jax.lax.psum(jnp.sum(jnp.where(
        frozen.reshape((-1,) + (1,) * (g.ndim - 1)), 0, g), axis=0), MEMBER)
                        / count.astype(g.dtype), grads)
    first = jax.tree.map(lambda a: a[0], hp)
    updates, opt_state = optimizer(first).update(grad, members.opt_state[SHARED], shared)
    shared = optax.apply_updates(shared, updates)
    return (Member(batchensemble.merge(shared, masks), model_state, {SHARED: opt_state}, frozen),
            StepMetrics(result.loss, result.metrics, nonfinite))

  return update


def check_scale(value: Any) -> float:
  """ensemble.masksembles.scale checked: a number in (1, 6]."""
  low, high = SCALES
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
    raise ConfigError(f'{FIELD}={value!r} must be a number in ({low:g}, {high:g}] (1 would '
                      'be one network; the paper stops at 6), e.g. 2.0.')
  return float(value)


def make(spec: MethodSpec) -> Method:
  """Masksembles from config.ensemble.masksembles (scale): one shared network, each
  member its fixed masks on the hidden layers of config.model.name in MODELS."""
  refuse_reproducible(spec, "the shared weights' gradient is a sum over devices, whose order "
                            'depends on the mesh')
  scale = check_scale(spec.options['scale'])

  def wrap_model(model, task):  # The model as it is (its masks are in the params): the
    # refusal is here, where the task it names is known.
    if spec.model not in MODELS:
      names = ', '.join(repr(name) for name in MODELS)
      raise ConfigError(f"config.ensemble.method='masksembles' masks the hidden layers of "
                        f'config.model.name in ({names}), not {spec.model!r} (config.task='
                        f"{task.name!r}); use one of them, or method='batchensemble'.")
    return model

  init = functools.partial(from_members, spec.model, scale, spec.seed)
  return Method('masksembles', wrap_model=wrap_model, hooks=MethodHooks(
      init_params=init, init_opt_state=init_opt_state, members_update=members_update,
      shared=batchensemble.is_shared))
