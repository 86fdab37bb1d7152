"""The stacked train state of all members, and how it is born.

Every leaf of params, model_state and opt_state has a leading member axis [M, ...];
`step` is one replicated counter. How each leaf is laid out on the mesh is a
per-leaf rule (dist_ens.parallel.layout), not a property of this type.
"""

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dist_ens.core import rng
from dist_ens.core.hooks import MethodHooks
from dist_ens.core.model import Model, is_kernel
from dist_ens.core.optim import Optimizer

PyTree = Any


class TrainState(NamedTuple):
  """What training carries from step to step, for all members at once."""
  params: PyTree  # [M, ...] trained by the optimizer.
  model_state: PyTree  # [M, ...] e.g. BatchNorm running statistics; {} if the model has none.
  opt_state: PyTree  # [M, ...] the optimizer's own state (moments, counts).
  frozen: jax.Array  # [M] bool: the member hit a non-finite loss/gradient and stopped.
  step: jax.Array  # [] int32: steps taken; with (seed, member) it keys all training randomness.
  # [M, ...] what the ensemble method collects while training (snapshots, SWAG moments;
  # dist_ens.ensembles.methods); () for independent members.
  method_state: PyTree = ()


def member_flags(frozen: Any) -> Any:
  """A state's frozen flags [M] in id order: `frozen` itself, or, where members come in
  several stacks (core/stacks.py: one [count] array per stack), their concatenation; numpy in,
  numpy out."""
  if not isinstance(frozen, (tuple, list)):
    return frozen
  if all(isinstance(f, np.ndarray) for f in frozen):
    return np.concatenate(frozen)
  return jnp.concatenate(frozen)


class Pretrained(NamedTuple):
  """Leaves every member starts from (io/init_from.py reads them from a file): trees
  shaped like ONE member's params and model_state, with None where a leaf starts per
  member from (seed, member) as without them."""
  params: PyTree
  model_state: PyTree


def _overlay(stacked: PyTree, one: PyTree) -> PyTree:
  """`stacked` [M, ...] with every leaf `one` gives broadcast over the member axis."""
  return jax.tree.map(
      lambda s, o: s if o is None else jnp.broadcast_to(jnp.asarray(o, s.dtype), s.shape),
      stacked, one, is_leaf=lambda x: x is None)


def scale_init(params: PyTree, init_scale: float | jax.Array | None) -> PyTree:
  """Multiplies every weight matrix / kernel (core.model.is_kernel) by `init_scale`.

  Biases and normalisation parameters (1-D) keep their initial values, so the
  per-member hyperparameter model.init_scale means the same for any model: a
  multiplier of the initial weights' scale (for He-normal, of their std).
  """
  if init_scale is None:
    return params
  return jax.tree.map(lambda p: p * init_scale if is_kernel(p) else p, params)


def init_state(model: Model, optimizer: Optimizer, seed: int, num_members: int,
               sample_x: jax.Array, hparams: Mapping[str, jax.Array],
               hooks: MethodHooks = MethodHooks(),
               pretrained: Pretrained | None = None, first_member: int = 0) -> TrainState:
  """All members' initial state; member i's depends only on (seed, i) and its hyperparameters.

  Args:
    model: the single-member model.
    optimizer: optimizer(member_hparams) -> GradientTransformation.
    seed: config.seed.
    num_members: M.
    sample_x: a batch of inputs [B, *input_shape] (shapes only; e.g. zeros).
    hparams: per-member hyperparameters, each [M] (dist_ens.core.hparams.resolve).
    hooks: the ensemble method's (core.hooks); the default: independent members.
    pretrained: leaves every member starts from, exactly (model.init_scale applies only
      to the leaves initialised here, from rng.fresh_keys); the method's hooks and the
      optimizer's init then see them as the members' initial params.
    first_member: the id of the first of these members (a stack's place in the
      ensemble, dist_ens.core.stacks): member first_member + i is keyed as that id.
  """
  keys = rng.member_keys(seed, jnp.arange(first_member, first_member + num_members,
                                               dtype=jnp.uint32))
  hparams = dict(hparams)

  def one(key, hp):
    params, model_state = model.init(key, sample_x)
    return scale_init(params, hp.get('model.init_scale')), model_state

  # Beside loaded leaves, the fresh ones (a new head) draw from a stream of their own:
  # member i's init key drew the pretraining run's, where its seed was this one.
  params, model_state = jax.vmap(one)(keys if pretrained is None else rng.fresh_keys(keys),
                                      hparams)
  if pretrained is not None:
    params = _overlay(params, pretrained.params)
    model_state = _overlay(model_state, pretrained.model_state)
  if hooks.init_params is not None:
    params = hooks.init_params(params, keys)
  if hooks.init_opt_state is not None:
    opt_state = hooks.init_opt_state(optimizer, params, hparams)
  else:
    opt_state = jax.vmap(lambda hp, p: optimizer(hp).init(p))(hparams, params)
  collected = (() if hooks.init_collected is None
               else jax.vmap(hooks.init_collected)(params, model_state))
  return TrainState(params=params, model_state=model_state, opt_state=opt_state,
                    frozen=jnp.zeros((num_members,), jnp.bool_), step=jnp.zeros((), jnp.int32),
                    method_state=collected)
