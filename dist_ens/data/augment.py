"""On-device data augmentation: pure, jit-able transforms of one example.

An augmentation is `fn(key, x) -> x'` for ONE example x ([H, W, C] images or
[L, C] signals), returning the same shape and dtype. `augment_batch` vmaps it over
a batch; under dist_ens's member vmap it runs on each member's batch.

Each example's key comes only from (seed, member, step, example index), see
`example_keys`, never from its position in a batch, a shard or a chunk of members:
the same run draws the same crops and flips on any mesh, batch layout or number of
members trained at once.

Example:
  >>> keys = example_keys(seed=0, member=2, step=100, example_index=jnp.arange(8))
  >>> x_aug = augment_batch(x, keys)          # x: [8, 32, 32, 3]
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from dist_ens.errors import ConfigError

Augmentation = Callable[[jax.Array, jax.Array], jax.Array]

# Folded into the seed first, so augmentation keys never coincide with keys that
# other parts of dist_ens derive from the same seed (ASCII 'aug').
_AUGMENT_STREAM = 0x617567


def example_keys(seed: int | jax.Array, member: int | jax.Array, step: int | jax.Array,
                 example_index: int | jax.Array) -> jax.Array:
  """PRNG keys of examples, one per entry of `example_index` (same shape).

  Args:
    seed: the run's seed.
    member: the ensemble member (a traced scalar under vmap over members is fine).
    step: the training step.
    example_index: the examples' global indices (their index in the training set,
      or anything else that does not depend on how the batch is laid out).

  Returns:
    Typed PRNG keys of example_index's shape, each
    fold_in(fold_in(fold_in(fold_in(key(seed), stream), member), step), index).
  """
  key = jax.random.fold_in(jax.random.key(seed), _AUGMENT_STREAM)
  key = jax.random.fold_in(jax.random.fold_in(key, member), step)
  index = jnp.asarray(example_index)
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(index.reshape(-1))
  return keys.reshape(index.shape)


def identity(key: jax.Array, x: jax.Array) -> jax.Array:
  """No augmentation."""
  del key
  return x


def crop_flip(key: jax.Array, x: jax.Array, padding: int = 4,
              flip: bool | None = None) -> jax.Array:
  """Random crop of the zero-padded example, then a mirror with probability 0.5.

  The standard CIFAR augmentation: pad every spatial side by `padding` zeros (zero
  in the units of x: the mean colour if x is standardised), take a window of x's
  size at a uniform offset in [0, 2 * padding] per axis.

  Args:
    key: this example's PRNG key.
    x: one example, [H, W, C] or [L, C].
    padding: zeros added on each side of every spatial axis.
    flip: mirror with probability 0.5 (width for images, length for signals). The
      default None flips images only: reversing a 1-D signal (MNIST-1D) is not
      label-preserving in general, so 1-D inputs get the shift-crop alone.

  Returns:
    The augmented example, x's shape and dtype.
  """
  rank = x.ndim - 1
  if rank not in (1, 2):
    raise ValueError(f'crop_flip takes one example [H, W, C] or [L, C]; got shape {x.shape}.')
  crop_key, flip_key = jax.random.split(key)
  offsets = jax.random.randint(crop_key, (rank,), 0, 2 * padding + 1)
  padded = jnp.pad(x, [(padding, padding)] * rank + [(0, 0)])
  out = jax.lax.dynamic_slice(padded, (*offsets, jnp.zeros((), offsets.dtype)), x.shape)
  if rank == 2 if flip is None else flip:
    out = jnp.where(jax.random.bernoulli(flip_key), jnp.flip(out, axis=rank - 1), out)
  return out


# name -> augmentation of one example; a user's own fn(key, x) -> x needs no entry.
AUGMENTATIONS: dict[str, Augmentation] = {
    'none': identity,
    'crop_flip': crop_flip,
}


def get_augmentation(spec: str | Augmentation,
                     field: str = 'config.data.augment') -> Augmentation:
  """The augmentation a config names: a key of AUGMENTATIONS or a callable fn(key, x) -> x.

  `field` names the config field in the error for an unknown name.
  """
  if callable(spec):
    return spec
  if spec not in AUGMENTATIONS:
    raise ConfigError(f'{field}={spec!r} is not a known augmentation; use one of '
                      f'{sorted(AUGMENTATIONS)} or a function fn(key, x_example) -> x_example.')
  return AUGMENTATIONS[spec]


def member_augmentation(fn: Augmentation, seed: int) -> Callable[..., jax.Array]:
  """augment(x [B, ...], member, step, index [B]) -> x: `fn` on every example with its key
  from (seed, member, step, example index) (example_keys), as the train step calls it."""

  def augment(x, member, step, index):
    return augment_batch(x, example_keys(seed, member, step, index), fn)

  return augment


def augment_batch(x: jax.Array, keys: jax.Array, fn: Augmentation = crop_flip) -> jax.Array:
  """fn applied to every example of x [B, ...] with its key from keys [B].

  Checks, while tracing, that fn keeps an example's shape and dtype.
  """
  if keys.shape != x.shape[:1]:
    raise ValueError(f'augment_batch needs one key per example: keys {keys.shape}, '
                     f'batch {x.shape}.')
  one = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  out = jax.eval_shape(lambda k, e: fn(k[0], e), keys, one)
  if (out.shape, out.dtype) != (one.shape, one.dtype):
    raise ValueError(f'augmentation {getattr(fn, "__name__", fn)!r} must keep an example\'s '
                     f'shape and dtype {one.shape} {one.dtype}; it returned {out.shape} '
                     f'{out.dtype}.')
  return jax.vmap(fn)(keys, x)
