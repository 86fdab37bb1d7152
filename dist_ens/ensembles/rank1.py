"""Rank-1 Bayesian neural nets (Dusenberry et al. 2020; config.ensemble.method='rank1'): one
shared weight per layer, and per member a distribution over rank-1 factors of it.

Every kernel W [..., in, out] of the model (core.model.is_kernel: the MLP's dense layers,
the CNN's and LeNet's convolutions and dense layers, the ResNets' stem, block and
projection convolutions and their head; the first and the output layer too, as the
paper's rank-1 layers are every layer: uncertainty-baselines' rank-1 WRN-28-10 and
ResNet-50 make every conv edward2's Conv2DRank1 and the head DenseRank1) is read by
member k as

  W_k = W o (s r^T),    i.e. y = ((x o s) W) o r + b      (s over the input axis -2,
                                                             r over the output axis -1)

with s ~ q_k(s), r ~ q_k(r) drawn anew: the paper's W o s r^T (edward2's DenseRank1
alpha = s, gamma = r; ensembles/batchensemble.py names them the other way round). Each
factor is fully factorised, q_k = N(loc, scale^2) or Cauchy(loc, scale) (ensemble.rank1.
prior: the prior p is the same family, centred at prior_mean with prior_scale), scale =
softplus(rho). The M members are the K = M components of the paper's mixture posterior
(1/K) sum_k q_k: member k owns component k's factors and its biases (edward2's biases
are per component too); W is ONE array shared by all members (batchensemble's entries).

Training minimises, per member, the negative ELBO per example

  mean over the batch and train_samples draws of the task loss (the NLL)
    + kl_weight(step) * KL(q_k || p) / N                     (N = rank1.data_size)

with every example drawing its own factors (train_samples draws each: edward2 samples
per example), through the reparameterisation. The model's OWN apply computes it: each
kernel is handed to it as a models.layers.Factored(W, s [rows, in], r [rows, out]) value,
which layers' conv and `x @ kernel` (layers.dense, and the MLP's and CNN's matmuls) apply
as ((h o s) W) o r, so no example's W o (s r^T) is formed and no model's forward is
copied here (one copy per model would drift from it; the MLP's and CNN's outputs and
gradients are bit for bit those of the hand-written copies this replaced). A ResNet's
BatchNorm runs as in any training step: on the batch's statistics over its B x
train_samples rows, its new running statistics returned as the model state.

kl_weight rises linearly from 0 to 1 over the first kl_annealing * train.steps steps
(uncertainty-baselines anneals over 200 of 250 epochs). The mean over members of this
per-member bound is the mixture's ELBO bound (by the KL's convexity, KL(mixture || p) <=
mean_k KL(q_k || p)); uncertainty-baselines adds the components' SUM of KLs to the mean
NLL, M times this weight. Both KLs are closed forms: Gaussian log(p_s / q_s) + (q_s^2 +
(q_m - p_m)^2) / (2 p_s^2) - 1/2, Cauchy log(((q_s + p_s)^2 + (q_m - p_m)^2) / (4 q_s
p_s)). Draws are clipped to [-10, 10] as edward2's layers clip them. W's gradient is the
mean of the members' and W takes one optimizer step with member 0's hyperparameters
(batchensemble.members_update); the logged train loss is the ELBO's, KL term included.

Evaluation: member k predicts the mean of the softmaxes (Task.combine) of its network
under eval_samples factor draws that are fixed at init (standard noise drawn from the
member's init key, kept in the model state like BatchNorm's statistics), so a run's
evaluation, Ensemble.load's predictions and every later one agree; the ensemble
averages the members' probabilities, the mean over M x eval_samples networks.

Init (uncertainty-baselines' rank-1 models): W and the biases as the model's own init
(W member 0's), factor locs +-1 at random ('random_sign') or N(1, 0.5^2) ('normal'),
scales rho = softplus^-1(init_scale) + 0.1 N(0, 1) truncated at 2 standard deviations.

BatchNorm is per member: its scale, bias and running statistics are component k's own
(core.model.is_kernel leaves only are shared), edward2's EnsembleSyncBatchNorm, which the
uncertainty-baselines rank-1 ResNet-50 uses with use_ensemble_bn=True. Their WRN-28-10
(and the ResNet-50 by default) share one Keras BatchNorm across the components instead,
its statistics over every component's examples; here each member's forward sees only
its own rows (members are vmapped), so a shared BatchNorm would need a reduction over
the member axis in every layer, and a member would no longer be a network of its own
(Ensemble.member, export).

For config.model.name in MODELS: the models whose every kernel passes through layers'
conv or a matmul (mlp, cnn, lenet5, resnet, resnet18, wide_resnet); others (vit, the
transformers, Hugging Face checkpoints, config.model.factory) are refused. Weight decay
(optim.decay_mask='kernels') decays W, not the factors (1-D leaves).
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dist_ens.core.hooks import MethodHooks
from dist_ens.core.model import Model, is_kernel
from dist_ens.ensembles import batchensemble, epinet, own
from dist_ens.ensembles.method import Method, MethodSpec, int_field, refuse_reproducible
from dist_ens.errors import ConfigError
from dist_ens.models import layers, resnet
from dist_ens.parallel.sharding_rules import path_str

# The method's fields, config.ensemble.rank1: each one's meaning in the comment lines above
# it and its check in brackets at the comment's end (dist_ens/config/schema.py reads them).
FIELDS = dict(
    # The family of the factors' prior and of each member's variational posterior:
    # 'gaussian' (normal) or 'cauchy' (heavier tails; the paper's best corrupted-data row)
    prior='gaussian',  # [one of 'gaussian', 'cauchy']
    prior_mean=1.0,  # the prior's centre (uncertainty-baselines' prior_mean) [number]
    # The prior's standard deviation (gaussian) or scale (cauchy); uncertainty-baselines'
    # prior_stddev
    prior_scale=0.1,  # [number > 0]
    # How the posterior locations start: 'random_sign' (+1 or -1, each with probability
    # 1/2: uncertainty-baselines' random_sign_init=0.5) or 'normal' (N(1, 0.5^2))
    init='random_sign',  # [one of 'random_sign', 'normal']
    # The posterior scales' start: sqrt(p / (1 - p)) at uncertainty-baselines' p = 1e-3
    init_scale=0.0316,  # [number > 0]
    # Factor draws per example per training step (each example draws its own)
    train_samples=1,  # [int >= 1]
    # Factor draws per member at evaluation, fixed at init; a member predicts their mean
    # softmax
    eval_samples=4,  # [int >= 1]
    # The share of train.steps over which the KL's weight rises linearly from 0 to 1
    # (uncertainty-baselines: 200 of 250 epochs); 0: the full weight from the first step
    kl_annealing=0.8,  # [number in [0, 1]]
    # N, the training set's size: the ELBO per example divides the KL by it (required)
    data_size=0,  # [int >= 0]
)

PyTree = Any
FIELD = 'config.ensemble.rank1'
# config.model.name: the models whose every kernel is read by models/layers.py's conv or as
# `x @ kernel` (dense), so that a layers.Factored kernel passes through their own apply
MODELS = ('mlp', 'cnn', 'lenet5', *resnet.MAKERS)
FAMILIES = ('gaussian', 'cauchy')
INITS = ('random_sign', 'normal')
CLIP = 10.0  # draws are clipped to [-CLIP, CLIP] (edward2's min/max_perturbation_value)
BASE = 'base'  # Rank1Params' field of the model's own params ('base/0/w')
# Stream tags within a member's init key (epinet's are 11-23, prior's 7) and, for the
# training draws, within a step's key.
_FACTOR_STREAM, _EVAL_STREAM, _DRAW_STREAM = 29, 31, 37


class Options(NamedTuple):
  """config.ensemble.rank1, checked."""
  prior: str
  prior_mean: float
  prior_scale: float
  init: str
  init_scale: float
  train_samples: int
  eval_samples: int
  kl_annealing: float
  data_size: int


class Rank1Params(NamedTuple):
  """A member's trained params: the model's (its kernels the shared W) and, per kernel in
  the model's leaf order, its factors' posteriors {'s_loc', 's_rho' [in], 'r_loc',
  'r_rho' [out]} (scale = softplus(rho))."""
  base: PyTree
  factors: list[dict[str, jax.Array]]


class Rank1State(NamedTuple):
  """A member's model state: the model's, and per kernel the standard noise of its
  evaluation draws {'s': [eval_samples, in], 'r': [eval_samples, out]}."""
  base: PyTree
  noise: list[dict[str, jax.Array]]


def kl_gaussian(loc, scale, prior_loc, prior_scale):
  """KL(N(loc, scale^2) || N(prior_loc, prior_scale^2)), elementwise."""
  return (jnp.log(prior_scale / scale) + (scale**2 + (loc - prior_loc)**2) / (2 * prior_scale**2)
          - 0.5)


def kl_cauchy(loc, scale, prior_loc, prior_scale):
  """KL(Cauchy(loc, scale) || Cauchy(prior_loc, prior_scale)), elementwise (Chyzak and
  Nielsen 2019's closed form; it is symmetric)."""
  return jnp.log(((scale + prior_scale)**2 + (loc - prior_loc)**2) / (4 * scale * prior_scale))


def kl(factors: list[dict[str, jax.Array]], options: Options) -> jax.Array:
  """KL(q || p) of one member's factors: the sum over every factor's elements."""
  fn = kl_gaussian if options.prior == 'gaussian' else kl_cauchy
  total = jnp.zeros((), jnp.float32)
  for f in factors:
    for side in ('s', 'r'):
      total += jnp.sum(fn(f[f'{side}_loc'], jax.nn.softplus(f[f'{side}_rho']),
                          options.prior_mean, options.prior_scale))
  return total


def _noise(key: jax.Array, shape: tuple[int, ...], family: str) -> jax.Array:
  if family == 'gaussian':
    return jax.random.normal(key, shape, jnp.float32)
  return jax.random.cauchy(key, shape, jnp.float32)


def draw(factor: dict[str, jax.Array], noise: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """{'s', 'r'}: loc + scale * noise, clipped to [-CLIP, CLIP] (noise [..., dim])."""
  value = lambda side: jnp.clip(factor[f'{side}_loc'] + jax.nn.softplus(factor[f'{side}_rho'])
                                * noise[side].astype(factor[f'{side}_loc'].dtype), -CLIP, CLIP)
  return {'s': value('s'), 'r': value('r')}


def formed(base: PyTree, values: list[dict[str, jax.Array]]) -> PyTree:
  """The model's params with each kernel W replaced by W o (s r^T) (values in kernel order)."""
  leaves, treedef = jax.tree.flatten(base)
  out, i = [], 0
  for leaf in leaves:
    if is_kernel(leaf):
      v = values[i]
      out.append(leaf * (v['s'][:, None] * v['r'][None, :]).astype(leaf.dtype))
      i += 1
    else:
      out.append(leaf)
  return treedef.unflatten(out)


def factored(base: PyTree, values: list[dict[str, jax.Array]]) -> PyTree:
  """The model's params with each kernel W replaced by layers.Factored(W, s, r) (values in
  kernel order, s [N, in] and r [N, out]: row n example n's), which the model's own conv
  and dense layers apply as ((h o s) W) o r, so that no example's W o (s r^T) is formed."""
  leaves, treedef = jax.tree.flatten(base)
  values = iter(values)
  return treedef.unflatten([layers.Factored(leaf, **next(values)) if is_kernel(leaf) else leaf
                            for leaf in leaves])


def _init_factors(key: jax.Array, base: PyTree, options: Options) -> list[dict[str, jax.Array]]:
  rho = math.log(math.expm1(options.init_scale))
  factors = []
  for i, leaf in enumerate(l for l in jax.tree.leaves(base) if is_kernel(l)):
    entry = {}
    for j, (side, dim) in enumerate((('s', leaf.shape[-2]), ('r', leaf.shape[-1]))):
      k_loc, k_rho = jax.random.split(jax.random.fold_in(key, 2 * i + j))
      if options.init == 'random_sign':
        loc = jnp.where(jax.random.bernoulli(k_loc, 0.5, (dim,)), 1.0, -1.0)
      else:
        loc = 1.0 + 0.5 * jax.random.normal(k_loc, (dim,))
      entry[f'{side}_loc'] = loc.astype(leaf.dtype)
      entry[f'{side}_rho'] = (rho + 0.1 * jax.random.truncated_normal(k_rho, -2, 2, (dim,))
                              ).astype(leaf.dtype)
    factors.append(entry)
  return factors


def _draws(key: jax.Array, factors: list, lead: tuple[int, ...], family: str) -> list[dict]:
  """Standard noise [*lead, dim] per factor, from `key`."""
  out = []
  for i, f in enumerate(factors):
    ks, kr = jax.random.split(jax.random.fold_in(key, i))
    out.append({'s': _noise(ks, (*lead, f['s_loc'].shape[-1]), family),
                'r': _noise(kr, (*lead, f['r_loc'].shape[-1]), family)})
  return out


def wrap(model: Model, options: Options, combine: Callable[..., jax.Array]) -> Model:
  """`model` with a distribution over rank-1 factors of each of its kernels: training
  outputs [B, train_samples, C] through the model's own apply on factored kernels (each
  example its own draws; its new state, BatchNorm's statistics of the B x train_samples
  rows), evaluation the combined outputs of the member's fixed eval_samples draws through
  the model's own apply on the formed kernels W o (s r^T)."""
  family, samples = options.prior, options.train_samples

  def init(rng, sample_x):
    base, state = model.init(rng, sample_x)
    factors = _init_factors(jax.random.fold_in(rng, _FACTOR_STREAM), base, options)
    noise = _draws(jax.random.fold_in(rng, _EVAL_STREAM), factors, (options.eval_samples,),
                   family)
    return Rank1Params(base, factors), Rank1State(state, noise)

  def one(params, state, noise, x, rng):
    values = [draw(f, n) for f, n in zip(params.factors, noise)]
    return model.apply(formed(params.base, values), state.base, x, train=False, rng=rng)[0]

  def apply(params, state, x, *, train, rng=None):
    if not train:  # [E, B, C] under the fixed draws, combined as the task combines members.
      outputs = jax.vmap(lambda n: one(params, state, n, x, rng))(state.noise)
      return combine(outputs, jnp.ones((options.eval_samples,), bool)), state
    if rng is None:
      raise ValueError('a rank-1 BNN in training draws its factors from `rng`; got None.')
    # Each of the B x S rows (example b's sample j at row b * S + j) its own draws.
    noise = _draws(jax.random.fold_in(rng, _DRAW_STREAM), params.factors,
                   (x.shape[0] * samples,), family)
    values = [draw(f, n) for f, n in zip(params.factors, noise)]
    outputs, base_state = model.apply(factored(params.base, values), state.base,
                                      jnp.repeat(x, samples, axis=0), train=True, rng=rng)
    return outputs.reshape(x.shape[0], samples, -1), state._replace(base=base_state)

  return Model(init, apply)


def kl_weight(step: jax.Array, options: Options, total_steps: int) -> jax.Array:
  """The KL's weight at update `step` (0-based): min(1, (step + 1) / (kl_annealing * T))."""
  ramp = options.kl_annealing * total_steps
  if ramp <= 0:
    return jnp.ones((), jnp.float32)
  return jnp.minimum(1.0, (step + 1) / ramp).astype(jnp.float32)


def with_kl(results: Callable[..., Any], options: Options, total_steps: int) -> Callable[..., Any]:
  """core.step.member_results_fn's `results` with kl_weight * KL / N added to the loss
  and its gradient to the factors' (one member's Rank1Params)."""

  def out(params: Rank1Params, model_state, hp, member_id, step, batch):
    result = results(params, model_state, hp, member_id, step, batch)
    weight = kl_weight(step, options, total_steps) / options.data_size
    value, grads = jax.value_and_grad(kl)(params.factors, options)
    factors = jax.tree.map(lambda g, k: g + (weight * k).astype(g.dtype),
                           result.grads.factors, grads)
    return result._replace(loss=result.loss + (weight * value).astype(result.loss.dtype),
                           grads=result.grads._replace(factors=factors))

  return out


def from_members(params: Rank1Params, keys: jax.Array) -> PyTree:
  """batchensemble's entries from M members' initial Rank1Params (stacked): each kernel
  of the model ONE shared W (member 0's), every other leaf (factors, biases) each
  member's own."""
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  owned = frozenset(path_str(path) for path, leaf in paths
                    if not (path_str(path).startswith(f'{BASE}/') and is_kernel(leaf[0])))
  return own.from_members(owned, params, keys)


def options_from(fields: Any) -> Options:
  """config.ensemble.rank1 checked, each bad field refused in one line naming it."""
  def choice(name, allowed):
    if fields[name] not in allowed:
      raise ConfigError(f'{FIELD}.{name}={fields[name]!r}; use one of {list(allowed)}.')
    return fields[name]

  def number(name, low, high=math.inf, low_closed=False):
    value = fields[name]
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value >= low if low_closed else value > low) and value <= high)
    if not ok:
      raise ConfigError(f'{FIELD}.{name}={value!r} must be a number '
                        f'{"in [0, 1]" if high < math.inf else "> 0"}.')
    return float(value)

  mean = fields['prior_mean']
  if isinstance(mean, bool) or not isinstance(mean, (int, float)) or not math.isfinite(mean):
    raise ConfigError(f'{FIELD}.prior_mean={mean!r} must be a finite number, e.g. 1.0.')
  size = fields['data_size']
  if isinstance(size, bool) or not isinstance(size, int) or size < 1:
    raise ConfigError(f"{FIELD}.data_size={size!r} must be the training set's size N (an int "
                      '>= 1; the ELBO per example divides the KL by it), e.g. 3500.')
  return Options(prior=choice('prior', FAMILIES), prior_mean=float(mean),
                 prior_scale=number('prior_scale', 0), init=choice('init', INITS),
                 init_scale=number('init_scale', 0),
                 train_samples=int_field(fields['train_samples'], 'rank1.train_samples', 1),
                 eval_samples=int_field(fields['eval_samples'], 'rank1.eval_samples', 1),
                 kl_annealing=number('kl_annealing', 0, 1, low_closed=True), data_size=size)


def make(spec: MethodSpec) -> Method:
  """Rank-1 BNNs from config.ensemble.rank1: one shared W per kernel of a model in MODELS,
  each member a mixture component's posterior over rank-1 factors of it."""
  refuse_reproducible(spec, "the shared weights' gradient is a sum over devices, whose order "
                            'depends on the mesh')
  options = options_from(spec.options)

  def wrap_model(model: Model, task: Any) -> Model:
    if spec.model not in MODELS:
      raise ConfigError(f"config.ensemble.method='rank1' puts rank-1 factors on the kernels "
                        f"that models/layers.py's conv and dense read, in config.model.name one "
                        f'of {list(MODELS)}, not {spec.model!r} (config.task={task.name!r}); use '
                        "one of them, or method='batchensemble'.")
    if not task.any_members:
      raise ConfigError(f"config.ensemble.method='rank1' combines each member's outputs over its "
                        f'factor draws, and config.task={task.name!r} fits one constant per '
                        'trained member to its own outputs (Task.any_members); use another task '
                        "or method.")
    if task.combine is None or task.output_shape is not None:
      raise ConfigError(f"config.ensemble.method='rank1' combines [batch, units] outputs over "
                        f'its factor draws as the task combines members, which config.task='
                        f'{task.name!r} does not; use another method.')
    return wrap(model, options, task.combine)

  def members_update(results, apply, optimizer, parallelism, batch_axis, map_batch_size=None):
    return batchensemble.members_update(with_kl(results, options, spec.total_steps), apply,
                                        optimizer, parallelism, batch_axis, map_batch_size)

  return Method('rank1', wrap_model=wrap_model, wrap_loss=epinet.index_mean_loss,
                wrapped_under=BASE, hooks=MethodHooks(
                    init_params=from_members, init_opt_state=batchensemble.init_opt_state,
                    members_update=members_update, shared=batchensemble.is_shared))
