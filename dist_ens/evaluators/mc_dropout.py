"""MC dropout as a post-hoc step: test metrics with K dropout samples per member
(config.eval.mc_samples), and OOD scores by them (dist_ens.evaluators.posthoc says what
the steps share)."""

from typing import Any

import numpy as np
from absl import logging

from dist_ens.errors import ConfigError
from dist_ens.evaluators import posthoc
from dist_ens.evaluators.evaluator import EvalRun
from dist_ens.training.loop import Call, PeriodicAction


class McDropout(posthoc.Posthoc):
  """Test metrics with `samples` MC dropout samples per member, under 'mc_dropout'
  (and, with config.eval.ood_dataset, OOD AUROC/AUPR under 'mc_dropout.ood').

  The model must sample its dropout when called with train=False and an rng
  (dist_ens.core.model); one that ignores the rng gives the plain metrics, and a
  warning says so.
  """
  needs_validation = False

  def __init__(self, samples: int, cache: posthoc.SplitOutputs | None = None):
    if samples < 1:
      raise ConfigError(f'config.eval.mc_samples={samples}: McDropout needs at least 1 sample.')
    super().__init__(cache)
    self.samples = samples

  def run(self, call: Call) -> None:
    session = call.session
    scorer, test = session.evaluator.scorer, session.run_data.dataset.test
    outputs = self.cache.get(call, 'test', self.samples)
    results = scorer.metrics(outputs, test.y, posthoc.included(call))
    plain = scorer.metrics(self.cache.get(call, 'test'), test.y, posthoc.included(call))
    if _same(results, plain):
      logging.warning('MC dropout with %d samples equals plain evaluation: the model has no '
                      'dropout, or ignores rng when train=False (see docs/ensemble_methods.md).',
                      self.samples)
    session.results['mc_dropout'] = {'samples': self.samples, **results}
    if session.run_data.ood is not None:  # OOD AUROC/AUPR by the MC predictions' uncertainty.
      session.results['mc_dropout']['ood'] = {
          'dataset': session.spec.eval.ood_dataset,
          **scorer.ood(outputs, self.cache.get(call, 'ood', self.samples), test.y,
                       posthoc.included(call))}
    if session.writes_final_events:
      session.write({'step': call.step, 'split': 'test_mc_dropout', **results})
    logging.info('MC dropout (%d samples per member) test metrics:\n%s', self.samples,
                 posthoc.before_after_table(plain, results, session.parts.task,
                                    ('plain', f'MC dropout x{self.samples}')))


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
  """Whether two evaluations' ensemble metrics agree to rounding."""
  keys = [k for k, v in a['ensemble'].items() if isinstance(v, float)]
  return all(np.isclose(a['ensemble'][k], b['ensemble'][k], rtol=1e-5, atol=1e-6) for k in keys)


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """McDropout where config.eval.mc_samples > 0."""
  samples = run.spec.eval.mc_samples
  return [McDropout(samples, run.outputs)] if samples else []
