"""The train step: per-member loss -> vmap (or lax.map) over a device's members ->
shard_map -> jit.

Each device holds a block of members (the 'member' axis) and a slice of every
member's batch (the 'data' axis). Inside `shard_map` the device computes its
members' gradients on its slice; because the parameters are replicated over
'data', differentiating them sums those gradients over 'data' (one all-reduce),
and each member then applies its own optimizer update. No collective crosses the
'member' axis: members never talk to each other during training.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from dist_ens.ensembles.stacking import over_members
from dist_ens.parallel.mesh import DATA, MEMBER
from dist_ens.models import Model
from dist_ens.core.optim import set_hyperparams

PyTree = Any


class TrainState(NamedTuple):
  """Stacked state of all members; every leaf has a leading member axis [M, ...]."""
  params: PyTree
  opt_state: PyTree
  frozen: jax.Array  # [M] bool: member hit a non-finite loss/gradient and stopped updating.


class StepMetrics(NamedTuple):
  """Per-member metrics of one step on its train batch, each [M]."""
  loss: jax.Array
  accuracy: jax.Array
  nonfinite: jax.Array  # [M] bool: this step's loss or gradient was not finite.


def init_state(model: Model, tx: optax.GradientTransformation, seed: int, num_members: int,
               input_shape: tuple[int, ...],
               member_hparams: dict[str, Any] | None = None) -> TrainState:
  """All members' state; member i's parameters come from fold_in(key(seed), i) alone.

  Args:
    member_hparams: per-member values [M] by field (see dist_ens.core.hparams.FIELDS):
      'model.init_scale' scales the init and 'optim.*' go into each member's
      optimizer state; None keeps the scalars the model and optimizer were built with.
  """
  member_hparams = member_hparams or {}
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(
      jnp.arange(num_members, dtype=jnp.uint32))
  scales = member_hparams.get('model.init_scale')
  if scales is None:
    params = jax.vmap(lambda k: model.init(k, input_shape))(keys)
  else:
    params = jax.vmap(lambda k, s: model.init(k, input_shape, init_scale=s))(keys, scales)
  optim_values = {f.split('.', 1)[1]: v for f, v in member_hparams.items()
                  if f.startswith('optim.')}
  opt_state = jax.vmap(lambda p, hp: set_hyperparams(tx.init(p), hp))(params, optim_values)
  return TrainState(params=params, opt_state=opt_state,
                    frozen=jnp.zeros((num_members,), jnp.bool_))


def cross_entropy(logits: jax.Array, labels: jax.Array,
                  label_smoothing: float | jax.Array = 0.0) -> jax.Array:
  """Mean softmax cross-entropy over the batch, with (possibly traced) label smoothing."""
  targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
  return optax.softmax_cross_entropy(logits, targets).mean()


def _all_finite(tree: PyTree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


@dataclasses.dataclass
class TrainStep:
  """The compiled train step: step(state, x, y, label_smoothing=None) -> (state, metrics).

  `label_smoothing` is None (no smoothing) or a per-member [M] array sharded like
  the state. `traces` counts how often Python traced the step: 1 for a run.
  """
  fn: Callable[..., tuple[TrainState, StepMetrics]] = dataclasses.field(repr=False)
  traces: int = 0

  def __call__(self, state: TrainState, x: jax.Array, y: jax.Array,
               label_smoothing: jax.Array | None = None):
    return self.fn(state, x, y, label_smoothing)


def make_train_step(model: Model, tx: optax.GradientTransformation, mesh: Mesh,
                    per_member_batches: bool = False, member_parallelism: str = 'vmap',
                    map_batch_size: int | None = None, steps_per_call: int = 1) -> TrainStep:
  """Builds the jitted, sharded step; the input state is donated.

  With `per_member_batches`, x and y are [M, B, ...] (each member its own batch,
  sharded over ('member', 'data')); otherwise [B, ...], shared by all members.
  `member_parallelism` ('vmap' or 'map') is how each device runs its members (see
  ensemble.over_members).

  With `steps_per_call` = K > 1, one call runs K steps in a `lax.scan` on the
  device: x and y get a leading axis of K batches ([K, B, ...] or [K, M, B, ...])
  and every metric one of K steps ([K, M]). The result is that of K calls of the
  one-step function; the host dispatches (and the input pipeline hands over) once
  per K steps, which is what small models on an accelerator are limited by.
  """
  if not isinstance(steps_per_call, int) or steps_per_call < 1:
    raise ValueError(f'steps_per_call={steps_per_call!r} must be an int >= 1.')
  step = TrainStep(fn=None)

  def member_update(params, opt_state, frozen, label_smoothing, x, y):
    def loss_fn(p):
      logits = model.apply(p, x, train=True)
      # This shard's share of the mean over the member's whole batch (shards are equal
      # in size). Parameters are replicated over 'data', so shard_map's autodiff sums
      # their gradient over 'data': the result is the gradient of the full-batch mean.
      share = cross_entropy(logits, y, label_smoothing) / jax.lax.axis_size(DATA)
      return share, logits

    (share, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    loss = jax.lax.psum(share, DATA)
    accuracy = jax.lax.pmean(jnp.mean(jnp.argmax(logits, -1) == y), DATA)
    # A member whose loss or gradient is not finite is frozen: from then on its
    # optimizer sees zero gradients (its state stays finite) and its parameters get
    # zero updates (they keep their last finite values). Masking the gradients and
    # updates, rather than selecting old-vs-new state afterwards, lets XLA update the
    # optimizer moments in place: the select kept the old moments alive past the
    # update and made XLA copy them every step (12-34% of a dense model's CPU step).
    # Nothing mixes members, so the others are untouched.
    nonfinite = ~(jnp.isfinite(loss) & _all_finite(grads))
    keep = frozen | nonfinite
    grads = jax.tree.map(lambda g: jnp.where(keep, jnp.zeros_like(g), g), grads)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    updates = jax.tree.map(lambda u: jnp.where(keep, jnp.zeros_like(u), u), updates)
    new_params = optax.apply_updates(params, updates)
    return new_params, new_opt_state, keep, StepMetrics(loss, accuracy, nonfinite)

  batch_axis = 0 if per_member_batches else None
  batch_spec = P(MEMBER, DATA) if per_member_batches else P(DATA)
  if steps_per_call > 1:
    batch_spec = P(None, *batch_spec)
  members_update = over_members(
      member_update, member_parallelism, in_axes=(0, 0, 0, 0, batch_axis, batch_axis),
      map_batch_size=map_batch_size)

  def local_step(state, x, y, label_smoothing):
    def one_step(state, batch):
      params, opt_state, frozen, metrics = members_update(
          state.params, state.opt_state, state.frozen, label_smoothing, *batch)
      return TrainState(params, opt_state, frozen), metrics

    if steps_per_call == 1:
      return one_step(state, (x, y))
    return jax.lax.scan(one_step, state, (x, y))

  def traced(state, x, y, label_smoothing):
    step.traces += 1
    if label_smoothing is None:
      label_smoothing = jnp.zeros(state.frozen.shape, jnp.float32)
    metrics_spec = P(MEMBER) if steps_per_call == 1 else P(None, MEMBER)
    return jax.shard_map(
        local_step, mesh=mesh,
        in_specs=(P(MEMBER), batch_spec, batch_spec, P(MEMBER)),
        out_specs=(P(MEMBER), metrics_spec))(state, x, y, label_smoothing)

  step.fn = jax.jit(traced, donate_argnums=0)
  return step
