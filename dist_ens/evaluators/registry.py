"""The built-in evaluators by name, in the order they run at a step (each one line: the
function that gives its actions for a run, dist_ens.evaluators.evaluator): the test metrics
first, the post-hoc steps after the evaluations they read, PBT before the checkpoint.
config.eval.evaluators' own run after them; the trainer puts the checkpoint last.
"""

from dist_ens.evaluators import (decisions, distill, greedy, held_out, joint, laplace,
                                 mc_dropout, method_members, metrics, noise, pbt, stacks,
                                 temperature, top_k)
from dist_ens.evaluators.evaluator import Evaluator

EVALUATORS: dict[str, Evaluator] = {
    'noise': noise.evaluator,  # the homoscedastic noise, before the evaluations use it
    'test': metrics.evaluate,
    'stacks': stacks.evaluator,  # each stack's ensemble (member groups)
    'ood': metrics.score_ood,
    'validation': metrics.validate,
    'held_out': held_out.evaluator,
    'top_k': top_k.select_top_k,
    'pbt': pbt.evaluator,  # after the step's evaluations, before its checkpoint
    'method_members': method_members.evaluator,  # snapshots, SWAG samples
    'mc_dropout': mc_dropout.evaluator,
    'temperature': temperature.evaluator,
    'greedy': greedy.evaluator,
    'laplace': laplace.evaluator,
    'joint': joint.evaluator,
    'distill': distill.evaluator,
    'decisions': decisions.evaluator,  # selective, conformal, eval.shift
}
