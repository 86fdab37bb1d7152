"""The members' last-layer Laplace predictive (dist_ens.eval.laplace) on a batch of inputs:
one function that the fit after training (evaluators/laplace.py) scores the test
split with and that Ensemble.predict(x, laplace=True) calls, so a loaded run predicts
exactly what its final_metrics.json 'laplace' section was computed from.

  fit = LaplaceFit(...)                              # a run's fit (evaluators/laplace_file.py)
  arrays = fitted_arrays(fit, seed, num_classes, mesh)   # + the weight draws, [M, ...]
  plain, laplaced, draws = members_predictive(model, fit.kind, fit.kernel,
                                              (params, model_state), arrays, x)

A fit covers one stack of members that one vmap runs (core/stacks.py): the whole
ensemble, or one of several stacks of different architectures (its own head width, so
its own fit; a run's fits are one per stack, in id order). Weight draws depend only on
(seed, member id, draw): not on the inputs, their batching, the mesh, M or the stacks. `Forwards` holds the
jitted forwards Ensemble.predict calls on its mesh.
"""

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dist_ens.core import rng
from dist_ens.eval import laplace, metrics
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.parallel.sharding_rules import path_str

# Stream tag of the weight draws within a member's key (core/rng.py).
_LAPLACE_STREAM = 0x4C41504C  # 'LAPL'


class LaplaceFit(NamedTuple):
  """What a run fitted: enough to predict with its Laplace posteriors.

  kind: a laplace.KINDS value; samples: weight draws per member (0: probit); kernel: the
  output kernel's '/'-joined path in a member's params; step: the checkpoint step it was
  fitted on; prior_precision: [m] float32; posterior: laplace.Posterior, fields [m, ...];
  first_member: the id of the stack's first member (its place; 0 for
  the one stack), which keys its members' weight draws.
  """
  kind: str
  samples: int
  kernel: str
  step: int
  prior_precision: np.ndarray
  posterior: laplace.Posterior
  first_member: int = 0


class LaplaceArrays(NamedTuple):
  """The fit's arrays on the members' axis, with the weight draws [M, S, F1, C]."""
  posterior: laplace.Posterior
  prior_precision: Any
  noise: Any


def leaf(params: Any, name: str) -> jax.Array:
  """The leaf of `params` at the '/'-joined path `name`."""
  [found] = [x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
             if path_str(p) == name]
  return found


def with_leaf(params: Any, name: str, value: jax.Array) -> Any:
  """`params` with the leaf at `name` replaced by `value`."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: value if path_str(p) == name else x, params)


def head_features(model: Any, kernel_name: str, params: Any, state: Any, x: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One member's (logits [B, C], psi [B, F+1], relative error of the head as linear in
  its kernel: logits less a zero kernel's against phi @ kernel). phi is each example's
  gradient of its first logit in the kernel: the layer's input when it is linear."""
  kernel = leaf(params, kernel_name)

  def first_logit(k, x1):
    out, _ = model.apply(with_leaf(params, kernel_name, k), state, x1[None], train=False)
    return out[0, 0].astype(jnp.float32)

  phi = jax.vmap(jax.grad(first_logit), in_axes=(None, 0))(kernel, x)[..., 0]  # [B, F]
  logits = model.apply(params, state, x, train=False)[0].astype(jnp.float32)
  # Linear in the kernel: the logits less those of a zero kernel (the bias, and what
  # else adds to the output, a randomized prior's say) are features @ kernel.
  rest = model.apply(with_leaf(params, kernel_name, jnp.zeros_like(kernel)), state, x,
                     train=False)[0].astype(jnp.float32)
  error = jnp.abs(phi @ kernel.astype(jnp.float32) - (logits - rest)).max() / (
      jnp.abs(logits - rest).max() + 1e-6)
  return logits, laplace.with_bias(phi), error


def _member_noise(kind: str, samples: int, num_classes: int, post: laplace.Posterior,
                  delta: jax.Array, key: jax.Array) -> jax.Array:
  """[S, F1, C] one member's weight draws."""
  f1 = post.lam_a.shape[0] if kind == 'last_layer_kron' else post.lam.shape[0] // num_classes
  eps = jax.random.normal(key, (samples, f1, num_classes))
  return laplace.weight_noise(kind, post, delta, eps)


def fitted_arrays(fit: LaplaceFit, seed: int, num_classes: int, mesh: jax.sharding.Mesh
                  ) -> LaplaceArrays:
  """The fit's arrays and every member's weight draws (member m's from (seed, m), m its
  id), on `mesh`'s member axis: every process computes them alike from the fit's numpy
  arrays and places them as numpy, as other host values go onto the mesh."""
  ids = fit.first_member + np.arange(len(fit.prior_precision))
  keys = jax.vmap(lambda k: jax.random.fold_in(k, _LAPLACE_STREAM))(
      rng.member_keys(seed, jnp.asarray(ids, jnp.uint32)))
  post = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), fit.posterior)
  deltas = jnp.asarray(fit.prior_precision, jnp.float32)
  noise = jax.jit(jax.vmap(functools.partial(
      _member_noise, fit.kind, fit.samples, num_classes)))(post, deltas, keys)
  host = jax.tree.map(np.asarray, LaplaceArrays(post, deltas, noise))
  return jax.device_put(host, mesh_lib.member_sharding(mesh))


def _member(kind: str, post: laplace.Posterior, delta: jax.Array, noise: jax.Array,
            logits: jax.Array, psi: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One member's Laplace log p(y | x) [B, C] and each weight draw's [S, B, C] (S = 0:
  the probit approximation, no draws)."""
  if noise.shape[0] == 0:
    cov = laplace.logit_covariance(kind, post, psi, delta)
    return (laplace.predictive_log_probs(logits, cov, 0, None),
            jnp.zeros((0, *logits.shape), logits.dtype))
  draws = laplace.sampled_log_probs(logits, psi, noise)
  return jax.nn.logsumexp(draws, 0) - jnp.log(noise.shape[0]), draws


def members_predictive(model: Any, kind: str, kernel: str, variables: Any,
                       arrays: LaplaceArrays, x: jax.Array
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Every member's plain log-probabilities [M, B, C], Laplace predictive [M, B, C] and
  weight draws' log-probabilities [M, S, B, C] (S = 0 with the probit approximation).
  `variables` is (params, model_state), every leaf stacked [M, ...]."""
  params, state = variables
  logits, psi, _ = jax.vmap(functools.partial(head_features, model, kernel),
                            in_axes=(0, 0, None))(params, state, x)
  log_probs, draws = jax.vmap(functools.partial(_member, kind))(
      arrays.posterior, arrays.prior_precision, arrays.noise, logits, psi)
  return jax.nn.log_softmax(logits, -1), log_probs, draws


def _stacks_predictive(models: Sequence[Any], fits: Sequence[LaplaceFit], joined: bool,
                       variables: Any, arrays: Sequence[LaplaceArrays], x: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
  """Every member's Laplace predictive [M, B, C] and weight draws [M, S, B, C], in id
  order: each stack's (models[i] with fits[i]) joined. `joined` (several stacks):
  `variables` holds a tuple of params and one of model states, one per stack."""
  params, state = variables
  stacks = zip(params, state) if joined else [variables]
  outs = [members_predictive(model, fit.kind, fit.kernel, stack, a, x)[1:]
          for model, fit, stack, a in zip(models, fits, stacks, arrays)]
  return tuple(jnp.concatenate(parts) for parts in zip(*outs))


def _ensemble_step(models: Sequence[Any], fits: Sequence[LaplaceFit], joined: bool,
                   with_draws: bool, variables: Any, x: jax.Array, member_mask: jax.Array,
                   arrays: Sequence[LaplaceArrays]) -> Any:
  """Ensemble.predict's outputs (ensemble probs, member probs, entropy, mutual
  information) of the members' Laplace predictives, or (with_draws) each weight draw's
  probabilities [M, S, B, C]."""
  log_probs, draws = _stacks_predictive(models, fits, joined, variables, arrays, x)
  if with_draws:
    return jnp.exp(draws)
  uncertainty = metrics.member_uncertainty(log_probs, member_mask)
  return (jnp.exp(metrics.ensemble_log_probs(log_probs, member_mask)), jnp.exp(log_probs),
          uncertainty['entropy'], uncertainty['mutual_information'])


class Forwards:
  """A run's fits' jitted forwards on `mesh`, each (variables, x, member_mask) ->
  outputs with the fits' arrays on the member axis: `predict` (see _ensemble_step) and
  `draws`. models[i] is the predicting model of the stack fits[i] covers (one model and
  fit for one stack; `joined`: each stack's, and `variables` the joined state's)."""

  def __init__(self, models: Sequence[Any], fits: Sequence[LaplaceFit], seed: int,
               num_classes: int, mesh: jax.sharding.Mesh, joined: bool = False):
    if len(models) != len(fits):
      raise ValueError(f'{len(fits)} Laplace fits for {len(models)} stacks of members: '
                       'laplace.npz is not this run\'s.')
    arrays = tuple(fitted_arrays(fit, seed, num_classes, mesh) for fit in fits)
    models, fits = tuple(models), tuple(fits)

    def forward(with_draws):
      step = jax.jit(functools.partial(_ensemble_step, models, fits, joined, with_draws),
                     in_shardings=(None, mesh_lib.batch_sharding(mesh), None, None),
                     out_shardings=mesh_lib.replicated(mesh))
      return lambda variables, x, member_mask: step(variables, x, member_mask, arrays)

    self.predict, self.draws = forward(False), forward(True)


def check_predictable(fits: Sequence[LaplaceFit] | None, laplace: str, task: str, step: int,
                      draws: bool) -> None:
  """Refuses in one line a Laplace prediction (draws: laplace_samples()) the run cannot
  give: another task than classification, no fit for `step` (the run's eval.laplace is
  `laplace`), or draws from a probit fit."""
  what = 'laplace_samples()' if draws else 'predict(laplace=True)'
  if task != 'classification':
    raise ValueError(f'{what}: config.task={task!r} has no Laplace predictive '
                     "(eval.laplace fits a classifier's softmax output layer); call "
                     'predict(x) for its own.')
  if not fits:
    raise ValueError(f'{what}: this run has no Laplace fit for step {step} '
                     f'(config.eval.laplace={laplace!r}; none in '
                     "laplace.npz): train with eval.laplace='last_layer_kron' (or "
                     "'last_layer_diag', 'last_layer_full'; rerunning a finished run's "
                     'command refits), or call predict(x).')
  if draws and not fits[0].samples:
    raise ValueError(f'{what}: the run\'s Laplace predictive is the probit approximation '
                     '(config.eval.laplace_samples=0), which draws no weights; train with '
                     'eval.laplace_samples=k > 0, or call predict(x, laplace=True).')
