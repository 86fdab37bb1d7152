"""config.ensemble.own: which leaves each member owns; every other leaf is shared.

  'all'    every leaf is each member's own (the default: independent members).
  'head'   the output layer (models/heads.py finds it); the rest is one shared backbone.
  'lora'   the head, and rank-r factors of the backbone's kernels (ensembles/lora.py);
           a model whose output layer is its token embedding (tie_word_embeddings, as
           every released GPT-2) has no head of its own: members own their factors alone.
  'batchensemble'  method='batchensemble' itself (resolved in methods.from_spec).
  a regex  the params leaves whose '/'-joined names (e.g. '1/w', 'head/w',
           'blocks/3/mlp/fc2/w') it matches, with re.search.

A shared leaf is stored ONCE, without a member axis (the layout replicates it over
'member' and splits it over 'data'/'model' by its rule, as a member's leaf), read by
every member inside the vmapped step as an unbatched argument, and FROZEN: no gradient
is applied to it and it has no optimizer state. The params are held as BatchEnsemble's
entries (ensembles/batchensemble.py): {'own': p [M, ...]} or {'shared': p}, so the
layout, checkpoints, evaluation and Ensemble.load treat them as they treat its W.

config.ensemble.train_shared=True trains the shared leaves instead, as ONE leaf each (a
LoRA kernel's W too; its scale is a constant): its gradient is the SUM of the gradients
of the members still training (not frozen), that is the gradient of their summed
losses, reduced over every device, and it takes one optimizer step with member 0's
hyperparameters. That is BatchEnsemble's update of its W with a sum for the mean
(batchensemble.members_update, mean=False), and its optimizer state {'shared': one
state of the shared leaves, 'members': each member's of its own}.

The model state (BatchNorm statistics) stays each member's own and is updated as
without `own`: the model runs in training mode, so a frozen backbone still normalises
by the batch's statistics, and running statistics that follow them make evaluation
normalise as training did (they are 2 numbers per channel: storing them once would
save little).
"""

import functools
import re
from collections.abc import Callable
from typing import Any

import jax

from dist_ens.core.hooks import MethodHooks
from dist_ens.core.step import Batch, Member, over_members, update_axes
from dist_ens.ensembles import batchensemble, lora as lora_lib
from dist_ens.errors import ConfigError
from dist_ens.models.heads import head_paths
from dist_ens.parallel.sharding_rules import path_str

PyTree = Any
FIELD = 'config.ensemble.own'
# The values with a name (besides a method's own, methods.METHOD_OWN); any other is a regex.
NAMED = ('all', 'head', 'lora', 'batchensemble')


def random_frozen_base(own: Any, init_from: str, train_shared: bool) -> str | None:
  """The warning for shared leaves that nothing will train and no file gives (None if
  there are none): they stay the seed's random initialisation, frozen, so the members
  train on random features. Kept a warning, not a refusal: random features are a
  baseline some study on purpose (and the combination matrix's cheap shared backbone)."""
  if own in ('all', 'batchensemble') or init_from or train_shared:
    return None
  return (f'{FIELD}={own!r} shares every leaf the members do not own (a backbone, an '
          "epinet's base), frozen, and config.model.init_from is empty: they stay the seed's "
          'random initialisation. Set model.init_from to a trained network '
          '(docs/pretrained.md), or ensemble.train_shared=True to train them.')


def owned_names(own: Any, params: PyTree, num_outputs: int) -> frozenset[str] | None:
  """The names of the params leaves each member owns; None for 'all' (every leaf).

  Args:
    own: config.ensemble.own.
    params: one member's params (ShapeDtypeStructs, no member axis).
    num_outputs: the model's outputs per example (finds the head).

  Raises:
    ConfigError: not a string, a regex that does not compile, or one that owns no leaf
      or every leaf.
  """
  if own == 'all':
    return None
  if not isinstance(own, str) or not own:
    raise ConfigError(f"{FIELD}={own!r} must be 'all', 'head', 'lora' or a regex of leaf "
                      "names, e.g. '^head/' (or 'batchensemble': rank-1 factors per member).")
  names = [path_str(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  if own in ('head', 'lora'):
    owned = head_paths(params, num_outputs)
    if not owned and own == 'lora':  # An output layer tied to the embedding (GPT-2's):
      return frozenset()  # shared with it; each member owns its LoRA factors alone.
    if not owned:
      raise ConfigError(f"{FIELD}={own!r} found no output head in the model (no layer named "
                        f"head or classifier, no kernel with {num_outputs} outputs); give a "
                        f"regex of its leaves' names instead, e.g. '^{names[-1]}$'.")
  else:
    try:
      pattern = re.compile(own)
    except re.error as e:
      raise ConfigError(f'{FIELD}={own!r} is not a regular expression: {e}.') from None
    owned = frozenset(n for n in names if pattern.search(n))
  if not owned or len(owned) == len(names):
    what = 'no leaf' if not owned else "every leaf (that is own='all')"
    raise ConfigError(f'{FIELD}={own!r} matches {what} of the model\'s params '
                      f'{", ".join(names[:6])}{", ..." if len(names) > 6 else ""}; give a '
                      'regex that matches the leaves each member trains, e.g. '
                      f"'^{names[-1].rsplit('/', 1)[0]}/'.")
  return owned


def resolve(own: Any, lora: tuple[Any, Any, Any] | None, params: PyTree,
            num_outputs: int) -> tuple[frozenset[str] | None, lora_lib.Lora | None]:
  """(the names each member owns, or None for every leaf; own='lora''s adapted kernels,
  or None) on one member's `params`: owned_names, then lora `(rank, alpha, targets)`
  resolved on the leaves the members do not own."""
  owned = owned_names(own, params, num_outputs)
  if owned is None or lora is None:
    return owned, None
  return owned, lora_lib.resolve(params, owned, *lora)


def from_members(owned: frozenset[str], params: PyTree, keys: jax.Array,
                 lora: lora_lib.Lora | None = None) -> PyTree:
  """Entries from M members' initial params (stacked): member 0's value of each shared
  leaf (a function of the seed alone, or config.model.init_from's), each member's own;
  with `lora`, its targets' entries with per-member factors from `keys` [M]."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  entries = []
  for i, (path, p) in enumerate(leaves):
    name = path_str(path)
    if name in owned:
      entries.append({'own': p})
    elif lora is not None and name in lora.targets:
      entries.append(lora_lib.entry(p, lora, keys, i))
    else:
      entries.append({batchensemble.SHARED: p[0]})
  return treedef.unflatten(entries)


def init_opt_state(optimizer, params: PyTree, hparams: dict[str, jax.Array]) -> PyTree:
  """Each member's optimizer state of its own leaves; none for the frozen shared ones."""
  _, own = batchensemble.split(params)
  return jax.vmap(lambda hp, p: optimizer(hp).init(p))(hparams, own)


def members_update(results: Callable[..., Any], apply: Callable[..., Any], optimizer,
                   parallelism: str, batch_axis: int | None,
                   map_batch_size: int | None = None) -> Callable[..., Any]:
  """update(members, hp, member_ids, step, batch) -> (members, metrics) over a device's
  block of members (core.step.Member; core.hooks.MethodHooks.members_update): each member's
  forward and backward pass on its params formed from the shared leaves (unbatched)
  and its own, and its optimizer step on its own leaves only."""
  del optimizer

  def one(member: Member, hp, member_id, step, batch: Batch, shared):
    # Only the own leaves' cotangents are read: XLA drops the shared ones' gradients.
    params, vjp = jax.vjp(lambda o: batchensemble.member_params(batchensemble.merge(shared, o)),
                          member.params)
    result = results(params, member.model_state, hp, member_id, step, batch)
    (grads,) = vjp(result.grads)
    return apply(member, hp, result._replace(grads=grads))

  # The new Member (its own leaves) replaces the first argument: in place under 'map'.
  per_member = over_members(one, parallelism, in_axes=update_axes(batch_axis) + (None,),
                            map_batch_size=map_batch_size, in_place=1)

  def update(members: Member, hp, member_ids, step, batch: Batch):
    shared, own = batchensemble.split(members.params)
    new, metrics = per_member(members._replace(params=own), hp, member_ids, step, batch, shared)
    return new._replace(params=batchensemble.merge(shared, new.params)), metrics

  return update


def hooks(owned: frozenset[str], lora: lora_lib.Lora | None = None,
          train_shared: bool = False) -> MethodHooks:
  """What sharing every leaf but `owned` (and `lora`'s factors) changes in core: the
  shared leaves frozen, or with `train_shared` trained by the members' summed gradient."""
  init = lambda params, keys: from_members(owned, params, keys, lora)
  if train_shared:
    return MethodHooks(init_params=init, init_opt_state=batchensemble.init_opt_state,
                       members_update=functools.partial(batchensemble.members_update,
                                                        mean=False),
                       shared=batchensemble.is_shared)
  return MethodHooks(init_params=init, init_opt_state=init_opt_state,
                     members_update=members_update, shared=batchensemble.is_shared)
