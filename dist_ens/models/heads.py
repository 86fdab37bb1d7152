"""Which leaves of a model's params are its output head.

A head ensemble's diversity comes from a fresh head per member on a shared (or
pretrained) body, so starting members from pretrained weights (io/init_from.py)
needs to know the head: a subtree named like one (HEAD_NAMES: the built-in models'
'head', common names in Flax, Haiku and Hugging Face models), else the layer of the
last kernel that maps to the model's outputs (the MLP's last list entry, a linen
'Dense_3').
"""

import re
from typing import Any

import jax

from dist_ens.parallel.sharding_rules import path_names

PyTree = Any
HEAD_NAMES = frozenset({'head', 'classifier', 'lm_head', 'logits', 'output_layer'})


def _natural(names: tuple[str, ...]) -> tuple:
  """A sort key that orders 'Dense_10' after 'Dense_2' and list index 10 after 9."""
  return tuple(tuple((0, int(t), '') if t.isdigit() else (1, 0, t) for t in re.split(r'(\d+)', n))
               for n in names)


def head_paths(params: PyTree, num_outputs: int) -> frozenset[str]:
  """The '/'-joined names of the head's leaves in one member's `params` (arrays or
  ShapeDtypeStructs); empty when no head is found.

  Args:
    params: one member's parameters (no member axis).
    num_outputs: the model's outputs per example (a classifier's classes, times its
      heads for MIMO): the fallback looks for the last kernel with that many outputs.
  """
  leaves = [(path_names(path), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]
  named = [names for names, _ in leaves if HEAD_NAMES.intersection(names)]
  if named:
    return frozenset('/'.join(names) for names in named)
  kernels = [names[:-1] for names, leaf in leaves
             if len(leaf.shape) >= 2 and leaf.shape[-1] == num_outputs]
  if not kernels:
    return frozenset()
  layer = max(kernels, key=_natural)
  return frozenset('/'.join(names) for names, _ in leaves if names[:len(layer)] == layer)
