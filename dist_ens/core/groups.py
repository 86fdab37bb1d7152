"""Member groups: stacks of members of different architectures as one state and one step.

A group is a stack of members that share one model, so one vmap runs them, as an
ensemble without groups does. The ensemble is every group's members, their ids running
across groups in order (group g's first member is the sum of the counts before it).
The joined state is a TrainState whose params, model_state, opt_state, method_state and
frozen flags are tuples with one stacked entry per group, and whose step is shared;
core.state.member_flags reads the flags as [M] in id order. The joined step runs each
group's own step in sequence inside one jitted program, every group sharded over all
devices of the 'member' axis, and returns each group's metrics (metrics_in_id_order joins
them on the host). Nothing is concatenated on the devices: an [M] array in id order,
sharded over 'member', places a group's members on other devices than the group's own
[count] arrays do, and resharding them cost collectives on every step (BENCHMARKS.md,
"Member groups").
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dist_ens.core.model import Model, stacked_axes
from dist_ens.core.state import TrainState
from dist_ens.core.step import StepMetrics, TrainStep


class Group(NamedTuple):
  """Where a group's members sit in the ensemble: ids first .. first + count - 1."""
  first: int
  count: int

  @property
  def ids(self) -> slice:
    return slice(self.first, self.first + self.count)


def locate(groups: Sequence[Group], member: int) -> tuple[int, int]:
  """(the group holding `member`, its index within that group's stack)."""
  for g, group in enumerate(groups):
    if group.first <= member < group.first + group.count:
      return g, member - group.first
  raise IndexError(f'member {member} is in no group of {list(groups)}.')


def split_state(state: TrainState) -> list[TrainState]:
  """The joined state as one TrainState per group, in group order."""
  return [TrainState(params, model_state, opt_state, frozen, state.step, method_state)
          for params, model_state, opt_state, frozen, method_state in zip(
              state.params, state.model_state, state.opt_state, state.frozen,
              state.method_state)]


def join_states(states: Sequence[TrainState]) -> TrainState:
  """One TrainState of every group's (the inverse of split_state); of abstract (sharded)
  states too."""
  return TrainState(params=tuple(s.params for s in states),
                    model_state=tuple(s.model_state for s in states),
                    opt_state=tuple(s.opt_state for s in states),
                    frozen=tuple(s.frozen for s in states),
                    step=states[0].step,
                    method_state=tuple(s.method_state for s in states))


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


def members_model(models: Sequence[Model], groups: Sequence[Group]) -> Model:
  """A Model whose members_map runs a function on each group's stack with the group's
  own model and member ids, joining the results in id order [M, ...] (core.model's
  over_stacks: evaluation, MC dropout)."""

  def members_map(fn, params, model_state):
    outs = [fn(model, p_g, s_g, jnp.arange(group.first, group.first + group.count))
            for model, group, p_g, s_g in zip(models, groups, params, model_state)]
    dtype = jnp.result_type(*outs)
    return jnp.concatenate([o.astype(dtype) for o in outs])

  return Model(init=_not_one_model, apply=_not_one_model, members_map=members_map)


def _group_batch(batch: tuple[jax.Array, ...], group: Group, member_axis: int,
                 per_member_batches: bool) -> tuple[jax.Array, ...]:
  """The group's members' batches: all of a shared batch, its rows of per-member ones."""
  if not per_member_batches:
    return batch
  return tuple(jax.lax.slice_in_dim(a, group.first, group.first + group.count,
                                    axis=member_axis) for a in batch)


def join_steps(steps: Sequence[TrainStep], groups: Sequence[Group], state_shardings: Any, *,
               per_member_batches: bool, steps_per_call: int) -> TrainStep:
  """One jitted step(state, hparams, *batch) -> (state, (each group's StepMetrics)) that
  runs every group's step in turn on its part of the joined state. `hparams` is a tuple
  of each group's ({field: [count]}, sharded as its state); per-member batches are sliced
  to each group's members."""
  member_axis = 1 if steps_per_call > 1 else 0
  joined = TrainStep(fn=None, uses_index=steps[0].uses_index)

  def traced(state, hparams, *batch):
    joined.traces += 1
    new_states, metrics = [], []
    for step, group, one in zip(steps, groups, split_state(state)):
      new, out = step.fn(one, hparams[len(new_states)],
                         *_group_batch(batch, group, member_axis, per_member_batches))
      new_states.append(new)
      metrics.append(out)
    return join_states(new_states), tuple(metrics)

  joined.fn = jax.jit(traced, donate_argnums=0, out_shardings=(state_shardings, None))
  return joined


def metrics_in_id_order(metrics: Any) -> Any:
  """A step's metrics as numpy in id order ([M], or [K, M] for K steps a call): a joined
  step's per-group StepMetrics concatenated on their last axis, others as they are."""
  if not (isinstance(metrics, tuple) and metrics and isinstance(metrics[0], StepMetrics)):
    return metrics
  return jax.tree.map(lambda *a: np.concatenate(a, axis=-1), *metrics)
