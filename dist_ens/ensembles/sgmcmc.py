"""Cyclical SG-MCMC (Zhang et al. 2020; config.ensemble.method='sgmcmc'): each member is
a chain of SGLD or SGHMC (ensemble.sgmcmc.sampler) under the paper's cyclical cosine
step size over ensemble.sgmcmc.cycles cycles; the first `beta` of every cycle explores
(no noise), the rest samples (Langevin noise), and the params at samples_per_cycle
evenly spaced steps ending each cycle's sampling phase are kept: M x cycles x
samples_per_cycle samples predict.

Conventions. dist_ens's loss L is a mean over the batch, so with N = sgmcmc.data_size
the potential is U = N L (plus weight decay's Gaussian prior) and the paper's step size
is alpha_k = lr_k / N, lr_k = optim.learning_rate * (cos(pi mod(k-1, K/cycles) /
(K/cycles)) + 1) / 2 (K = train.steps). The sampler is this method's own SGD (the run's
optim.name, momentum and schedule do not apply; learning_rate and weight_decay do, per
member):
  SGLD   theta <- theta - lr_k (g + xi_g)
  SGHMC  v <- (1 - a) v + g + xi_g, theta <- theta - lr_k v    (a = sgmcmc.friction)
with g the loss's gradient and, in the sampling phase, xi_g ~ N(0, 2 a T / (lr_k N))
(a = 1 for SGLD, T = sgmcmc.temperature): the paper's theta noise sqrt(2 alpha_k T) =
sqrt(2 lr_k T / N) for SGLD and its momentum noise sqrt(2 a alpha_k T) for SGHMC (its
v is -lr_k times ours). The noise is drawn from (seed, member id, step): member m's chain
is the same whatever num_members, and a resumed run draws what it would have.
"""

import jax
import jax.numpy as jnp
import optax

from dist_ens.core import rng
from dist_ens.core.hooks import MethodHooks
from dist_ens.core.optim import DECAY_MASKS, Optimizer, OptimSpec
from dist_ens.core.step import over_members, update_axes
from dist_ens.ensembles.method import Method, MethodSpec, int_field, scale_field
from dist_ens.errors import ConfigError


# config.ensemble.sgmcmc: this method's fields, each one's meaning in the comments above
# or beside it (dist_ens/config/schema.py reads them; docs/config.md shows them).
FIELDS = dict(
    sampler='sghmc',  # 'sgld' or 'sghmc'
    cycles=4,  # must divide train.steps
    # In [0, 1): the share of each cycle that explores (no noise); the rest samples
    beta=0.8,
    # Samples kept per cycle, evenly spaced over its sampling phase, the last at its end
    samples_per_cycle=3,
    temperature=1.0,  # T >= 0 (1: the posterior; 0: no noise)
    friction=0.1,  # sghmc: in (0, 1], its momentum 1 - friction
    # N, the training set's size (an int >= 1; the loss is a mean, the posterior's sum)
    data_size=0,
)

FIELD = 'config.ensemble.sgmcmc'
SAMPLERS = ('sgld', 'sghmc')
_NOISE_STREAM = 0x5347  # folded into the member's training key: the Langevin noise's own


def rate(count, total_steps: int, cycles: int):
  """alpha_k / alpha_0 at update `count` = k - 1: (cos(pi mod(k-1, L) / L) + 1) / 2."""
  length = total_steps // cycles
  return 0.5 * (jnp.cos(jnp.pi * (count % length) / length) + 1.0)


def first_sampling(total_steps: int, cycles: int, beta: float) -> int:
  """The first offset r in a cycle whose update samples: the least r with r / L >= beta."""
  length = total_steps // cycles
  return next((r for r in range(length) if r / length >= beta), length)


def sampling(count, total_steps: int, cycles: int, beta: float):
  """Whether update `count` (k - 1) adds noise: mod(k-1, L) / L >= beta."""
  return count % (total_steps // cycles) >= first_sampling(total_steps, cycles, beta)


def spacing(total_steps: int, cycles: int, beta: float, per_cycle: int) -> int:
  """Steps between a cycle's samples: its sampling updates shared evenly."""
  length = total_steps // cycles
  return (length - first_sampling(total_steps, cycles, beta)) // per_cycle


def sample_steps(total_steps: int, cycles: int, beta: float, per_cycle: int) -> list[int]:
  """The steps (counted after the update) whose params are kept, in slot order: in each
  cycle, every `spacing` steps back from its last."""
  length, gap = total_steps // cycles, spacing(total_steps, cycles, beta, per_cycle)
  return [(j + 1) * length - i * gap for j in range(cycles) for i in reversed(range(per_cycle))]


def noise_std(lr, friction: float, temperature: float, data_size: int):
  """The gradient noise's standard deviation, sqrt(2 a T / (lr N))."""
  return jnp.sqrt(2.0 * friction * temperature / (lr * data_size))


def _member_value(hp, spec: OptimSpec, field: str):
  key = f'optim.{field}'
  if hp is not None and key in hp:
    return hp[key]
  value = getattr(spec, field)
  if not isinstance(value, (int, float)):
    raise ValueError(f'config.optim.{field} holds per-member values; pass this member\'s '
                     f'hyperparameters (with {key!r}) to the optimizer.')
  return value


def sampler(optim: OptimSpec, total_steps: int, cycles: int, friction: float | None) -> Optimizer:
  """optimizer(hp) for ONE member: (momentum 1 - friction, SGHMC) -> decoupled weight
  decay (the Gaussian prior) -> the member's learning rate x the cyclical cosine."""
  for field, value in (('grad_clip_norm', optim.grad_clip_norm),
                       ('warmup_steps', optim.warmup_steps)):
    if value:
      raise ConfigError(f"config.optim.{field}={value!r} with ensemble.method='sgmcmc': the "
                        "sampler's step size is the paper's cyclical cosine and its noise is "
                        f'not clipped; set optim.{field}=0.')
  mask = DECAY_MASKS[optim.decay_mask] if optim.decay_mask in DECAY_MASKS else None
  if mask is None:
    raise ConfigError(f'config.optim.decay_mask={optim.decay_mask!r}; use one of '
                      f'{sorted(DECAY_MASKS)}.')

  def optimizer(hp=None) -> optax.GradientTransformation:
    parts = [] if friction is None else [optax.trace(1.0 - friction)]
    return optax.chain(*parts,
                       optax.add_decayed_weights(_member_value(hp, optim, 'weight_decay'), mask),
                       optax.scale_by_learning_rate(_member_value(hp, optim, 'learning_rate')),
                       optax.scale_by_schedule(lambda c: rate(c, total_steps, cycles)))

  return optimizer


def make(spec: MethodSpec) -> Method:
  """Cyclical SGLD/SGHMC chains from config.ensemble.sgmcmc (sampler, cycles, beta,
  samples_per_cycle, temperature, friction, data_size)."""
  options, steps = spec.options, spec.total_steps
  kind = options['sampler']
  if kind not in SAMPLERS:
    raise ConfigError(f'{FIELD}.sampler={kind!r}; use one of {SAMPLERS}.')
  cycles = int_field(options['cycles'], 'sgmcmc.cycles', 1)
  per_cycle = int_field(options['samples_per_cycle'], 'sgmcmc.samples_per_cycle', 1)
  data_size = options['data_size']
  if isinstance(data_size, bool) or not isinstance(data_size, int) or data_size < 1:
    raise ConfigError(f'{FIELD}.data_size={data_size!r} must be the training set\'s size N '
                      '(an int >= 1; the loss is a mean, the posterior\'s gradient N times it), '
                      'e.g. 50000 for CIFAR-10.')
  temperature = scale_field(options['temperature'], 'sgmcmc.temperature', '1.0')
  beta = options['beta']
  if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
    raise ConfigError(f'{FIELD}.beta={beta!r} must be in [0, 1): the share of each cycle that '
                      'explores before sampling, e.g. 0.8.')
  friction = options['friction']
  if kind == 'sghmc' and (isinstance(friction, bool) or not isinstance(friction, (int, float))
                          or not 0 < friction <= 1):
    raise ConfigError(f'{FIELD}.friction={friction!r} must be in (0, 1] (SGHMC\'s momentum is '
                      '1 - friction), e.g. 0.1.')
  if steps % cycles:
    raise ConfigError(f'{FIELD}.cycles={cycles} must divide train.steps={steps} (every cycle '
                      'is as long); change train.steps or cycles.')
  if spacing(steps, cycles, beta, per_cycle) < 1:
    raise ConfigError(f'{FIELD}.samples_per_cycle={per_cycle} exceeds the '
                      f'{steps // cycles - first_sampling(steps, cycles, beta)} sampling steps of '
                      f'each cycle (train.steps={steps}, cycles={cycles}, beta={beta}); lower '
                      'it or beta.')
  return chains(kind, steps, cycles, float(beta), per_cycle, temperature,
                1.0 if kind == 'sgld' else float(friction), data_size, spec.seed)


def chains(kind: str, steps: int, cycles: int, beta: float, per_cycle: int, temperature: float,
           friction: float, data_size: int, seed: int) -> Method:
  """The Method: its sampler, noise, and the kept samples (sample_steps)."""
  length, gap = steps // cycles, spacing(steps, cycles, beta, per_cycle)
  kept = sample_steps(steps, cycles, beta, per_cycle)
  slots = cycles * per_cycle

  def init(params, state):
    return jax.tree.map(lambda a: jnp.zeros((slots, *a.shape), a.dtype), (params, state))

  def collect(collected, params, state, step):
    cycle, back = (step - 1) // length, (length - (step - 1) % length - 1)
    slot = cycle * per_cycle + per_cycle - 1 - back // gap
    due = (step >= 1) & (back % gap == 0) & (back // gap < per_cycle)

    def keep(buffers):
      return jax.tree.map(lambda buf, a: buf.at[slot].set(a), buffers, (params, state))

    return jax.lax.cond(due, keep, lambda b: b, collected)

  def members(collected, params, state, step, key):
    del params, state, key
    return (*collected, jnp.asarray(kept) <= step)

  def noisy(grads, hp, member_id, step):
    lr = hp['optim.learning_rate'] * rate(step, steps, cycles)
    std = jnp.where(sampling(step, steps, cycles, beta),
                    noise_std(lr, friction, temperature, data_size), 0.0)
    key = jax.random.fold_in(rng.train_key(seed, member_id, step), _NOISE_STREAM)
    leaves, treedef = jax.tree.flatten(grads)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten([g + (std * jax.random.normal(k, g.shape)).astype(g.dtype)
                              for g, k in zip(leaves, keys)])

  def members_update(results, apply, optimizer, parallelism, batch_axis, map_batch_size=None):
    del optimizer

    def one(member, hp, member_id, step, batch):
      result = results(member.params, member.model_state, hp, member_id, step, batch)
      return apply(member, hp, result._replace(grads=noisy(result.grads, hp, member_id, step)))

    return over_members(one, parallelism, in_axes=update_axes(batch_axis),
                        map_batch_size=map_batch_size, in_place=1)

  def optimizer(optim: OptimSpec, total_steps: int) -> Optimizer:
    return sampler(optim, total_steps, cycles, None if kind == 'sgld' else friction)

  return Method('sgmcmc', hooks=MethodHooks(init_collected=init, collect=collect,
                                            members_update=members_update),
                members=members, per_member=slots, scales_with_steps=True,
                optimizer=optimizer)
