"""The train step: one member's update -> vmap (or lax.map) over a device's members ->
shard_map over 'member' -> jit.

The step is manual over 'member' only: each device (group) runs its own block of
members, so no collective ever crosses members. Over 'data' it is global-view:
a member's batch is one array sharded over 'data', the loss is the mean over the
whole batch, and XLA inserts the reductions (gradient all-reduce, BatchNorm's
batch statistics) itself. A model therefore needs no axis names, and BatchNorm
and dropout give the same result on any mesh (dropout keys come from (seed,
member, step), and jax's partitionable threefry draws the same bits for a global
shape however it is sharded).
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from dist_ens.core import rng as rng_lib
from dist_ens.core.losses import Loss, smoothed_cross_entropy
from dist_ens.core.model import Model
from dist_ens.core.optim import Optimizer
from dist_ens.core.state import TrainState
from dist_ens.ensembles.sharding import state_specs
from dist_ens.parallel.mesh import DATA, MEMBER
from dist_ens.parallel.strategy import over_members

PyTree = Any
Hparams = Mapping[str, jax.Array]


class StepMetrics(NamedTuple):
  """Per-member metrics of one step on its train batch, each [M]."""
  loss: jax.Array
  accuracy: jax.Array
  nonfinite: jax.Array  # [M] bool: this step's loss or gradient was not finite.


def _all_finite(tree: PyTree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _zero_where(keep: jax.Array, tree: PyTree) -> PyTree:
  return jax.tree.map(lambda g: jnp.where(keep, jnp.zeros_like(g), g), tree)


@dataclasses.dataclass
class TrainStep:
  """The compiled train step: step(state, hparams, x, y) -> (state, metrics).

  `hparams` are the per-member hyperparameters ({field: [M]}, sharded like the
  state). `traces` counts how often Python traced the step: 1 for a run.
  """
  fn: Callable[..., tuple[TrainState, StepMetrics]] = dataclasses.field(repr=False)
  traces: int = 0

  def __call__(self, state: TrainState, hparams: Hparams, x: jax.Array, y: jax.Array):
    return self.fn(state, hparams, x, y)


def member_update_fn(model: Model, optimizer: Optimizer, seed: int,
                     loss: Loss = smoothed_cross_entropy) -> Callable[..., Any]:
  """update(params, model_state, opt_state, frozen, hp, member, step, x, y) for ONE member.

  Returns (params, model_state, opt_state, frozen, StepMetrics) after one step on
  the member's batch (x, y). A member whose loss or gradient is not finite is
  frozen: from then on its optimizer sees zero gradients (its state stays finite),
  its parameters zero updates and its model state is kept. Masking gradients and
  updates, rather than selecting old-vs-new state afterwards, lets XLA update the
  optimizer moments in place (the select made it copy them every step: 12-34% of a
  dense model's CPU step).
  """

  def update(params, model_state, opt_state, frozen, hp, member, step, x, y):
    key = rng_lib.train_key(seed, member, step)

    def loss_fn(p):
      logits, new_model_state = model.apply(p, model_state, x, train=True, rng=key)
      return loss(logits, y, hp), (logits, new_model_state)

    (value, (logits, new_model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
    nonfinite = ~(jnp.isfinite(value) & _all_finite(grads))
    keep = frozen | nonfinite
    updates, new_opt_state = optimizer(hp).update(_zero_where(keep, grads), opt_state, params)
    new_params = optax.apply_updates(params, _zero_where(keep, updates))
    new_model_state = jax.tree.map(lambda old, new: jnp.where(keep, old, new), model_state,
                                   new_model_state)
    return new_params, new_model_state, new_opt_state, keep, StepMetrics(value, accuracy, nonfinite)

  return update


def _specs(abstract_state: TrainState, per_member_batches: bool, steps_per_call: int):
  """How shard_map's 'member' axis splits the state, the batch and the metrics."""
  batch_spec = P(MEMBER) if per_member_batches else P()
  metrics_spec = P(MEMBER)
  if steps_per_call > 1:
    batch_spec, metrics_spec = P(None, *batch_spec), P(None, MEMBER)
  return state_specs(abstract_state), batch_spec, metrics_spec


def make_train_step(model: Model, optimizer: Optimizer, mesh: Mesh, abstract_state: TrainState,
                    *, seed: int = 0, loss: Loss = smoothed_cross_entropy,
                    per_member_batches: bool = False, member_parallelism: str = 'vmap',
                    map_batch_size: int | None = None, steps_per_call: int = 1) -> TrainStep:
  """Builds the jitted, sharded step; the input state is donated.

  Args:
    model, optimizer, seed, loss: what one member's update is made of.
    mesh: the ('member', 'data') mesh.
    abstract_state: the state's shapes; their specs (ensembles.sharding) lay it out.
    per_member_batches: x, y are [M, B, ...] (each member its own batch, sharded
      over ('member', 'data')); otherwise [B, ...], shared by all members.
    member_parallelism: 'vmap' or 'map', how each device runs its members
      (parallel.strategy.over_members), map_batch_size members at a time for 'map'.
    steps_per_call: K > 1 runs K steps per call in a lax.scan: x and y get a
      leading axis of K batches and every metric one of K steps ([K, M]). The host
      then dispatches once per K steps, which small models on accelerators need.
  """
  if not isinstance(steps_per_call, int) or steps_per_call < 1:
    raise ValueError(f'steps_per_call={steps_per_call!r} must be an int >= 1.')
  batch_axis = 0 if per_member_batches else None
  members_update = over_members(
      member_update_fn(model, optimizer, seed, loss), member_parallelism,
      in_axes=(0, 0, 0, 0, 0, 0, None, batch_axis, batch_axis), map_batch_size=map_batch_size)

  def local_step(state, hparams, x, y):
    local_members = state.frozen.shape[0]
    members = jax.lax.axis_index(MEMBER) * local_members + jnp.arange(local_members)

    def one_step(state, batch):
      params, model_state, opt_state, frozen, metrics = members_update(
          state.params, state.model_state, state.opt_state, state.frozen, hparams, members,
          state.step, *batch)
      return TrainState(params, model_state, opt_state, frozen, state.step + 1), metrics

    if steps_per_call == 1:
      return one_step(state, (x, y))
    return jax.lax.scan(one_step, state, (x, y))

  specs, batch_spec, metrics_spec = _specs(abstract_state, per_member_batches, steps_per_call)

  # Manual over 'member' only; 'data' stays global-view inside (see the module doc).
  # With one device on 'data' both views are the same computation; the all-manual
  # form then compiles to the program dist_ens 0.1 ran, bit for bit.
  manual = {MEMBER} if mesh.shape[DATA] > 1 else set(mesh.axis_names)

  step = TrainStep(fn=None)

  def traced(state, hparams, x, y):
    step.traces += 1
    # check_vma=False: a model's own collective over a vmapped axis (Equinox's
    # BatchNorm, axis_name='batch') trips jax 0.10's varying-axes check.
    return jax.shard_map(
        local_step, mesh=mesh, axis_names=manual, check_vma=False,
        in_specs=(specs, P(MEMBER), batch_spec, batch_spec),
        out_specs=(specs, metrics_spec))(state, hparams, x, y)

  step.fn = jax.jit(traced, donate_argnums=0)
  return step
