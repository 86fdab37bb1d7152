"""MultiSWAG (config.ensemble.method='multiswag'): SWAG per member (Maddox et al. 2019;
MultiSWAG, Wilson & Izmailov 2020). From ensemble.swag.start of training on, every
ensemble.swag.every steps, a member's running mean and mean square of its weights and
its last ensemble.swag.rank deviations from the mean are kept; ensemble.swag.samples
weight samples per member predict."""

import jax
import jax.numpy as jnp

from dist_ens.core.hooks import MethodHooks
from dist_ens.errors import ConfigError
from dist_ens.ensembles.method import Method, MethodSpec, PyTree, fraction_field, int_field


# config.ensemble.swag: this method's fields, each one's meaning in the comments above
# or beside it (dist_ens/config/schema.py reads them; docs/config.md shows them).
FIELDS = dict(
    start=0.75,  # collect from this fraction of train.steps on,
    every=10,  # every this many steps
    rank=10,  # deviations kept for the low-rank covariance (0: diagonal)
    samples=8,  # weight samples per member at evaluation
)


def swag_steps(start: int, every: int, total_steps: int) -> list[int]:
  """The steps (counted after the update) at which SWAG collects the weights."""
  return [s for s in range(max(start, 1), total_steps + 1) if (s - start) % every == 0]


def _add(collected: PyTree, params: PyTree, state: PyTree, rank: int) -> PyTree:
  """The moments and deviations with one more iterate."""
  n = collected['n'] + 1
  mix = lambda old, new: old + (new - old) / n.astype(old.dtype)
  mean = jax.tree.map(mix, collected['mean'], params)
  out = {'n': n, 'mean': mean,
         'sq_mean': jax.tree.map(lambda old, p: mix(old, p * p), collected['sq_mean'], params),
         'state_mean': jax.tree.map(mix, collected['state_mean'], state),
         'deviations': collected['deviations']}
  if rank:
    out['deviations'] = jax.tree.map(lambda d, p, m: d.at[(n - 1) % rank].set(p - m),
                                     collected['deviations'], params, mean)
  return out


def swag(start: int, every: int, rank: int, samples: int) -> Method:
  """First and second moments and the last `rank` deviations, from step `start` on."""

  def init(params, state):
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    return {'n': jnp.zeros((), jnp.int32), 'mean': zeros(params), 'sq_mean': zeros(params),
            'deviations': jax.tree.map(lambda a: jnp.zeros((rank, *a.shape), a.dtype), params),
            'state_mean': zeros(state)}

  def collect(collected, params, state, step):
    due = (step >= max(start, 1)) & ((step - start) % every == 0)
    return jax.lax.cond(due, lambda c: _add(c, params, state, rank), lambda c: c, collected)

  def members(collected, params, state, step, key):
    del params, state, step
    sampled = jax.vmap(lambda k: swag_sample(collected, rank, jax.random.fold_in(key, k)))(
        jnp.arange(samples, dtype=jnp.uint32))
    model_state = jax.tree.map(lambda a: jnp.broadcast_to(a, (samples, *a.shape)),
                               collected['state_mean'])
    return sampled, model_state, jnp.broadcast_to(collected['n'] > 0, (samples,))

  return Method('multiswag', hooks=MethodHooks(init_collected=init, collect=collect),
                members=members, per_member=samples, scales_with_steps=True)


def swag_sample(collected: PyTree, rank: int, key: jax.Array) -> PyTree:
  """One weight sample: mean + diag(var)^(1/2) z1 / sqrt(2) + D z2 / sqrt(2 (R - 1)),
  R the deviations kept so far (Maddox et al. 2019, eq. 1; no low-rank term for R < 2)."""
  leaves, treedef = jax.tree.flatten(collected['mean'])
  keys = jax.random.split(jax.random.fold_in(key, 0), len(leaves))
  mean_sq = jax.tree.leaves(collected['sq_mean'])
  diag = [m + jnp.sqrt(jnp.maximum(s - m * m, 0.0) / 2) * jax.random.normal(k, m.shape, m.dtype)
          for m, s, k in zip(leaves, mean_sq, keys)]
  kept = jnp.minimum(collected['n'], rank)
  if rank < 2:
    return treedef.unflatten(diag)
  z = jax.random.normal(jax.random.fold_in(key, 1), (rank,)) * (jnp.arange(rank) < kept)
  scale = jnp.where(kept >= 2, 1.0 / jnp.sqrt(2.0 * jnp.maximum(kept - 1, 1)), 0.0)
  low_rank = [jnp.tensordot(z, d, axes=1) * scale
              for d in jax.tree.leaves(collected['deviations'])]
  return treedef.unflatten([a + b.astype(a.dtype) for a, b in zip(diag, low_rank)])


def make(spec: MethodSpec) -> Method:
  """MultiSWAG from config.ensemble.swag (start, every, rank, samples)."""
  options = spec.options
  start_fraction = fraction_field(options['start'], 'swag.start', '0.75')
  every, rank = int_field(options['every'], 'swag.every', 1), int_field(options['rank'],
                                                                         'swag.rank', 0)
  samples = int_field(options['samples'], 'swag.samples', 1)
  start, steps = round(start_fraction * spec.total_steps), spec.total_steps
  if len(swag_steps(start, every, steps)) < 2:
    raise ConfigError(f'config.ensemble.swag: start={start_fraction} and every={every} collect '
                      f'fewer than 2 weight iterates in train.steps={steps}; lower swag.every '
                      'or swag.start.')
  return swag(start, every, rank, samples)
