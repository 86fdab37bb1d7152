"""MIMO (Havasi et al. 2021): one network with H input slots and H output heads.

`wrap` turns the model dist_ens builds for num_classes * H outputs into one whose
input is H examples side by side on the channel (last) axis and whose output is H
heads of num_classes logits:

  training    head h sees its own shuffled copy of the member's batch: slot h holds
              the batch in the order of a random permutation drawn from the step's
              key (slot 0 in the batch's order), so the heads learn from independent
              pairings of examples. Each head's logits are put back in the batch's
              order, so the apply returns [B, H, C] aligned with the labels, and
              `head_loss` sums the loss over the heads.
  evaluation  every slot holds the same example; the apply returns the heads
              combined as the task combines members (Task.combine: classification's
              log of the heads' mean probability, [B, C]; regression's mixture): the
              MIMO network predicts as the ensemble of its heads, so it is one member
              of dist_ens's ensemble (num_members MIMO networks, each its own
              independent member).

The trained state is a member's ordinary params, stacked over 'member' as for any
model: any mesh, checkpoints and Ensemble.load work unchanged.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dist_ens.core.model import Model
from dist_ens.ensembles.method import Method, MethodSpec, int_field, refuse_reproducible
from dist_ens.errors import ConfigError
from dist_ens.tasks.task import Loss


# config.ensemble.mimo: this method's fields, each one's meaning in the comments above
# or beside it (dist_ens/config/schema.py reads them; docs/config.md shows them).
FIELDS = dict(
    heads=3,  # slots/heads per member network (Havasi et al. use 3)
)

# Stream tag of the heads' permutations within a step's key (dropout uses the key itself).
_PERMUTATION_STREAM = 17


def _tile(x: jax.Array, heads: int) -> jax.Array:
  return jnp.concatenate([x] * heads, axis=-1)


def wrap(model: Model, heads: int, combine: Callable[[jax.Array, jax.Array], jax.Array]
         ) -> Model:
  """The H-slot, H-head network of `model` (built with outputs * heads outputs);
  `combine` is the task's way to combine members (Task.combine), here the heads."""

  def init(rng, sample_x):
    return model.init(rng, _tile(sample_x, heads))

  def apply(params, state, x, *, train, rng=None):
    if not train:
      outputs, state = model.apply(params, state, _tile(x, heads), train=False, rng=rng)
      per_head = jnp.moveaxis(outputs.reshape(x.shape[0], heads, -1), 1, 0)  # [H, B, K]
      return combine(per_head, jnp.ones((heads,), bool)), state
    key = jax.random.fold_in(rng, _PERMUTATION_STREAM)
    perms = jnp.stack([jnp.arange(x.shape[0])] + [
        jax.random.permutation(jax.random.fold_in(key, h), x.shape[0]) for h in range(1, heads)])
    slots = jnp.concatenate([x[p] for p in perms], axis=-1)
    logits, state = model.apply(params, state, slots, train=True, rng=rng)
    logits = logits.reshape(x.shape[0], heads, -1)
    # Row i of head h predicts example perms[h, i]: scatter it back to row perms[h, i].
    inverse = jnp.argsort(perms, axis=1)
    return jnp.stack([logits[inverse[h], h] for h in range(heads)], axis=1), state

  return Model(init, apply)


def head_loss(loss: Loss) -> Loss:
  """The sum over heads of `loss` on each head's logits ([B, H, C]) and the labels."""

  def total(logits, labels, hparams):
    return sum(loss(logits[:, h], labels, hparams) for h in range(logits.shape[1]))

  return total


def make(spec: MethodSpec) -> Method:
  """MIMO from config.ensemble.mimo (heads): each member one network of `heads` input
  slots and output heads."""
  refuse_reproducible(spec, "the heads' shuffles of a batch split over 'data' depend on "
                            'the mesh')
  heads = int_field(spec.options['heads'], 'mimo.heads', 2)

  def wrap_model(model: Model, task: Any) -> Model:
    if task.combine is None:
      raise ConfigError(f"config.ensemble.method='mimo' combines its heads as the task "
                        f'combines members (Task.combine), which config.task={task.name!r} '
                        'does not give; use another method for this task.')
    if task.output_shape is not None:
      raise ConfigError(f"config.ensemble.method='mimo' splits the last axis of [batch, units] "
                        f'outputs into heads, and config.task={task.name!r} gives each '
                        'example outputs of another shape; use another method for this task.')
    return wrap(model, heads, task.combine)

  return Method('mimo', outputs_per_output=heads, wrap_model=wrap_model, wrap_loss=head_loss)
