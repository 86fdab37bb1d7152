"""A run's evaluator: every member and the ensemble scored by the task, in the targets'
units, with config.eval.metrics' own metrics (build_evaluator; Run.evaluator calls it, and
the actions that change the task after training, evaluators/noise.py)."""

from jax.sharding import Mesh

from dist_ens.config.specs import EvalSpec
from dist_ens.core.model import Model
from dist_ens.eval import user_metrics
from dist_ens.eval.evaluate import Evaluator, Scorer, make_eval_step
from dist_ens.run.run_data import RunData
from dist_ens.tasks.task import Task


def build_evaluator(spec: EvalSpec, task: Task, predict_model: Model, mesh: Mesh,
                    run_data: RunData | None) -> Evaluator:
  """The sharded evaluator of every member and the ensemble by `task`, with
  eval.metrics' own metrics, in the targets' units (sums standardised with run_data.scale
  converted back by the task's unscale). `predict_model` is a run's Parts.predict_model:
  it reads the params as the state stores them, a shared leaf once."""
  eval_batch, finalize = task.eval_batch, task.finalize
  scale = run_data.scale if run_data is not None else None
  if scale is not None:
    finalize = lambda sums, examples: task.finalize(task.unscale(sums, scale.y_std), examples)
  if spec.metrics:
    own = user_metrics.load_metrics(spec.metrics)
    eval_batch = user_metrics.with_metrics(eval_batch, own, task.combine)
    finalize = user_metrics.with_results(finalize, own)
  return Evaluator(make_eval_step(predict_model, mesh, eval_batch), mesh,
                   spec.batch_size, scorer=Scorer(eval_batch, finalize, task.ood_metrics))
