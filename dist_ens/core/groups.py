"""Member groups: stacks of members of different architectures as one state and one step.

A group is a stack of members that share one model, so one vmap runs them, as an
ensemble without groups does. The ensemble is every group's members, their ids running
across groups in order (group g's first member is the sum of the counts before it).
The joined state is a TrainState whose params, model_state, opt_state and method_state
are tuples with one stacked entry per group, while `frozen` [M] and `step` stay the
whole ensemble's: what reads a state's members (logging, evaluation, checkpoints) reads
all M in id order. The joined step runs each group's own step in sequence inside one
jitted program, every group sharded over all devices of the 'member' axis.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dist_ens.core.model import Model, stacked_axes
from dist_ens.core.state import TrainState
from dist_ens.core.step import TrainStep


class Group(NamedTuple):
  """Where a group's members sit in the ensemble: ids first .. first + count - 1."""
  first: int
  count: int

  @property
  def ids(self) -> slice:
    return slice(self.first, self.first + self.count)


def split_state(state: TrainState, groups: Sequence[Group]) -> list[TrainState]:
  """The joined state as one TrainState per group (frozen sliced to its members)."""
  return [TrainState(state.params[g], state.model_state[g], state.opt_state[g],
                     state.frozen[group.ids], state.step, state.method_state[g])
          for g, group in enumerate(groups)]


def join_states(states: Sequence[TrainState]) -> TrainState:
  """One TrainState of every group's (the inverse of split_state)."""
  return TrainState(params=tuple(s.params for s in states),
                    model_state=tuple(s.model_state for s in states),
                    opt_state=tuple(s.opt_state for s in states),
                    frozen=jnp.concatenate([s.frozen for s in states]),
                    step=states[0].step,
                    method_state=tuple(s.method_state for s in states))


def join_abstract(states: Sequence[TrainState], frozen_sharding: Any) -> TrainState:
  """The joined abstract state of the groups' abstract (sharded) states; `frozen` [M]
  is sharded with `frozen_sharding` (over 'member', as every group's is)."""
  m = sum(s.frozen.shape[0] for s in states)
  joined = TrainState(*(tuple(getattr(s, f) for s in states) for f in ('params', 'model_state',
                                                                        'opt_state')),
                      frozen=jax.ShapeDtypeStruct((m,), jnp.bool_, sharding=frozen_sharding),
                      step=states[0].step,
                      method_state=tuple(s.method_state for s in states))
  return joined


def join_inits(inits: Sequence[Callable[[], TrainState]]) -> Callable[..., TrainState]:
  """init() of the joined state from the groups' own inits (no pretrained leaves)."""

  def init(pretrained=None):
    if pretrained is not None:
      raise ValueError('member groups start from their own inits; pretrained leaves are '
                       'not supported with groups.')
    return join_states([one() for one in inits])

  return init


def _not_one_model(*args, **kwargs):
  raise NotImplementedError('a model of member groups is several architectures: it has '
                            'no single member init or apply (use each group\'s model).')


def members_model(models: Sequence[Model]) -> Model:
  """A Model whose members_apply gives every group's members' evaluation outputs,
  concatenated in id order [M, B, ...]: each group vmaps its own model."""

  def members_apply(params, model_state, x):
    outs = [jax.vmap(lambda p, s, model=model: model.apply(p, s, x, train=False)[0],
                     in_axes=(stacked_axes(model, p_g), 0))(p_g, s_g)
            for model, p_g, s_g in zip(models, params, model_state)]
    dtype = jnp.result_type(*outs)
    return jnp.concatenate([o.astype(dtype) for o in outs])

  return Model(init=_not_one_model, apply=_not_one_model, members_apply=members_apply)


def _group_batch(batch: tuple[jax.Array, ...], group: Group, member_axis: int,
                 per_member_batches: bool) -> tuple[jax.Array, ...]:
  """The group's members' batches: all of a shared batch, its rows of per-member ones."""
  if not per_member_batches:
    return batch
  return tuple(jax.lax.slice_in_dim(a, group.first, group.first + group.count,
                                    axis=member_axis) for a in batch)


def join_steps(steps: Sequence[TrainStep], groups: Sequence[Group], state_shardings: Any,
               replicated: Any, *, per_member_batches: bool, steps_per_call: int) -> TrainStep:
  """One jitted step(state, hparams, *batch) that runs every group's step in turn on its
  part of the joined state. `hparams` is a tuple of each group's ({field: [count]},
  sharded as its state); per-member batches are sliced to each group's members; the
  metrics come back in id order ([M] or [K, M]) `replicated` (a sharding), as the joined
  state's `frozen` is: a member-sharded [M] would be resharded at every group's slice."""
  member_axis = 1 if steps_per_call > 1 else 0
  joined = TrainStep(fn=None, uses_index=steps[0].uses_index)

  def traced(state, hparams, *batch):
    joined.traces += 1
    new_states, metrics = [], []
    for step, group, one in zip(steps, groups, split_state(state, groups)):
      new, out = step.fn(one, hparams[len(new_states)],
                         *_group_batch(batch, group, member_axis, per_member_batches))
      new_states.append(new)
      metrics.append(out)
    metrics = jax.tree.map(lambda *a: jnp.concatenate(a, axis=member_axis), *metrics)
    return join_states(new_states), metrics

  joined.fn = jax.jit(traced, donate_argnums=0, out_shardings=(state_shardings, replicated))
  return joined
