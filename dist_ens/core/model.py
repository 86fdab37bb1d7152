"""The model contract: what dist_ens needs from ONE member's model.

A model is a pair of pure functions over one member's variables; dist_ens vmaps
them over the member axis itself, so a model never knows it is in an ensemble.

  init(rng, sample_x) -> (params, state)
      rng: a PRNG key; sample_x: a batch of inputs [B, *input_shape] (only its
      shape and dtype matter). params are trained; state holds what is updated in
      training but never by the optimizer (BatchNorm running statistics), {} if
      the model has none.

  apply(params, state, x, *, train, rng=None) -> (logits, new_state)
      x: [B, *input_shape]; logits: [B, num_classes]. With train=True, BatchNorm
      normalises by the statistics of this batch and new_state holds the updated
      running statistics; with train=False it uses the running statistics and
      returns state unchanged. rng drives stochastic layers (dropout) in training;
      it is None in evaluation.

A model may also expose its last hidden features (optional; the built-in MLP, CNN,
ResNets and ViT do):

  features(params, state, x, *, train, rng=None) -> (logits, features, new_state)
      as apply, plus features [B, F]: the vector the logits are a linear function of
      (what an epinet reads, ensembles/epinet.py). None: the model does not expose them.

Under dist_ens's global-view step, `x` is a member's WHOLE batch even when it is
split over the 'data' axis of the mesh: a mean over the batch axis is the mean over
all shards (XLA inserts the cross-device reduction), so BatchNorm needs no
axis_name and is the same on any mesh.

The step calls the model in the run's precision policy (with_precision):
config.precision = 'bfloat16' runs the model's forward and backward pass in bf16, the
floating parameters and inputs cast to bf16 as the model reads them. The parameters
themselves, the optimizer state, the model state (BatchNorm running statistics), the
logits handed to the loss, the loss, the metrics and checkpoints stay float32; gradients
arrive in float32 through the cast.
"""

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Params = Any
State = Any
PyTree = Any

PRECISIONS = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


class Model(NamedTuple):
  """A pure model for ONE member: init(rng, sample_x) and apply(params, state, x, *, train, rng).

  `member_axes(params)`, where set, says how the members' params are stored: a tree of
  0 (the leaf is stacked [M, ...]) or None (one copy that every member reads) over the
  stacked params, which evaluation vmaps with; `member_params(view)` turns one member's
  view of them (stacked leaves indexed, shared ones as they are) into its own plain
  params. None (users' models): every leaf stacked, a member's view is its params.
  ensembles.stored.predicting_model sets both for a method whose members share leaves.
  `features`, where set, is apply with the last hidden features beside the logits (the
  module doc); None: the model does not expose them.
  `members_map(fn, params, state)`, where set, runs fn(model, params, state, member_ids)
  on each stack of members one vmap cannot run together (stacks of different
  architectures, dist_ens.core.stacks: each stack's own model, stacked params and state,
  and its members' ids) and joins the results [M, ...] in id order; over_stacks calls it
  (evaluation, MC dropout) instead of fn on the whole stack.
  """
  init: Callable[[jax.Array, jax.Array], tuple[Params, State]]
  apply: Callable[..., tuple[jax.Array, State]]
  member_axes: Callable[[Params], Any] | None = None
  member_params: Callable[[Params], Params] | None = None
  features: Callable[..., tuple[jax.Array, jax.Array, State]] | None = None
  members_map: Callable[..., jax.Array] | None = None


def init_shapes(model: Model, x: Any) -> tuple[Params, State]:
  """model.init's (params, state) as ShapeDtypeStructs for inputs shaped like `x` (a
  ShapeDtypeStruct): traced with its key made inside, so nothing is compiled or run."""
  return jax.eval_shape(lambda x: model.init(jax.random.key(0), x), x)


def stacked_axes(model: Model, params: Params) -> Any:
  """The vmap in_axes of `params` stacked over members: model.member_axes's, or 0."""
  return 0 if model.member_axes is None else model.member_axes(params)


def over_stacks(model: Model, fn: Callable[..., jax.Array], params: Params,
                state: State) -> jax.Array:
  """fn(model, params, state, member_ids) -> [m, ...] on every stack of members, joined
  [M, ...] in id order: the whole stack (ids 0..M-1), or each member group's
  (model.members_map)."""
  if model.members_map is not None:
    return model.members_map(fn, params, state)
  return fn(model, params, state, jnp.arange(num_stacked(params, stacked_axes(model, params))))


def num_stacked(params: Params, axes: Any) -> int:
  """M: the leading size of the params' stacked leaves (axes from stacked_axes)."""
  if axes == 0:
    return jax.tree.leaves(params)[0].shape[0]
  sizes = [leaf.shape[0] for leaf, axis in zip(jax.tree.leaves(params), jax.tree.leaves(
      axes, is_leaf=lambda a: a is None)) if axis == 0]
  return sizes[0]


def is_kernel(leaf: Any) -> bool:
  """Whether a parameter is a weight matrix or convolution kernel: at least two axes
  longer than one. Biases and normalisation scales are not, whatever their layout
  ([C], or Haiku's [1, C]). model.init_scale and weight decay act on kernels."""
  return sum(d > 1 for d in leaf.shape) >= 2


def leaf_at(tree: PyTree, path: Sequence[Any]) -> Any:
  """The leaf of `tree` (nested dicts and lists) at `path`, its keys and indices."""
  return functools.reduce(operator.getitem, path, tree)


def with_leaf(tree: PyTree, path: Sequence[Any], value: Any) -> PyTree:
  """A copy of `tree` (nested dicts and lists) with the leaf at `path` replaced by `value`."""
  if not path:
    return value
  key, rest = path[0], path[1:]
  if isinstance(tree, list):
    return [with_leaf(v, rest, value) if i == key else v for i, v in enumerate(tree)]
  return {k: with_leaf(v, rest, value) if k == key else v for k, v in tree.items()}


def compute_dtype(precision: str) -> jnp.dtype:
  """The dtype a precision policy's name ('float32', 'bfloat16') names."""
  if precision not in PRECISIONS:
    raise ValueError(f'precision={precision!r}; use one of {sorted(PRECISIONS)}.')
  return PRECISIONS[precision]


def cast_floating(tree: PyTree, dtype: jnp.dtype) -> PyTree:
  """Every floating leaf of `tree` as `dtype`; other leaves (ints, keys) unchanged."""
  return jax.tree.map(
      lambda a: a.astype(dtype) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a, tree)


def with_precision(model: Model, precision: str) -> Model:
  """`model` computing in `precision`, reading and returning float32 (the module doc).

  float32 returns the model unchanged (the same program as without a policy).
  """
  dtype = compute_dtype(precision)
  if dtype == jnp.float32:
    return model

  def apply(params, state, x, *, train, rng=None):
    logits, new_state = model.apply(cast_floating(params, dtype), state,
                                    cast_floating(x, dtype), train=train, rng=rng)
    new_state = jax.tree.map(lambda new, old: new.astype(jnp.result_type(old)), new_state, state)
    return logits.astype(jnp.float32), new_state

  return Model(model.init, apply)
