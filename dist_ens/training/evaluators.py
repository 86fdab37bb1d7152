"""The built-in evaluators by name, in the order they run at a step (each one line: the
function that gives its actions for a run, dist_ens.training.evaluator): the test metrics
first, the post-hoc steps after the evaluations they read, PBT before the checkpoint.
config.eval.evaluators' own run after them; the trainer puts the checkpoint last.
"""

from dist_ens.training import (actions, decision_actions, distill_action, group_ensembles,
                               held_out, joint_action, laplace_action, noise, pbt, posthoc)
from dist_ens.training.evaluator import Evaluator

EVALUATORS: dict[str, Evaluator] = {
    'noise': noise.evaluator,  # the homoscedastic noise, before the evaluations use it
    'test': actions.evaluate,
    'groups': group_ensembles.evaluator,
    'ood': actions.score_ood,
    'validation': actions.validate,
    'held_out': held_out.evaluator,
    'top_k': actions.select_top_k,
    'pbt': pbt.evaluator,  # after the step's evaluations, before its checkpoint
    'posthoc': posthoc.evaluator,  # MC dropout, temperature, greedy, collected members
    'laplace': laplace_action.evaluator,
    'joint': joint_action.evaluator,
    'distill': distill_action.evaluator,
    'decisions': decision_actions.evaluator,  # selective, conformal, eval.shift
}
