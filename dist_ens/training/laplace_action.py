"""After the last step: a last-layer Laplace approximation of every member
(config.eval.laplace; the math in dist_ens.eval.laplace), test metrics of the members'
Laplace predictives and of their mixture, under 'laplace' in final_metrics.json.

Every member's fit is one program over the member axis: its output layer's features on
the training split (each example's gradient of its first logit in the output kernel,
which is the layer's input when the layer is linear, checked), the Gauss-Newton sums,
their eigenbasis, the prior precision (validation log-likelihood by the probit
predictive over dist_ens.eval.laplace.PRIOR_GRID, else the marginal likelihood) and the
predictive. The curvature uses the whole training split for every member (a member's
bootstrap or member_split part is not singled out).
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dist_ens.core import rng
from dist_ens.errors import ConfigError
from dist_ens.eval import evaluate, laplace
from dist_ens.models.heads import head_paths
from dist_ens.parallel.sharding_rules import path_str
from dist_ens.training import posthoc
from dist_ens.training.loop import Context, PeriodicAction

# Rows per feature batch: the full form's Jacobians are [rows, P, C] per member.
_ROWS = 128
# Stream tag of the predictive's logit draws within a member's key (core/rng.py).
_LAPLACE_STREAM = 0x4C41504C  # 'LAPL'
# The output layer must be linear in its kernel to this relative tolerance, by the
# precision the model computes in (config.precision).
_LINEAR_TOLERANCE = {'float32': 1e-3, 'bfloat16': 3e-2}


def head_leaves(params: Any, num_outputs: int) -> tuple[str, str]:
  """(kernel, bias) names of the output layer in one member's params shapes.

  Raises:
    ConfigError: no head of a [F, C] kernel and a [C] bias.
  """
  names = head_paths(params, num_outputs)
  shapes = {path_str(p): tuple(leaf.shape)
            for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  kernels = [n for n in names if len(shapes[n]) == 2 and shapes[n][1] == num_outputs]
  biases = [n for n in names if shapes[n] == (num_outputs,)]
  if len(names) != 2 or len(kernels) != 1 or len(biases) != 1:
    raise ConfigError(f'config.eval.laplace fits the output layer, a [features, {num_outputs}] '
                      f'kernel and a [{num_outputs}] bias; the model\'s head is '
                      f'{sorted(names) or "not found"} ({[shapes[n] for n in sorted(names)]}). '
                      "Set eval.laplace=''.")
  return kernels[0], biases[0]


def _replace(params: Any, name: str, value: jax.Array) -> Any:
  return jax.tree_util.tree_map_with_path(
      lambda p, leaf: value if path_str(p) == name else leaf, params)


def _get(params: Any, name: str) -> jax.Array:
  [leaf] = [leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
            if path_str(p) == name]
  return leaf


def _features(model, kernel_name, params, state, x):
  """One member's (logits [B, C], psi [B, F+1], relative error of the head as linear in
  its kernel: logits less a zero kernel's against phi @ kernel)."""
  kernel = _get(params, kernel_name)

  def first_logit(k, x1):
    out, _ = model.apply(_replace(params, kernel_name, k), state, x1[None], train=False)
    return out[0, 0].astype(jnp.float32)

  phi = jax.vmap(jax.grad(first_logit), in_axes=(None, 0))(kernel, x)[..., 0]  # [B, F]
  logits = model.apply(params, state, x, train=False)[0].astype(jnp.float32)
  # Linear in the kernel: the logits less those of a zero kernel (the bias, and what
  # else adds to the output, a randomized prior's say) are features @ kernel.
  rest = model.apply(_replace(params, kernel_name, jnp.zeros_like(kernel)), state, x,
                     train=False)[0].astype(jnp.float32)
  error = jnp.abs(phi @ kernel.astype(jnp.float32) - (logits - rest)).max() / (
      jnp.abs(logits - rest).max() + 1e-6)
  return logits, laplace.with_bias(phi), error


class Laplace(PeriodicAction):
  """The fit and its test metrics (see the module doc)."""

  def __init__(self, kind: str, samples: int):
    super().__init__(0, at_end=True)
    self.kind, self.samples = kind, samples

  def run(self, ctx: Context) -> None:
    if not posthoc.included(ctx).any():  # Every member went non-finite: the run says so.
      logging.info('Laplace skipped: no member is in the ensemble.')
      return
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), ctx.state.params)
    names = head_leaves(one, ctx.parts.num_outputs)
    feats = jax.vmap(functools.partial(_features, ctx.parts.predict_model, names[0]),
                     in_axes=(0, 0, None))
    with ctx.off_clock():
      curvature, error, count = self._curvature(ctx, feats)
      if error > _LINEAR_TOLERANCE.get(ctx.config.precision, 1e-3):
        raise ConfigError(f'config.eval.laplace: the output layer {names[0]} is not linear in '
                          f'its features (relative error {error:.2g}); set eval.laplace=\'\'.')
      post = jax.jit(jax.vmap(functools.partial(laplace.posterior, self.kind)))(curvature)
      deltas, by = self._prior(ctx, feats, post, names)
      plain, laplaced = self._log_probs(ctx, feats, post, deltas, ctx.run_data.dataset.test)
      ood = (None if ctx.run_data.ood is None else
             self._log_probs(ctx, feats, post, deltas, ctx.run_data.ood)[1])
    self._report(ctx, plain, laplaced, deltas, by, count)
    if ood is not None:  # OOD AUROC/AUPR by the Laplace predictives' uncertainty.
      ctx.results['laplace']['ood'] = {
          'dataset': ctx.config.eval.ood_dataset,
          **ctx.evaluator.scorer.ood(laplaced, ood, ctx.run_data.dataset.test.y,
                                     posthoc.included(ctx))}

  def _report(self, ctx, plain, laplaced, deltas, by, count) -> None:
    included, test_y = posthoc.included(ctx), ctx.run_data.dataset.test.y
    before = ctx.evaluator.scorer.metrics(plain, test_y, included)
    after = ctx.evaluator.scorer.metrics(laplaced, test_y, included)
    predictive = f'mc:{self.samples}' if self.samples else 'probit'
    ctx.results['laplace'] = {'kind': self.kind, 'predictive': predictive,
                              'prior_precision': [float(d) for d in deltas],
                              'prior_precision_by': by, 'train_examples': count, **after}
    if ctx.writes_final_events:
      ctx.write({'step': ctx.step, 'split': 'test_laplace', **after})
    logging.info('Laplace (%s, %s predictive; prior precision by %s: %s) test metrics:\n%s',
                 self.kind, predictive, by, np.round(deltas, 4).tolist(),
                 posthoc.before_after_table(before, after, ctx.parts.task, ('plain', 'Laplace')))

  def _batches(self, ctx: Context, split: Any):
    """(x, y, mask, valid) of equal-shaped batches of `split`, padding masked."""
    rows = min(_ROWS, ctx.config.eval.batch_size)
    for start, valid in evaluate.padded_chunks(split.num_examples, rows):
      x, y = (np.asarray(a) for a in split.read(np.arange(start, start + valid)))
      yield (evaluate.pad_rows(x, rows), evaluate.pad_rows(y, rows),
             (np.arange(rows) < valid).astype(np.float32), valid)

  def _curvature(self, ctx: Context, feats: Any) -> tuple[laplace.Curvature, float, int]:
    """Every member's Gauss-Newton sums over the training split, the largest relative
    error of the linear head, and the examples counted."""
    kind, params, model_state = self.kind, ctx.state.params, ctx.state.model_state

    @jax.jit
    def step(x, mask):
      logits, psi, error = feats(params, model_state, x)
      batch = jax.vmap(functools.partial(laplace.batch_curvature, kind), in_axes=(0, 0, None))(
          psi, jax.nn.softmax(logits, -1), mask)
      return batch, error.max()

    total, worst, count = None, 0.0, 0
    for x, _, mask, valid in self._batches(ctx, ctx.run_data.dataset.train):
      batch, error = step(x, mask)
      total = batch if total is None else jax.tree.map(jnp.add, total, batch)
      worst, count = max(worst, float(error)), count + valid  # float(): one batch in flight
    return total, worst, count

  def _prior(self, ctx: Context, feats: Any, post: laplace.Posterior, names: tuple[str, str]
             ) -> tuple[np.ndarray, str]:
    """[M] prior precisions from PRIOR_GRID and how they were chosen."""
    grid, kind = jnp.asarray(laplace.PRIOR_GRID), self.kind
    params, model_state = ctx.state.params, ctx.state.model_state
    if ctx.run_data.validation is None:
      norm2 = lambda p: sum(jnp.sum(jnp.square(_get(p, n).astype(jnp.float32))) for n in names)
      evidence = jax.jit(jax.vmap(lambda q, p: laplace.log_marginal_likelihood(
          kind, q, norm2(p), grid)))(post, params)
      return np.asarray(laplace.PRIOR_GRID)[np.argmax(ctx.fetch(evidence), 1)], \
          'marginal likelihood'

    def member_scores(logits, psi, q, y, mask):  # [D] validation log-likelihoods
      def at(delta):
        cov = laplace.logit_covariance(kind, q, psi, delta)
        log_probs = laplace.predictive_log_probs(logits, cov, 0, None)
        return (mask * jnp.take_along_axis(log_probs, y[:, None], -1)[:, 0]).sum()
      return jax.vmap(at)(grid)

    @jax.jit
    def scores(x, y, mask):
      logits, psi, _ = feats(params, model_state, x)
      return jax.vmap(member_scores, in_axes=(0, 0, 0, None, None))(logits, psi, post, y, mask)

    total = sum(ctx.fetch(scores(x, y.astype(np.int32), mask))
                for x, y, mask, _ in self._batches(ctx, ctx.run_data.validation))
    return np.asarray(laplace.PRIOR_GRID)[np.argmax(total, 1)], 'validation nll'

  def _log_probs(self, ctx: Context, feats: Any, post: laplace.Posterior, deltas: np.ndarray,
                 split: Any) -> tuple[np.ndarray, np.ndarray]:
    """[M, N, C] the members' plain log-probabilities and their Laplace predictive's."""
    kind, samples, params = self.kind, self.samples, ctx.state.params
    keys = jax.vmap(lambda k: jax.random.fold_in(k, _LAPLACE_STREAM))(
        rng.member_keys(ctx.config.seed, jnp.arange(len(deltas), dtype=jnp.uint32)))

    @jax.jit
    def step(x, offset):
      logits, psi, _ = feats(params, ctx.state.model_state, x)

      def member(logits, psi, q, delta, key):
        cov = laplace.logit_covariance(kind, q, psi, delta)
        return laplace.predictive_log_probs(logits, cov, samples,
                                            jax.random.fold_in(key, offset))
      return (jax.nn.log_softmax(logits, -1),
              jax.vmap(member)(logits, psi, post, jnp.asarray(deltas, jnp.float32), keys))

    plain, laplaced = [], []
    for start, (x, _, _, valid) in zip(range(0, split.num_examples, _ROWS), self._batches(ctx, split)):
      a, b = ctx.fetch(step(x, np.uint32(start)))
      plain.append(a[:, :valid])
      laplaced.append(b[:, :valid])
    return np.concatenate(plain, 1), np.concatenate(laplaced, 1)


def laplace_actions(config: Any, task: Any, method: Any) -> list[PeriodicAction]:
  """[Laplace] when config.eval.laplace is set, after refusing, in one line, what it
  cannot fit: a task without softmax outputs, a method whose members share leaves or
  predict with more than their trained weights."""
  kind = config.eval.laplace
  if not kind:
    return []
  if kind not in laplace.KINDS:
    raise ConfigError(f'config.eval.laplace={kind!r}; use one of {laplace.KINDS}, or \'\' (off).')
  samples = config.eval.laplace_samples
  if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
    raise ConfigError(f'config.eval.laplace_samples={samples!r} must be an int >= 0 (0: the '
                      'probit approximation; k: k logit draws per example).')
  if task.name != 'classification':
    raise ConfigError(f'config.eval.laplace={kind!r} is the softmax cross-entropy\'s Gauss-Newton '
                      f'and predictive; config.task={task.name!r} is not a classifier\'s: set '
                      "eval.laplace=''.")
  # wrap_loss: the members train on several outputs per example (MIMO's heads, an
  # epinet's index samples), not one output layer's.
  if (method.shares or method.collects or method.outputs_per_output != 1
      or method.wrap_loss is not None):
    raise ConfigError(f'config.eval.laplace={kind!r} fits each independently trained '
                      f'member\'s output layer; config.ensemble.method={method.name!r} (or '
                      "ensemble.own) shares leaves or predicts with other weights: use "
                      "method='deep' with own='all', or eval.laplace=''.")
  return [Laplace(kind, samples)]
