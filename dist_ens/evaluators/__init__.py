"""Evaluators: the steps during and after training that read the members, each a function
of the run that returns the loop actions it needs (evaluator.py), the built-in ones named in
registry.py in the order they run, one file each: the test and validation metrics and OOD
detection (metrics.py), each member group's own ensemble (groups.py), held-out scores
(held_out.py), top-k selection (top_k.py), population-based training (pbt.py), MC dropout,
temperature scaling, greedy selection and collected members (posthoc.py), the last-layer
Laplace approximation (laplace.py), joint predictions (joint.py), distillation
(distill.py), selective prediction, conformal sets and evaluation under shift
(decisions.py), the homoscedastic noise fit (noise.py); the one pass over a split they
share (predictions.py).
"""
