"""Adapters: users' Flax (linen, NNX), Equinox, Haiku or plain-JAX models -> a `Model`.

dist_ens trains anything that fits its model contract (dist_ens.core.model):
init(rng, sample_x) -> (params, state) and apply(params, state, x, *, train, rng)
-> (logits, new_state), for ONE member. `to_model` picks the adapter from the type
of what it is given, so a user writes a model the way their framework expects and
names its factory in the config (config.model.factory = 'my_pkg.nets:make_net').

Calling conventions (a factory is called with config.model.kwargs as keywords, plus
num_classes=<the dataset's> when its signature names a `num_classes` parameter and
the kwargs do not set it):

  Flax linen   factory(**kwargs) -> nn.Module. Its __call__(x, train) takes `train`
               as a keyword (BatchNorm: use_running_average=not train; Dropout:
               deterministic=not train); one without a `train` parameter is called
               without it. Dropout draws from the 'dropout' rng stream.
  Flax NNX     factory(*, rngs: nnx.Rngs, **kwargs) -> nnx.Module, called as module(x).
               The factory is called once per member inside init with
               nnx.Rngs(default, params=, dropout=) keys from that member's key, so
               every member is initialised differently. apply sets module.train() /
               module.eval() (Dropout.deterministic, BatchNorm.use_running_average)
               and replaces the module's own rng streams with keys derived from the
               step's rng (a stream's key = fold_in(rng, its index), count 0).
  Equinox      factory(*, key, **kwargs) -> eqx.Module, or (eqx.Module, eqx.nn.State)
               from eqx.nn.make_with_state(...)(..., key=key). The module sees ONE
               example: __call__(x, *, key=None) -> logits, or with state
               __call__(x, state, *, key=None) -> (logits, state). dist_ens vmaps it
               over the batch with axis_name='batch', so eqx.nn.BatchNorm must be made
               with axis_name='batch'. Train mode passes one key per example (split
               from the step's rng); eval mode runs eqx.nn.inference_mode(module) with
               key=None. The factory is also called once up front (key(0)) for the
               module's static part.
  Haiku        factory(**kwargs) -> hk.transform_with_state(forward) or
               hk.transform(forward), where forward(x, is_training) takes
               `is_training` as a keyword (omitted when the transformed function does
               not name it); init runs with is_training=True. hk.dropout draws from
               hk.next_rng_key(), which exists only in training: call it only when
               is_training.
  Plain        factory(**kwargs) -> dist_ens.Model(init, apply), or an (init, apply)
               pair already on the contract.

What dist_ens stores for NNX and Equinox models is plain nested dicts of arrays
({'layer': {'kernel': ...}}, list positions as '0', '1', ...), rebuilt into the
framework's own pytrees inside apply: optimizers, orbax checkpoints and exports then
see the same kind of tree for every framework. Linen and Haiku variables are nested
dicts already and are kept as they are.

flax, equinox and haiku are imported only when a model of theirs is adapted.
"""

import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dist_ens.core.model import Model

PyTree = Any


# --- pytrees as nested dicts of arrays ------------------------------------------------


def _entry_name(entry: Any) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


class _Layout(NamedTuple):
  """How a framework pytree maps onto a nested dict of its leaves, and back."""
  treedef: Any
  names: tuple[tuple[str, ...], ...]  # each leaf's path of dict keys, in treedef order

  def to_dict(self, tree: PyTree) -> dict[str, Any]:
    leaves = jax.tree.leaves(tree)
    if len(leaves) != len(self.names):
      raise ValueError(f'the model made {len(leaves)} arrays where its first build made '
                       f'{len(self.names)}: the factory must build the same structure every call.')
    out: dict[str, Any] = {}
    for path, leaf in zip(self.names, leaves):
      node = out
      for part in path[:-1]:
        node = node.setdefault(part, {})
      node[path[-1]] = leaf
    return out

  def from_dict(self, nested: Mapping[str, Any]) -> PyTree:
    leaves = []
    for path in self.names:
      node = nested
      for part in path:
        node = node[part]
      leaves.append(node)
    return jax.tree.unflatten(self.treedef, leaves)


def _layout(tree: PyTree) -> _Layout:
  """The nested-dict layout of `tree`: NNX's Variable `.value` hops are left out of names."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  names = []
  for path, _ in paths:
    parts = tuple(_entry_name(e) for e in path
                  if not (isinstance(e, jax.tree_util.GetAttrKey) and e.name == 'value'))
    names.append(parts or ('value',))
  prefixes = {n[:i] for n in names for i in range(1, len(n))}
  if len(set(names)) != len(names) or prefixes & set(names):
    names = [tuple(_entry_name(e) for e in path) or ('value',) for path, _ in paths]
  return _Layout(treedef, tuple(names))


# --- one adapter per framework --------------------------------------------------------


def _takes(fn: Callable[..., Any], name: str, unreadable: bool = False) -> bool:
  """Whether `fn`'s signature names a parameter `name` (`unreadable` if it has none)."""
  try:
    return name in inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return unreadable


def from_linen(module: Any) -> Model:
  """A Flax linen module as a Model: params = variables['params'], state = the rest."""
  from flax.core import unfreeze  # pylint: disable=import-outside-toplevel
  train_kw = (lambda train: {'train': train}) if _takes(module.__call__, 'train', True) else (
      lambda train: {})

  def init(rng, sample_x):
    k_params, k_dropout = jax.random.split(rng)
    variables = unfreeze(module.init({'params': k_params, 'dropout': k_dropout}, sample_x,
                                     **train_kw(False)))
    params = variables.pop('params', {})
    return params, variables

  def apply(params, state, x, *, train, rng=None):
    variables = {'params': params, **state}
    rngs = {'dropout': rng} if rng is not None else {}
    if train and state:
      logits, new_state = module.apply(variables, x, mutable=list(state), rngs=rngs,
                                       **train_kw(True))
      return logits, {**state, **unfreeze(new_state)}
    return module.apply(variables, x, rngs=rngs, **train_kw(train)), state

  return Model(init, apply)


def from_haiku(transformed: Any) -> Model:
  """An hk.transform_with_state / hk.transform pair as a Model (see the module doc)."""
  import haiku as hk  # pylint: disable=import-outside-toplevel
  stateful = isinstance(transformed, hk.TransformedWithState)
  train_kw = (lambda train: {'is_training': train}) if _takes(
      transformed.apply, 'is_training', True) else (lambda train: {})

  def init(rng, sample_x):
    if stateful:
      return transformed.init(rng, sample_x, **train_kw(True))
    return transformed.init(rng, sample_x, **train_kw(True)), {}

  def apply(params, state, x, *, train, rng=None):
    if not stateful:
      return transformed.apply(params, rng, x, **train_kw(train)), state
    logits, new_state = transformed.apply(params, state, rng, x, **train_kw(train))
    return logits, (new_state if train else state)

  return Model(init, apply)


def from_nnx(factory: Callable[..., Any], kwargs: Mapping[str, Any] | None = None) -> Model:
  """An NNX module factory(rngs=..., **kwargs) as a Model, re-built per member in init."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  kwargs = dict(kwargs or {})

  def build(rng):
    k_default, k_params, k_dropout = jax.random.split(rng, 3)
    module = factory(rngs=nnx.Rngs(k_default, params=k_params, dropout=k_dropout), **kwargs)
    if not isinstance(module, nnx.Module):
      raise TypeError(f'{_name(factory)}(rngs=...) returned {type(module).__name__}, not an '
                      'nnx.Module.')
    return module

  graphdef, params0, rngs0, state0 = nnx.split(
      nnx.eval_shape(lambda: build(jax.random.key(0))), nnx.Param, nnx.RngState, ...)
  params_layout, rngs_layout, state_layout = _layout(params0), _layout(rngs0), _layout(state0)
  rng_leaves = jax.tree.leaves(rngs0)

  def init(rng, sample_x):
    del sample_x  # NNX modules are built with their shapes.
    _, params, _, state = nnx.split(build(rng), nnx.Param, nnx.RngState, ...)
    return params_layout.to_dict(params), state_layout.to_dict(state)

  def apply(params, state, x, *, train, rng=None):
    rng = jax.random.key(0) if rng is None else rng  # Unused in eval: dropout is off.
    streams = [jax.random.fold_in(rng, i) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
               else jnp.zeros(leaf.shape, leaf.dtype) for i, leaf in enumerate(rng_leaves)]
    module = nnx.merge(graphdef, params_layout.from_dict(params),
                       jax.tree.unflatten(rngs_layout.treedef, streams),
                       state_layout.from_dict(state))
    if train:
      module.train()
    else:
      module.eval()
    logits = module(x)
    if not train:
      return logits, state
    return logits, state_layout.to_dict(nnx.split(module, nnx.Param, nnx.RngState, ...)[3])

  return Model(init, apply)


def from_equinox(factory: Callable[..., Any], kwargs: Mapping[str, Any] | None = None) -> Model:
  """An Equinox factory(key=..., **kwargs) -> module or (module, state) as a Model."""
  import equinox as eqx  # pylint: disable=import-outside-toplevel
  kwargs = dict(kwargs or {})

  def build(rng):
    out = factory(key=rng, **kwargs)
    module, state = out if isinstance(out, tuple) else (out, None)
    if not isinstance(module, eqx.Module):
      raise TypeError(f'{_name(factory)}(key=...) returned {type(out).__name__}, not an '
                      'eqx.Module or (eqx.Module, eqx.nn.State).')
    params, static = eqx.partition(module, eqx.is_inexact_array)
    return params, static, state

  params0, static, state0 = build(jax.random.key(0))
  stateful = state0 is not None
  params_layout, state_layout = _layout(params0), _layout(state0 if stateful else {})

  def init(rng, sample_x):
    del sample_x  # Equinox modules are built with their shapes.
    params, _, state = build(rng)
    return params_layout.to_dict(params), state_layout.to_dict(state if stateful else {})

  def apply(params, state, x, *, train, rng=None):
    module = eqx.combine(params_layout.from_dict(params), static)
    if not train:
      module = eqx.nn.inference_mode(module)
    keys = jax.random.split(rng, x.shape[0]) if train and rng is not None else None
    key_axis = None if keys is None else 0
    if not stateful:
      logits = jax.vmap(lambda xi, k: module(xi, key=k), in_axes=(0, key_axis),
                        axis_name='batch')(x, keys)
      return logits, state
    logits, new_state = jax.vmap(lambda xi, s, k: module(xi, s, key=k),
                                 in_axes=(0, None, key_axis), out_axes=(0, None),
                                 axis_name='batch')(x, state_layout.from_dict(state), keys)
    return logits, (state_layout.to_dict(new_state) if train else state)

  return Model(init, apply)


def from_pair(pair: Any) -> Model:
  """A Model, or an (init, apply) pair on the contract, as a Model."""
  if isinstance(pair, Model):
    return pair
  init, apply = pair
  return Model(init, apply)


# --- choosing the adapter -------------------------------------------------------------


def _instance_of(obj: Any, module_name: str, *class_names: str) -> bool:
  """isinstance(obj, module.Class) for a module already imported (never imports it)."""
  module = sys.modules.get(module_name)
  return module is not None and any(
      isinstance(obj, getattr(module, c)) for c in class_names if hasattr(module, c))


def _is_pair(obj: Any) -> bool:
  return isinstance(obj, tuple) and len(obj) == 2 and all(callable(f) for f in obj)


# Built models dist_ens adapts as they are: name -> (matches(obj), adapter(obj) -> Model).
# Order matters: haiku's transformed pairs are tuples, so they come before 'plain'.
ADAPTERS: dict[str, tuple[Callable[[Any], bool], Callable[[Any], Model]]] = {
    'flax_linen': (lambda o: _instance_of(o, 'flax.linen', 'Module'), from_linen),
    'haiku': (lambda o: _instance_of(o, 'haiku', 'Transformed', 'TransformedWithState'),
              from_haiku),
    'plain': (lambda o: isinstance(o, Model) or _is_pair(o), from_pair),
}
# Factories that take the per-member randomness themselves: keyword -> adapter.
FACTORY_ADAPTERS: dict[str, Callable[[Callable[..., Any], Mapping[str, Any]], Model]] = {
    'rngs': from_nnx,
    'key': from_equinox,
}


def _name(fn: Any) -> str:
  return getattr(fn, '__qualname__', None) or type(fn).__name__


def kind_of(obj: Any) -> str | None:
  """The ADAPTERS name that adapts `obj` as it is, or None (e.g. a factory)."""
  for kind, (matches, _) in ADAPTERS.items():
    if matches(obj):
      return kind
  return None


def factory_kwargs(factory: Callable[..., Any], kwargs: Mapping[str, Any] | None,
                   num_classes: int | None) -> dict[str, Any]:
  """`kwargs` plus num_classes when the factory names that parameter and kwargs do not."""
  kwargs = dict(kwargs or {})
  if (num_classes is not None and 'num_classes' not in kwargs and
      _takes(factory, 'num_classes')):
    kwargs['num_classes'] = num_classes
  return kwargs


def to_model(obj: Any, num_classes: int | None = None, *,
             kwargs: Mapping[str, Any] | None = None) -> Model:
  """A dist_ens Model from a built model or from a factory of one (see the module doc).

  Example:
    >>> import flax.linen as nn
    >>> model = to_model(nn.Dense(3))  # a built linen module
    >>> params, state = model.init(jax.random.key(0), jnp.zeros((2, 4)))
    >>> model.apply(params, state, jnp.ones((2, 4)), train=False)[0].shape
    (2, 3)

  Args:
    obj: a linen Module, an hk.Transformed(WithState), a Model or an (init, apply)
      pair; or a factory returning one of them, or taking `rngs` (an NNX module) or
      `key` (an Equinox module). NNX and Equinox need the factory, not a module:
      every member's init calls it with its own randomness.
    num_classes: passed to a factory whose signature has `num_classes` (unless
      kwargs sets it); unused for a built model.
    kwargs: keyword arguments for a factory.

  Returns:
    The Model.

  Raises:
    TypeError: `obj`, or what the factory returned, is none of the above.
  """
  kind = kind_of(obj)
  if kind is not None:
    return ADAPTERS[kind][1](obj)
  if _instance_of(obj, 'flax.nnx', 'Module') or _instance_of(obj, 'equinox', 'Module'):
    raise TypeError(f'{type(obj).__name__} is a built NNX/Equinox module; pass its factory '
                    '(taking rngs= for NNX, key= for Equinox) so that every member is '
                    'initialised with its own key.')
  if not callable(obj):
    raise TypeError(f'cannot make a dist_ens Model of a {type(obj).__name__}.')
  kwargs = factory_kwargs(obj, kwargs, num_classes)
  for keyword, adapter in FACTORY_ADAPTERS.items():
    if keyword not in kwargs and _takes(obj, keyword):
      return adapter(obj, kwargs)
  built = obj(**kwargs)
  if kind_of(built) is None:
    raise TypeError(f'{_name(obj)}(...) returned a {type(built).__name__}; a factory returns a '
                    'flax linen Module, an hk.transform(_with_state) pair, a dist_ens.Model or '
                    'an (init, apply) pair, or takes rngs= (NNX) or key= (Equinox).')
  return to_model(built)
