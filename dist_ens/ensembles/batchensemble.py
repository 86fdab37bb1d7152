"""BatchEnsemble (Wen et al. 2020): one shared weight per layer, rank-1 factors per member.

Member m's weight matrix or kernel (core.model.is_kernel) is W * outer(r_m, s_m):
one W for all members, and per member r_m over the kernel's input axis (-2) and s_m
over its output axis (-1), the channels-last layout of the built-in models, Flax
and Haiku. Every other parameter (biases, normalisation scales) is each member's
own, as in the paper. The trained params are the member's params tree with every
leaf replaced by a small dict:

  kernel      {'shared': W, 'r': r [M, in], 's': s [M, out]}
  otherwise   {'own': p [M, ...]}

(config.ensemble.own, ensembles/own.py, adds a third: {'shared': p}, a leaf every
member reads as it is; own='lora', ensembles/lora.py, a fourth: {'shared': W,
'lora_scale': s, 'lora_a': A [M, in, r], 'lora_b': B [M, r, out]}, its W and scale
stored once.)

so the shared W is ONE array, replicated over the mesh (`is_shared` tells the layout),
and the rest is
stacked over 'member' like any member's state. Members train in one pass: each
member's loss and gradients are a deep member's (its own batch, dropout and
BatchNorm); W's gradient is the mean over the members' (of those not frozen, over
every device) and W takes one optimizer step, with member 0's hyperparameters.
(config.ensemble.train_shared trains own's shared leaves with this update, by the
SUM of the members' gradients: ensembles/own.py.) The rank-1 form is applied to the
parameters, so any model (Flax, Equinox, Haiku, plain JAX) works unchanged; a
member's kernel is formed each step, so a step costs a deep ensemble's compute
while the state holds one W instead of M.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dist_ens.core.axes import MEMBER
from dist_ens.core.hooks import MethodHooks
from dist_ens.core.model import is_kernel
from dist_ens.core.step import Batch, Member, over_members, update_axes
from dist_ens.ensembles import lora
from dist_ens.ensembles.method import Method, MethodSpec, refuse_reproducible

PyTree = Any
SHARED = 'shared'
# The keys of an entry's leaves stored once for all members (a LoRA kernel's scale too).
SHARED_KEYS = frozenset({SHARED, lora.SCALE})


def _is_entry(x: Any,
              keys: tuple[set[str], ...] = ({SHARED, 'r', 's'}, {'own'}, {SHARED},
                                             {SHARED, lora.SCALE, lora.A, lora.B})) -> bool:
  """Whether `x` is an entry (or, with `keys`, a part of one): a dict of arrays with
  exactly those keys. A model's own dicts hold dicts or have other keys."""
  return (isinstance(x, dict) and set(x) in keys and
          not any(isinstance(v, dict) for v in x.values()))


def is_shared(path: tuple[Any, ...]) -> bool:
  """Whether a leaf of the train state is a shared W or the optimizer's moments of one.

  Every parameter is wrapped in an entry, so a path's last key is always an entry's
  ('shared', 'r', 's', 'own', 'lora_*'), whatever the model names its layers."""
  return bool(path) and getattr(path[-1], 'key', None) in SHARED_KEYS


def unwrapped_path(path: tuple[Any, ...]) -> tuple[Any, ...]:
  """The path of a leaf in a member's own tree: an entry's 'shared' or 'own' key left
  out (the layout's rules match member paths; BatchEnsemble's factors keep theirs)."""
  if path and getattr(path[-1], 'key', None) in (SHARED, 'own'):
    return path[:-1]
  return path


def _random_sign(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
  return jnp.where(jax.random.bernoulli(key, 0.5, shape), 1, -1).astype(dtype)


def from_members(params: PyTree, keys: jax.Array) -> PyTree:
  """BatchEnsemble params from M members' initial params (stacked [M, ...]).

  W is member 0's initial kernel (a function of the seed only); r_m and s_m are
  random signs from member m's key, as Wen et al. initialise the fast weights.
  """
  leaves, treedef = jax.tree.flatten(params)
  entries = []
  for i, p in enumerate(leaves):
    if not is_kernel(p[0]):
      entries.append({'own': p})
      continue
    k = jax.vmap(lambda key: jax.random.split(jax.random.fold_in(key, i)))(keys)
    entries.append({SHARED: p[0],
                    'r': jax.vmap(lambda kk: _random_sign(kk, p.shape[-2:-1], p.dtype))(k[:, 0]),
                    's': jax.vmap(lambda kk: _random_sign(kk, p.shape[-1:], p.dtype))(k[:, 1])})
  return treedef.unflatten(entries)


def member_params(params: PyTree) -> PyTree:
  """ONE member's model params from its view of the BatchEnsemble params (W shared,
  its own r, s and other leaves; a shared leaf without factors as it is)."""
  def form(entry):
    if 'own' in entry:
      return entry['own']
    if lora.A in entry:
      return lora.form(entry)
    if 'r' not in entry:
      return entry[SHARED]
    return entry[SHARED] * (entry['r'][:, None] * entry['s'][None, :])

  return jax.tree.map(form, params, is_leaf=_is_entry)


def split(params: PyTree) -> tuple[PyTree, PyTree]:
  """(shared, per-member) parts of the params; merge() puts them back."""
  shared = jax.tree.map(lambda e: {k: v for k, v in e.items() if k in SHARED_KEYS}, params,
                        is_leaf=_is_entry)
  own = jax.tree.map(lambda e: {k: v for k, v in e.items() if k not in SHARED_KEYS}, params,
                     is_leaf=_is_entry)
  return shared, own


def merge(shared: PyTree, own: PyTree) -> PyTree:
  """The params that split() cut into (shared, own)."""
  return jax.tree.map(lambda s, o: {**s, **o}, shared, own, is_leaf=_is_shared_part)


def _is_shared_part(x: Any) -> bool:
  return _is_entry(x, ({SHARED}, set(SHARED_KEYS), set()))


def _trained(shared: PyTree) -> PyTree:
  """The shared part's trained leaves, each entry's W: a LoRA scale is a constant."""
  return jax.tree.map(lambda e: {k: v for k, v in e.items() if k == SHARED}, shared,
                      is_leaf=_is_shared_part)


def init_opt_state(optimizer, params: PyTree, hparams: dict[str, jax.Array]) -> PyTree:
  """{'shared': one optimizer state for the W's, with member 0's hyperparameters,
  'members': each member's for the rest}."""
  shared, own = split(params)
  first = {k: v[0] for k, v in hparams.items()}
  return {SHARED: optimizer(first).init(_trained(shared)),
          'members': jax.vmap(lambda hp, p: optimizer(hp).init(p))(hparams, own)}


def members_update(results: Callable[..., Any], apply: Callable[..., Any], optimizer,
                   parallelism: str, batch_axis: int | None,
                   map_batch_size: int | None = None, mean: bool = True) -> Callable[..., Any]:
  """update(members, hp, member_ids, step, batch) -> (members, metrics) over a device's
  block of members (core.step.Member; step.member_results_fn's `results`, member_apply_fn's
  `apply`): each member's own leaves step as a deep member's; W by the mean gradient
  (mean=False: the sum, the gradient of the members' summed losses)."""

  def one(shared, own, model_state, hp, member_id, step, batch):
    params, vjp = jax.vjp(lambda s, o: member_params(merge(s, o)), shared, own)
    result = results(params, model_state, hp, member_id, step, batch)
    grad_shared, grad_own = vjp(result.grads)
    return result._replace(grads=grad_own), grad_shared

  member_results = over_members(one, parallelism, in_axes=(None, 0) + update_axes(batch_axis),
                                map_batch_size=map_batch_size)
  member_apply = over_members(apply, parallelism, map_batch_size=map_batch_size)

  def update(members: Member, hp, member_ids, step, batch: Batch):
    shared, own = split(members.params)
    result, grad_shared = member_results(shared, own, members.model_state, hp, member_ids,
                                         step, batch)
    new, metrics = member_apply(
        members._replace(params=own, opt_state=members.opt_state['members']), hp, result)
    frozen = new.frozen
    # The sum (or mean) over members still training, on every device: frozen members'
    # (maybe non-finite) gradients are left out with a select, not multiplied by zero.
    count = jax.lax.psum(jnp.sum(~frozen), MEMBER)
    total = lambda g: jax.lax.psum(jnp.sum(jnp.where(
        frozen.reshape((-1,) + (1,) * (g.ndim - 1)), 0, g), axis=0), MEMBER)
    grad = jax.tree.map(
        lambda g: total(g) / jnp.maximum(count, 1).astype(g.dtype) if mean else total(g),
        _trained(grad_shared))
    first = jax.tree.map(lambda a: a[0], hp)
    weights = _trained(shared)
    updates, shared_opt = optimizer(first).update(grad, members.opt_state[SHARED], weights)
    shared = merge(shared, optax.apply_updates(weights, updates))
    return new._replace(params=merge(shared, new.params),
                        opt_state={SHARED: shared_opt, 'members': new.opt_state}), metrics

  return update


def make(spec: MethodSpec) -> Method:
  """BatchEnsemble (config.ensemble.method='batchensemble', or ensemble.own='batchensemble')."""
  refuse_reproducible(spec, "the shared weights' gradient is a sum over devices, whose order "
                            'depends on the mesh')
  return Method('batchensemble', hooks=MethodHooks(
      init_params=from_members, init_opt_state=init_opt_state,
      members_update=members_update, shared=is_shared))
