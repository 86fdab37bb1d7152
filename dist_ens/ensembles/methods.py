"""Ensemble methods beyond independent members (config.ensemble.method).

  'deep'       independent members (the default): each trained member predicts.
  'snapshot'   snapshot ensembles (Huang et al. 2017): each member's training is
               ensemble.snapshot.cycles restarts of config.optim.schedule, and the
               member's parameters and model state at the end of every cycle are kept;
               M x cycles snapshots predict.
  'batchensemble'  BatchEnsemble (Wen et al. 2020; dist_ens.ensembles.batchensemble): one
               shared weight per layer and rank-1 factors per member, members trained in
               one pass; its shared leaves are replicated over the mesh, not stacked.
  'mimo'       MIMO (Havasi et al. 2021; dist_ens.ensembles.mimo): each member is one
               network with ensemble.mimo.heads input slots and output heads, each head
               trained on its own shuffling of the batch; a member predicts as its heads'
               mean.
  'multiswag'  SWAG per member (Maddox et al. 2019; MultiSWAG, Wilson & Izmailov 2020):
               from ensemble.swag.start of training on, every ensemble.swag.every steps,
               a member's running mean and mean square of its weights and its last
               ensemble.swag.rank deviations from the mean are kept; ensemble.swag.samples
               weight samples per member predict.

A method is what each member collects while it trains and the members it adds to the
ensemble's prediction, as per-member functions that the train step vmaps like the
update (so they work on any mesh, and their state is checkpointed with the rest):

  init(params, model_state) -> collected
  collect(collected, params, model_state, step) -> collected   # after `step` steps
  members(collected, params, model_state, step, key) -> (params [K, ...], model_state
                                                         [K, ...], valid [K] bool)

`predictive_members` turns the stacked train state into the K*M members that predict.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dist_ens.core import rng
from dist_ens.core.hooks import MethodHooks
from dist_ens.ensembles import batchensemble, lora as lora_lib, own as own_lib
from dist_ens.errors import ConfigError
from dist_ens.parallel import mesh as mesh_lib

PyTree = Any
METHODS = ('deep', 'batchensemble', 'mimo', 'snapshot', 'multiswag')
# Methods whose members collect (snapshots, SWAG moments) and predict from it.
COLLECTING = ('snapshot', 'multiswag')
# Stream tag of SWAG's weight samples (training is 1, MC dropout 2).
_SWAG_STREAM = 3


class Method(NamedTuple):
  """An ensemble method's per-member functions (see the module doc)."""
  name: str
  init: Callable[[PyTree, PyTree], PyTree]
  collect: Callable[[PyTree, PyTree, PyTree, jax.Array], PyTree]
  members: Callable[..., tuple[PyTree, PyTree, jax.Array]]
  per_member: int  # K: predicting members per trained member
  cycles: int = 1  # learning-rate restarts (snapshot)
  cycles_from: int = 0  # the step the restarts begin at (snapshot.start: fast geometric)
  cycle_rate: float = 1.0  # each cycle's peak rate over optim.learning_rate's
  shares: bool = False  # params have leaves shared by all members (batchensemble)
  heads: int = 0  # input slots and output heads of each member's network (mimo)
  own: str = 'all'  # config.ensemble.own, as configured (ensembles/own.py)
  # The params leaves each member owns by name, the rest shared (with_owned); None: all.
  owned: frozenset[str] | None = None
  lora: Any = None  # own='lora': the adapted kernels, rank and scale (ensembles/lora.py)
  # config.ensemble.train_shared: the shared leaves train (summed gradient), not frozen.
  train_shared: bool = False

  @property
  def collects(self) -> bool:
    """Whether members collect anything while training (the step runs `collect`)."""
    return self.name in COLLECTING

  @property
  def hooks(self) -> MethodHooks:
    """What this method changes in core: how members are born, updated, collect."""
    if self.owned is not None:
      return own_lib.hooks(self.owned, self.lora, self.train_shared)
    if self.shares:
      return MethodHooks(init_params=batchensemble.from_members,
                         init_opt_state=batchensemble.init_opt_state,
                         members_update=batchensemble.members_update,
                         shared=batchensemble.is_shared)
    if self.collects:
      return MethodHooks(init_collected=self.init, collect=self.collect)
    return MethodHooks()


def _deep() -> Method:
  return Method('deep', init=lambda params, state: (),
                collect=lambda collected, params, state, step: collected,
                members=lambda collected, params, state, step, key: (
                    *jax.tree.map(lambda a: a[None], (params, state)), jnp.ones((1,), bool)),
                per_member=1)


def _batchensemble() -> Method:
  return _deep()._replace(name='batchensemble', shares=True)


def _snapshot(cycles: int, total_steps: int, start: int = 0, rate: float = 1.0) -> Method:
  """Snapshots at steps S + L, S + 2L, ..., S + cycles*L = total_steps, where the
  cycles begin at step S = `start` and L = (total_steps - S) / cycles."""
  length = (total_steps - start) // cycles

  def init(params, state):
    return jax.tree.map(lambda a: jnp.zeros((cycles, *a.shape), a.dtype), (params, state))

  def collect(collected, params, state, step):
    slot = (step - start) // length - 1

    def keep(buffers):
      return jax.tree.map(lambda buf, a: buf.at[slot].set(a), buffers, (params, state))

    # `step` is the same for every member (unbatched under vmap): a real branch.
    due = (step > start) & ((step - start) % length == 0)
    return jax.lax.cond(due, keep, lambda b: b, collected)

  def members(collected, params, state, step, key):
    del params, state, key
    filled = start + (jnp.arange(cycles) + 1) * length <= step
    return (*collected, filled)

  return Method('snapshot', init, collect, members, per_member=cycles, cycles=cycles,
                cycles_from=start, cycle_rate=rate)


def swag_steps(start: int, every: int, total_steps: int) -> list[int]:
  """The steps (counted after the update) at which SWAG collects the weights."""
  return [s for s in range(max(start, 1), total_steps + 1) if (s - start) % every == 0]


def _swag(start: int, every: int, rank: int, samples: int) -> Method:
  """First and second moments and the last `rank` deviations, from step `start` on."""

  def init(params, state):
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    return {'n': jnp.zeros((), jnp.int32), 'mean': zeros(params), 'sq_mean': zeros(params),
            'deviations': jax.tree.map(lambda a: jnp.zeros((rank, *a.shape), a.dtype), params),
            'state_mean': zeros(state)}

  def collect(collected, params, state, step):
    def add(c):
      n = c['n'] + 1
      mix = lambda old, new: old + (new - old) / n.astype(old.dtype)
      mean = jax.tree.map(mix, c['mean'], params)
      out = {'n': n, 'mean': mean,
             'sq_mean': jax.tree.map(lambda old, p: mix(old, p * p), c['sq_mean'], params),
             'state_mean': jax.tree.map(mix, c['state_mean'], state), 'deviations':
                 c['deviations']}
      if rank:
        out['deviations'] = jax.tree.map(lambda d, p, m: d.at[(n - 1) % rank].set(p - m),
                                         c['deviations'], params, mean)
      return out

    due = (step >= max(start, 1)) & ((step - start) % every == 0)
    return jax.lax.cond(due, add, lambda c: c, collected)

  def members(collected, params, state, step, key):
    del params, state, step
    sampled = jax.vmap(lambda k: swag_sample(collected, rank, jax.random.fold_in(key, k)))(
        jnp.arange(samples, dtype=jnp.uint32))
    model_state = jax.tree.map(lambda a: jnp.broadcast_to(a, (samples, *a.shape)),
                               collected['state_mean'])
    return sampled, model_state, jnp.broadcast_to(collected['n'] > 0, (samples,))

  return Method('multiswag', init, collect, members, per_member=samples)


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


class MethodSpec(NamedTuple):
  """config.ensemble's method fields (configs/default.py documents each), with what of
  the rest of the config a method depends on."""
  name: str  # ensemble.method
  total_steps: int  # train.steps
  restartable_schedule: bool  # optim.schedule != 'constant' or optim.warmup_steps > 0
  reproducible: bool  # config.reproducible
  snapshot_cycles: int
  snapshot_start: float
  snapshot_cycle_rate: float
  mimo_heads: int
  swag_start: float
  swag_every: int
  swag_rank: int
  swag_samples: int
  own: Any  # ensemble.own
  lora_rank: Any = 8  # ensemble.lora_rank, lora_alpha, lora_targets (own='lora')
  lora_alpha: Any = 0.0
  lora_targets: Any = ''
  train_shared: Any = False  # ensemble.train_shared


def _int(value: Any, field: str, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ConfigError(f'config.ensemble.{field}={value!r} must be an int >= {low}.')
  return value


def _fraction(value: Any, field: str, example: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
    raise ConfigError(f'config.ensemble.{field}={value!r} must be a fraction of train.steps in '
                      f'[0, 1), e.g. {example}.')
  return value


def _snapshot_from_spec(spec: MethodSpec) -> Method:
  """Snapshot ensembles; with snapshot.start > 0, fast geometric ensembling."""
  cycles, steps = _int(spec.snapshot_cycles, 'snapshot.cycles', 1), spec.total_steps
  start = round(_fraction(spec.snapshot_start, 'snapshot.start', '0.8') * steps)
  rate = spec.snapshot_cycle_rate
  if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0:
    raise ConfigError(f'config.ensemble.snapshot.cycle_rate={rate!r} must be a number > 0, the '
                      "cycles' peak learning rate over optim.learning_rate (e.g. 0.05).")
  if (steps - start) % cycles:
    raise ConfigError(f'config.ensemble.snapshot.cycles={cycles} must divide the '
                      f'{steps - start} steps from snapshot.start on (train.steps={steps}; '
                      'every cycle is as long); change train.steps, snapshot.start or cycles.')
  if not spec.restartable_schedule:
    raise ConfigError("config.ensemble.method='snapshot' restarts config.optim.schedule every "
                      "cycle, and 'constant' has nothing to restart: use schedule='cosine' "
                      '(as Huang et al. 2017).')
  return _snapshot(cycles, steps, start, float(rate))


def _swag_from_spec(spec: MethodSpec) -> Method:
  start_fraction = _fraction(spec.swag_start, 'swag.start', '0.75')
  every, rank = _int(spec.swag_every, 'swag.every', 1), _int(spec.swag_rank, 'swag.rank', 0)
  samples = _int(spec.swag_samples, 'swag.samples', 1)
  start, steps = round(start_fraction * spec.total_steps), spec.total_steps
  if len(swag_steps(start, every, steps)) < 2:
    raise ConfigError(f'config.ensemble.swag: start={start_fraction} and every={every} collect '
                      f'fewer than 2 weight iterates in train.steps={steps}; lower swag.every '
                      'or swag.start.')
  return _swag(start, every, rank, samples)


def from_spec(spec: MethodSpec) -> Method:
  """The method spec.name names, its fields checked against the run's steps.

  Raises:
    ConfigError: naming the field and what would work.
  """
  if spec.name not in METHODS:
    raise ConfigError(f'config.ensemble.method={spec.name!r}; use one of {METHODS}.')
  spec = _resolve_own(spec)
  name = spec.name
  if name == 'deep':
    lora = (spec.lora_rank, spec.lora_alpha, spec.lora_targets) if spec.own == 'lora' else None
    return _deep()._replace(own=spec.own, lora=lora, train_shared=spec.train_shared)
  if name in ('batchensemble', 'mimo') and spec.reproducible:
    why = {'batchensemble': "the shared weights' gradient is a sum over devices, whose order "
                            'depends on the mesh',
           'mimo': "the heads' shuffles of a batch split over 'data' depend on the mesh"}[name]
    raise ConfigError(f"config.reproducible=True with config.ensemble.method={name!r}: {why}; "
                      'use reproducible=False.')
  if name == 'batchensemble':
    return _batchensemble()
  if name == 'mimo':
    return _deep()._replace(name='mimo', heads=_int(spec.mimo_heads, 'mimo.heads', 2))
  if name == 'snapshot':
    return _snapshot_from_spec(spec)
  return _swag_from_spec(spec)


def _resolve_own(spec: MethodSpec) -> MethodSpec:
  """`spec` with own='batchensemble' read as method='batchensemble' (one implementation,
  the same run), and ensemble.own and ensemble.train_shared checked against the method.

  Raises:
    ConfigError: a combination that means nothing, naming the field.
  """
  own, name, train_shared = spec.own, spec.name, spec.train_shared
  if not isinstance(train_shared, bool):
    raise ConfigError(f'config.ensemble.train_shared={train_shared!r} must be True or False.')
  if train_shared and own in ('all', 'batchensemble'):
    why = ('every leaf is each member\'s own, none is shared' if own == 'all' else
           "BatchEnsemble's shared W always trains, by the members' mean gradient")
    raise ConfigError(f'config.ensemble.train_shared=True with ensemble.own={own!r}: {why}; '
                      "set train_shared=False, or own='head', 'lora' or a regex.")
  if train_shared and spec.reproducible:
    raise ConfigError('config.ensemble.train_shared=True with config.reproducible=True: the '
                      "shared leaves' gradient is a sum over devices, whose order depends on "
                      'the mesh; use reproducible=False or train_shared=False.')
  if own == 'batchensemble':
    if name not in ('deep', 'batchensemble'):
      raise ConfigError(f"config.ensemble.own='batchensemble' is method='batchensemble'; it "
                        f"works with ensemble.method='deep' (not {name!r}).")
    return spec._replace(name='batchensemble', own='all')
  if own != 'all' and name != 'deep':
    raise ConfigError(f"config.ensemble.own={own!r} shares every other leaf between "
                      f"members; it works with ensemble.method='deep' (not {name!r}), or "
                      "set own='all'.")
  return spec


def with_owned(method: Method, params: PyTree, num_outputs: int) -> Method:
  """`method` with the leaves its members own resolved on the model's `params` (one
  member's shapes): config.ensemble.own other than 'all' shares the rest.

  Raises:
    ConfigError: an `own` that names no leaf or every leaf (ensembles/own.py).
  """
  owned = own_lib.owned_names(method.own, params, num_outputs)
  if owned is None:
    return method
  lora = None if method.lora is None else lora_lib.resolve(params, owned, *method.lora)
  return method._replace(shares=True, owned=owned, lora=lora)


class Members(NamedTuple):
  """The members that predict, stacked [M * K, ...] over 'member' (evaluation reads
  .params, .model_state and .frozen, as of a TrainState)."""
  params: PyTree
  model_state: PyTree
  frozen: jax.Array  # [M * K] bool: a frozen member's, or not collected yet


def predictive_members(method: Method, state: Any, seed: int, mesh: Mesh) -> Members:
  """The K predicting members of every trained member, member m's at rows m*K..m*K+K-1.

  Random draws (SWAG's weight samples) come from (seed, member, k): the same on any mesh.
  """
  if method.per_member == 1 and not method.collects:
    # The trained members, their params as stored (a shared leaf once): read them with
    # ensembles.stored.predicting_model(method, model).
    return Members(state.params, state.model_state, state.frozen)
  num_members = state.frozen.shape[0]

  def expand(collected, params, model_state, frozen, step):
    keys = jax.vmap(lambda k: jax.random.fold_in(k, _SWAG_STREAM))(
        rng.member_keys(seed, jnp.arange(num_members, dtype=jnp.uint32)))
    p, s, valid = jax.vmap(method.members, in_axes=(0, 0, 0, None, 0))(
        collected, params, model_state, step, keys)
    flat = lambda tree: jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), tree)
    return Members(flat(p), flat(s), jnp.repeat(frozen, method.per_member) | ~flat(valid))

  sharding = mesh_lib.member_sharding(mesh)
  return jax.jit(expand, out_shardings=sharding)(
      state.method_state, state.params, state.model_state, state.frozen, state.step)
