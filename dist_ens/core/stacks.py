"""An ensemble as stacks: each stack is members that share one model, so one vmap runs
them; an ensemble of one architecture is one stack, and an ensemble of several (the
config's member groups) is several, joined into one state and one step.

Members' ids run across the stacks in order (stack s's first member is the sum of the
counts before it): a `Place`. `Places` says where every stack lies and how a state holds
them: one stack's state is a plain TrainState; a joined state is a TrainState whose
params, model_state, opt_state, method_state and frozen flags are tuples with one
stacked entry per stack, and whose step is shared (core.state.member_flags reads the
flags as [M] in id order). `Places.split` and `Places.join` read and build both kinds
the same way, so code that works on each stack (a Laplace fit, PBT's copies, an init)
loops over `places.split(state)` without asking how many there are.

The joined step runs each stack's own step in sequence inside one jitted program, every
stack sharded over all devices of the 'member' axis, and returns each stack's metrics
(metrics_in_id_order joins them on the host). Nothing is concatenated on the devices: an
[M] array in id order, sharded over 'member', places a stack's members on other devices
than the stack's own [count] arrays do, and resharding them cost collectives on every
step (BENCHMARKS.md, "Member groups").
"""

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dist_ens.core.model import Model
from dist_ens.core.state import TrainState
from dist_ens.core.step import StepMetrics, TrainStep


class Place(NamedTuple):
  """Where a stack's members sit in the ensemble: ids first .. first + count - 1."""
  first: int
  count: int

  @property
  def ids(self) -> slice:
    return slice(self.first, self.first + self.count)


@dataclasses.dataclass(frozen=True)
class Places:
  """Every stack's place, in id order, and whether the state joins them (several stacks,
  or the config's member groups even where there is one)."""
  places: tuple[Place, ...]
  joined: bool = False

  @classmethod
  def one(cls, num_members: int) -> 'Places':
    """A single stack of num_members members: its state is a plain TrainState."""
    return cls((Place(0, num_members),))

  def __iter__(self) -> Iterator[Place]:
    return iter(self.places)

  def __len__(self) -> int:
    return len(self.places)

  def locate(self, member: int) -> tuple[int, int]:
    """(the stack holding `member`, its index within that stack)."""
    for s, place in enumerate(self.places):
      if place.first <= member < place.first + place.count:
        return s, member - place.first
    raise IndexError(f'member {member} is in no stack of {list(self.places)}.')

  def split(self, state: TrainState) -> list[TrainState]:
    """The state as one TrainState per stack, in id order (of abstract states too)."""
    return split_state(state) if self.joined else [state]

  def join(self, states: Sequence[TrainState]) -> TrainState:
    """One state of every stack's (the inverse of split)."""
    return join_states(states) if self.joined else states[0]

  def split_tree(self, tree: Any) -> list[Any]:
    """A tree of one kind of leaves (params, say) as one tree per stack."""
    return list(tree) if self.joined else [tree]

  def join_tree(self, trees: Sequence[Any]) -> Any:
    """One tree of every stack's (the inverse of split_tree)."""
    return tuple(trees) if self.joined else trees[0]


def split_state(state: TrainState) -> list[TrainState]:
  """A joined state as one TrainState per stack, in id order."""
  return [TrainState(params, model_state, opt_state, frozen, state.step, method_state)
          for params, model_state, opt_state, frozen, method_state in zip(
              state.params, state.model_state, state.opt_state, state.frozen,
              state.method_state)]


def join_states(states: Sequence[TrainState]) -> TrainState:
  """One joined TrainState of every stack's (the inverse of split_state); of abstract
  (sharded) states too."""
  return TrainState(params=tuple(s.params for s in states),
                    model_state=tuple(s.model_state for s in states),
                    opt_state=tuple(s.opt_state for s in states),
                    frozen=tuple(s.frozen for s in states),
                    step=states[0].step,
                    method_state=tuple(s.method_state for s in states))


def join_inits(inits: Sequence[Callable[[], TrainState]]) -> Callable[..., TrainState]:
  """init() of the joined state from the stacks' own inits (no pretrained leaves)."""

  def init(pretrained=None):
    if pretrained is not None:
      raise ValueError('joined stacks start from their own inits; pretrained leaves are '
                       'given to each stack, not to the joined init.')
    return join_states([one() for one in inits])

  return init


def _not_one_model(*args, **kwargs):
  raise NotImplementedError('a model of several stacks is several architectures: it has '
                            'no single member init or apply (use each stack\'s model).')


def members_model(models: Sequence[Model], places: Places) -> Model:
  """A Model whose members_map runs a function on each stack with the stack's own model
  and member ids, joining the results in id order [M, ...] (core.model's over_stacks:
  evaluation, MC dropout)."""

  def members_map(fn, params, model_state):
    outs = [fn(model, p_s, s_s, jnp.arange(place.first, place.first + place.count))
            for model, place, p_s, s_s in zip(models, places, params, model_state)]
    dtype = jnp.result_type(*outs)
    return jnp.concatenate([o.astype(dtype) for o in outs])

  return Model(init=_not_one_model, apply=_not_one_model, members_map=members_map)


def _stack_batch(batch: tuple[jax.Array, ...], place: Place, member_axis: int,
                 per_member_batches: bool) -> tuple[jax.Array, ...]:
  """The stack's members' batches: all of a shared batch, its rows of per-member ones."""
  if not per_member_batches:
    return batch
  return tuple(jax.lax.slice_in_dim(a, place.first, place.first + place.count,
                                    axis=member_axis) for a in batch)


def join_steps(steps: Sequence[TrainStep], places: Places, state_shardings: Any, *,
               per_member_batches: bool, steps_per_call: int) -> TrainStep:
  """The step of every stack: the one stack's own, or for joined stacks one jitted
  step(state, hparams, *batch) -> (state, (each stack's StepMetrics)) that runs every
  stack's step in turn on its part of the joined state. `hparams` is then a tuple of
  each stack's ({field: [count]}, sharded as its state); per-member batches are sliced to
  each stack's members."""
  if not places.joined:
    return steps[0]
  member_axis = 1 if steps_per_call > 1 else 0
  joined = TrainStep(fn=None, uses_index=steps[0].uses_index)

  def traced(state, hparams, *batch):
    joined.traces += 1
    new_states, metrics = [], []
    for step, place, one in zip(steps, places, split_state(state)):
      new, out = step.fn(one, hparams[len(new_states)],
                         *_stack_batch(batch, place, member_axis, per_member_batches))
      new_states.append(new)
      metrics.append(out)
    return join_states(new_states), tuple(metrics)

  joined.fn = jax.jit(traced, donate_argnums=0, out_shardings=(state_shardings, None))
  return joined


def metrics_in_id_order(metrics: Any) -> Any:
  """A step's metrics as numpy in id order ([M], or [K, M] for K steps a call): a joined
  step's per-stack StepMetrics concatenated on their last axis, others as they are."""
  if not (isinstance(metrics, tuple) and metrics and isinstance(metrics[0], StepMetrics)):
    return metrics
  return jax.tree.map(lambda *a: np.concatenate(a, axis=-1), *metrics)
