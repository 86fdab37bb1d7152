"""Distilling an ensemble's predictive into a student (Hinton et al. 2015; Hydra, Tran et
al. 2020): the objective and the student's training loop, on one device.

Soft targets at temperature T from the K distilled members' logits l_k:
  one head (H = 1):  p = mean_k softmax(l_k / T), the ensemble's tempered predictive
  H = K heads:       p_h = softmax(l_h / T), head h matched to member h
The loss is T^2 * mean over heads and examples of KL(p_h || softmax(s_h / T)), s_h the
student's logits: the T^2 keeps the gradients' scale as T changes (Hinton et al.).
It equals the cross-entropy to the soft targets minus their entropy, so the gradient is
the soft cross-entropy's and the loss goes to 0 at a perfect match.
"""

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dist_ens.ensembles.students import StudentNet


class DistillSpec(NamedTuple):
  """config.distill (configs/default.py says what each field means)."""
  student: str
  steps: int
  temperature: float
  learning_rate: float
  batch_size: int  # resolved: data.batch_size where distill.batch_size is 0


def soft_targets(teacher_logits: jax.Array, temperature: float, num_heads: int) -> jax.Array:
  """[H, B, C] targets from the members' [K, B, C] logits (see the module doc)."""
  member = jax.nn.softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
  if num_heads == 1:
    return jnp.mean(member, axis=0, keepdims=True)
  return member


def distill_loss(student_logits: jax.Array, targets: jax.Array, temperature: float
                 ) -> jax.Array:
  """T^2 * mean KL(targets || softmax(student_logits / T)) over heads and examples."""
  log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  log_p = jnp.where(targets > 0, jnp.log(jnp.where(targets > 0, targets, 1.0)), 0.0)
  kl = jnp.sum(targets * (log_p - log_q), axis=-1)
  return temperature ** 2 * jnp.mean(kl)


def make_update(net: StudentNet, spec: DistillSpec,
                optimizer: optax.GradientTransformation) -> Callable[..., Any]:
  """(params, state, opt_state, x, teacher_logits [K, B, C], rng) -> (params, state,
  opt_state, loss), jitted."""
  def loss_fn(params, state, x, teacher, rng):
    logits, state = net.heads(params, state, x, train=True, rng=rng)
    targets = soft_targets(teacher, spec.temperature, net.num_heads)
    return distill_loss(logits, targets, spec.temperature), state

  @jax.jit
  def update(params, state, opt_state, x, teacher, rng):
    (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, x,
                                                                     teacher, rng)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), state, opt_state, loss

  return update


def batch_indices(num_examples: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
  """Endless batches of training indices: epoch after epoch of permutations drawn from
  (seed, the stream of distillation), each batch sorted (sources read in order)."""
  rng = np.random.default_rng([seed, 0xD157])
  while True:
    order = rng.permutation(num_examples)
    for start in range(0, num_examples - batch_size + 1, batch_size):
      yield np.sort(order[start:start + batch_size])


def train_student(net: StudentNet, spec: DistillSpec, key: jax.Array, seed: int,
                  read_x: Callable[[np.ndarray], np.ndarray], teacher_logits: np.ndarray
                  ) -> tuple[Any, Any, np.ndarray]:
  """(params, state, [steps] losses) of the student after spec.steps Adam steps on
  batches of the training split, `read_x(indices)` its inputs, `teacher_logits`
  [K, N, C] the distilled members' logits on all of it."""
  num_examples = teacher_logits.shape[1]
  batch = min(spec.batch_size, num_examples)
  indices = batch_indices(num_examples, batch, seed)
  first = next(indices)
  params, state = net.init(key, jnp.asarray(read_x(first)))
  optimizer = optax.adam(spec.learning_rate)
  opt_state, update = optimizer.init(params), make_update(net, spec, optimizer)
  dropout_key, losses = jax.random.fold_in(key, 1), []
  for step in range(spec.steps):
    idx = first if step == 0 else next(indices)
    params, state, opt_state, loss = update(
        params, state, opt_state, jnp.asarray(read_x(idx)),
        jnp.asarray(teacher_logits[:, idx]), jax.random.fold_in(dropout_key, step))
    losses.append(loss)
  return params, state, np.asarray(jax.device_get(losses), np.float64)
