"""Evaluators: the steps during and after training that read the members, each a function
of the run that returns the loop actions it needs (evaluator.py), the built-in ones named in
registry.py in the order they run, one file each: the test and validation metrics and OOD
detection (metrics.py), each member group's own ensemble (groups.py), held-out scores
(held_out.py), top-k selection (top_k.py), population-based training (pbt.py), the
post-hoc steps (a method's collected members, method_members.py; MC dropout,
mc_dropout.py; temperature scaling, temperature.py; greedy selection, greedy.py; what they
share, posthoc.py), the last-layer
Laplace approximation (laplace.py), joint predictions (joint.py), distillation
(distill.py), selective prediction, conformal sets and evaluation under shift
(decisions.py), the homoscedastic noise fit (noise.py); the one pass over a split they
share (predictions.py).
"""
