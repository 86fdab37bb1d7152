"""A run's evaluator: every member and the ensemble scored by the task, in the targets'
units, with config.eval.metrics' own metrics (build_evaluator; Run.evaluator calls it, and
the actions that change the task after training, evaluators/noise.py)."""

from typing import TYPE_CHECKING

from dist_ens.config.specs import EvalSpec
from dist_ens.eval import user_metrics
from dist_ens.eval.evaluate import Evaluator, Scorer, make_eval_step
from dist_ens.run.run_data import RunData

if TYPE_CHECKING:
  from dist_ens.run.assemble import Parts


def build_evaluator(spec: EvalSpec, parts: 'Parts', run_data: RunData | None) -> Evaluator:
  """The sharded evaluator of every member and the ensemble by parts.task, with
  eval.metrics' own metrics, in the targets' units (sums standardised with run_data.scale
  converted back by the task's unscale)."""
  mesh, task = parts.mesh, parts.task
  eval_batch, finalize = task.eval_batch, task.finalize
  scale = run_data.scale if run_data is not None else None
  if scale is not None:
    finalize = lambda sums, examples: task.finalize(task.unscale(sums, scale.y_std), examples)
  if spec.metrics:
    own = user_metrics.load_metrics(spec.metrics)
    eval_batch = user_metrics.with_metrics(eval_batch, own, task.combine)
    finalize = user_metrics.with_results(finalize, own)
  # The state as it is: predict_model reads its params as stored, a shared leaf once.
  return Evaluator(make_eval_step(parts.predict_model, mesh, eval_batch), mesh,
                   spec.batch_size, scorer=Scorer(eval_batch, finalize, task.ood_metrics))
