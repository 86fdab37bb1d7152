"""An evaluator: a step during or after training that reads the members (the test
metrics, selection, post-hoc calibration, Laplace, distillation, decisions, ...), as a
value: a function of the run that returns the loop actions it needs, none where the run
does not ask for it.

  def my_evaluator(run: EvalRun) -> list[Action]:
    return [MyAction()] if run.spec.eval.ood_dataset else []

The built-in evaluators are named in dist_ens/evaluators/registry.py (one line each, in
the order they run); yours go in config.eval.evaluators by import path
('my_pkg.evals:my_evaluator') and run after them (docs/how-it-works.md, "An evaluator of
your own").
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from dist_ens import importing
from dist_ens.errors import ConfigError
from dist_ens.training.loop import Action, Call, Session
from dist_ens.evaluators.predictions import SplitPredictions


class EvalRun(NamedTuple):
  """What an evaluator builds its actions from."""
  call: Call  # the loop's first call (the restored step and state)
  predictions: SplitPredictions  # the clean test/validation predictions, shared
  outputs: Any  # posthoc.SplitOutputs: the split outputs the post-hoc steps share

  @property
  def session(self) -> Session:
    return self.call.session

  @property
  def spec(self) -> Any:
    """The run's config.specs.RunSpec."""
    return self.call.session.spec

  @property
  def task(self) -> Any:
    return self.call.session.parts.task

  @property
  def method(self) -> Any:
    return self.call.session.parts.method


Evaluator = Callable[[EvalRun], Sequence[Action]]

FIELD = 'config.eval.evaluators'


def load(paths: Sequence[str]) -> list[Evaluator]:
  """config.eval.evaluators' functions, refused in one line where one does not load or
  is not a function."""
  out = []
  for path in paths:
    fn = importing.load_object(path, FIELD)
    if not callable(fn):
      raise ConfigError(f'{FIELD} names {path!r}, a {type(fn).__name__}: name a function '
                        'fn(run: dist_ens.evaluators.evaluator.EvalRun) -> list of actions.')
    out.append(fn)
  return out
