"""The clean splits through every member once per state, shared by the actions after
the last step.

The final test metrics (metrics.Evaluate), validation (metrics.Validate), selective
prediction, conformal sets and the shift evaluation (decisions.EvaluateDecisions)
all start from the same forward pass over a split. One compiled program
(dist_ens.eval.shift.make_predict_step) serves every split, clean or corrupted, and a
clean split already predicted from this state is not predicted again. The post-hoc
steps and the joint log-loss read its outputs too (posthoc.SplitOutputs). A run without
periodic evaluation or top-k selection (which use the Evaluator's own program) compiles
one evaluation program at its end instead of three, and passes over the test split once.
"""

from typing import Any

from dist_ens.data import Split, corruptions
from dist_ens.eval import shift as shift_lib, shift_spec


class SplitPredictions:
  """Predictions of whole splits from the run's current state (see the module docstring).

  Example:
    predictions = SplitPredictions()
    predictions.predict(call, call.session.run_data.dataset.test).metrics['ensemble']['nll']
  """

  def __init__(self):
    self._evaluator: shift_lib.PredictionEvaluator | None = None
    self.frame: shift_lib.InputFrame | None = None  # how eval.shift corrupts on device
    self._state_id: tuple[int, int] | None = None
    self._clean: dict[int, tuple[Split, shift_lib.SplitPrediction]] = {}

  def evaluator(self, call: Any) -> shift_lib.PredictionEvaluator:
    """Built once: the predict step corrupts only when config.eval.shift asks for it;
    it scores with the run's evaluator (the task's metrics and the config's own)."""
    session = call.session
    if self._evaluator is None:
      spec, parts, test = session.spec, session.parts, session.run_data.dataset.test
      if spec.eval.shift and not shift_spec.tfds_name(spec.eval.shift):
        # The program holds the corruptions eval.shift names, no other.
        families = {corruptions.corruption_id(name) for name, _ in
                    shift_spec.resolve_shift(spec.eval.shift, test.x.shape[1:])}
        scale = session.run_data.scale
        if scale is not None:  # a task that standardises its inputs itself
          self.frame = shift_lib.InputFrame.fit(test.x, scale.x_std, scale.x_mean, families)
        else:
          self.frame = shift_lib.InputFrame.fit(test.x, spec.data.std or 1.0,
                                                spec.data.mean or 0.0, families)
      scorer = session.evaluator.scorer
      step = shift_lib.make_predict_step(parts.predict_model, parts.mesh, scorer.eval_batch,
                                         seed=spec.seed, frame=self.frame)
      self._evaluator = shift_lib.PredictionEvaluator(
          step, parts.mesh, min(spec.eval.batch_size, len(test.y)), session.evaluator.view,
          scorer.finalize)
    return self._evaluator

  def predict(self, call: Any, split: Split, corruption: int = 0,
              severity: int = 0) -> shift_lib.SplitPrediction:
    """`split` (corrupted by `corruption` at `severity`; 0 = clean) through every member
    of call.state; a clean split is predicted once per state."""
    if corruption or severity:
      return self.evaluator(call).predict(call.state, split, corruption, severity)
    state_id = (call.step, id(call.state))  # an action that replaces the state (PBT) renews it
    if state_id != self._state_id:
      self._state_id, self._clean = state_id, {}
    found = self._clean.get(id(split))
    if found is None or found[0] is not split:
      found = (split, self.evaluator(call).predict(call.state, split))
      self._clean[id(split)] = found
    return found[1]
