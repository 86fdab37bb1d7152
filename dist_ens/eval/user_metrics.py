"""Your own evaluation metrics by import path (config.eval.metrics), for any task.

A metric is a function of one predictor's outputs and the targets of a batch that gives
one value per example:

  def abs_error(outputs, targets):          # my_pkg/metrics.py
    return jnp.abs(outputs[:, 0] - targets)  # [B]

  config.eval.metrics = ('my_pkg.metrics:abs_error',)

It runs inside the compiled evaluation, once per member (on [B, ...] outputs) and once on
the ensemble's outputs in a member's format (Task.combine: log of the mean probabilities
for classification; the mixture's mean and variance for regression). The result is the
mean over the split's examples, exact under padding (padded rows are masked out of the
sums, the division is by the real count), under the function's name in final_metrics.json's
'members' and 'ensemble' like the built-in metrics. The function sees what the model sees:
for a task that standardises (regression) that is standardised outputs and targets. A task
without `combine` gets member values only.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dist_ens import importing
from dist_ens.errors import ConfigError

Metric = Callable[[jax.Array, jax.Array], jax.Array]
_MEMBER, _ENSEMBLE, _COUNT = 'user_member_', 'user_ensemble_', 'user_count'


def load_metrics(paths: Sequence[str]) -> dict[str, Metric]:
  """{name: function} for config.eval.metrics' import paths ('pkg.module:function'); the
  name is the function's (the part after ':').

  Raises:
    ConfigError: a path that does not load, or two metrics of one name.
  """
  out: dict[str, Metric] = {}
  for path in paths:
    fn = importing.load_object(path, 'config.eval.metrics')
    name = path.rsplit(':', 1)[-1].rsplit('.', 1)[-1]
    if name in out:
      raise ConfigError(f'config.eval.metrics names two metrics called {name!r}; rename one.')
    out[name] = fn
  return out


def _per_example(fn: Metric, name: str, outputs: jax.Array, targets: jax.Array) -> jax.Array:
  values = jnp.asarray(fn(outputs, targets), jnp.float32)
  if values.shape != targets.shape[:1]:
    raise ConfigError(f'config.eval.metrics: {name}(outputs {outputs.shape}, targets '
                      f'{targets.shape}) gave shape {values.shape}; return one value per '
                      f'example, shape ({targets.shape[0]},).')
  return values


def check_metrics(metrics: dict[str, Metric], num_outputs: int, targets: np.ndarray) -> None:
  """Traces each metric on a batch of 2 (outputs [2, num_outputs], two of `targets`), so
  one that does not give one value per example fails before anything is trained."""
  y = jax.ShapeDtypeStruct((2, *targets.shape[1:]), targets.dtype)
  outputs = jax.ShapeDtypeStruct((2, num_outputs), jnp.float32)
  for name, fn in metrics.items():
    jax.eval_shape(lambda o, t, fn=fn, name=name: _per_example(fn, name, o, t), outputs, y)


def with_metrics(eval_batch: Callable[..., Any], metrics: dict[str, Metric],
                 combine: Callable[[jax.Array, jax.Array], jax.Array] | None
                 ) -> Callable[..., Any]:
  """The task's eval_batch with the metrics' masked sums added to its sums."""

  def eval_batch_with_metrics(outputs, targets, mask, member_mask=None):
    out = eval_batch(outputs, targets, mask, member_mask)
    weight = mask.astype(jnp.float32)
    sums = {**out.sums, _COUNT: jnp.sum(weight)}
    for name, fn in metrics.items():
      per_member = jax.vmap(lambda o, fn=fn, name=name: _per_example(fn, name, o, targets))
      sums[_MEMBER + name] = jnp.sum(per_member(outputs) * weight, axis=-1)
      if combine is not None:
        mm = jnp.ones(outputs.shape[0], bool) if member_mask is None else member_mask
        ensemble = _per_example(fn, name, combine(outputs, mm), targets)
        sums[_ENSEMBLE + name] = jnp.sum(ensemble * weight)
    return out._replace(sums=sums)

  return eval_batch_with_metrics


def with_results(finalize: Callable[..., dict[str, Any]],
                 metrics: dict[str, Metric]) -> Callable[..., dict[str, Any]]:
  """The task's finalize, with the metrics' means added to 'members' and 'ensemble'."""

  def finalize_with_metrics(sums, examples):
    sums = dict(sums)
    user = {k: sums.pop(k) for k in list(sums) if k.startswith('user_')}
    results = finalize(sums, examples)
    if _COUNT not in user:  # Sums of a step without the metrics (eval/shift.py's).
      return results
    count = float(np.asarray(user[_COUNT]))
    for name in metrics:
      results['members'][name] = (np.asarray(user[_MEMBER + name], np.float64) / count).tolist()
      if _ENSEMBLE + name in user:
        results['ensemble'][name] = float(np.asarray(user[_ENSEMBLE + name]) / count)
    return results

  return finalize_with_metrics
