"""config.ensemble.own='lora': LoRA ensembles (Hu et al. 2021; Wang et al. 2023, arXiv
2310.00035), M rank-r adapters on one frozen backbone.

Each targeted kernel W (config.ensemble.lora_targets; default every 2-D kernel but the
head) is shared and frozen as any shared leaf of ensembles/own.py, and each member m owns
two factors: A_m [in, r] (normal / sqrt(in), from (seed, member)) and B_m [r, out] (zeros,
so every member's first forward pass is the pretrained model's). Member m's kernel is

  W + (alpha / r) * A_m @ B_m        (a kernel of more axes is read as [prod(leading), out])

The head stays each member's own and trained, as with own='head'. The kernel's entry in
the train state (batchensemble.py's entries) is

  {'shared': W, 'lora_scale': alpha / r, 'lora_a': A [M, in, r], 'lora_b': B [M, r, out]}

W and the scale are stored once and frozen (no gradient, no optimizer state; with
config.ensemble.train_shared W trains as every shared leaf does, the scale never); A and B are
stacked over 'member' and trained. Holding the scale in the state makes a checkpoint
self-describing: evaluation, Ensemble.load, member(i), export and init_from of a LoRA
workdir all form merged kernels with batchensemble.member_params, without the config.

Why a params transform and not x @ W + (x @ A) @ B: the merged kernel is formed from the
params before model.apply, so any model (Flax, Equinox, Haiku, plain JAX) is adapted
without being edited or intercepted (Flax interceptors would cover linen only, and
Equinox/Haiku/plain models have no hook), and the backward pass reaches A and B through
the merge. The cost: each member's step forms a W-sized temporary per adapted kernel (its
forward and the matching cotangent), so a step's activation memory holds a backbone per
member in flight, where x @ W + (x @ A) @ B would hold only r-wide activations; the
stored state, the optimizer and the checkpoint hold W once either way.
"""

import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dist_ens.core.model import is_kernel
from dist_ens.errors import ConfigError
from dist_ens.parallel.sharding_rules import path_str

PyTree = Any
A, B, SCALE = 'lora_a', 'lora_b', 'lora_scale'
FIELD = 'config.ensemble'


class Lora(NamedTuple):
  """config.ensemble's LoRA fields, resolved on a model's params."""
  targets: frozenset[str]  # the '/'-joined names of the adapted kernels
  rank: int
  scale: float  # alpha / rank


def _number(value: Any) -> bool:
  return not isinstance(value, bool) and isinstance(value, (int, float))


def resolve(params: PyTree, owned: frozenset[str], rank: Any, alpha: Any,
            targets: Any) -> Lora:
  """The kernels to adapt in one member's `params` (ShapeDtypeStructs), every
  kernel of 2 axes or more whose name `targets` searches ('': every 2-D kernel), the
  `owned` head left out.

  Raises:
    ConfigError: a rank that is not an int >= 1, an alpha < 0, a targets regex that does
      not compile or names no kernel.
  """
  if not _number(rank) or rank != int(rank) or rank < 1:
    raise ConfigError(f'{FIELD}.lora_rank={rank!r} must be an int >= 1 (the adapters\' '
                      'rank r; e.g. 8).')
  if not _number(alpha) or alpha < 0:
    raise ConfigError(f'{FIELD}.lora_alpha={alpha!r} must be a number >= 0 (the scale is '
                      'alpha / rank; 0 = the rank, a scale of 1).')
  if not isinstance(targets, str):
    raise ConfigError(f"{FIELD}.lora_targets={targets!r} must be a regex of kernel names "
                      "(e.g. 'attn/|mlp/'), or '' for every 2-D kernel but the head.")
  leaves = [(path_str(path), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]
  if targets:
    try:
      pattern = re.compile(targets)
    except re.error as e:
      raise ConfigError(f'{FIELD}.lora_targets={targets!r} is not a regular expression: '
                        f'{e}.') from None
    chosen = {n for n, leaf in leaves if pattern.search(n) and is_kernel(leaf)}
  else:
    chosen = {n for n, leaf in leaves if len(leaf.shape) == 2 and is_kernel(leaf)}
  chosen -= owned
  if not chosen:
    kernels = [n for n, leaf in leaves if is_kernel(leaf) and n not in owned]
    raise ConfigError(f"{FIELD}.lora_targets={targets!r} names no kernel to adapt (of 2 axes "
                      f"longer than 1, the head {sorted(owned)} left out); the model's are "
                      f'{", ".join(kernels[:6]) or "none"}{", ..." if len(kernels) > 6 else ""}.')
  rank = int(rank)
  return Lora(frozenset(chosen), rank, float(alpha or rank) / rank)


def entry(kernel: jax.Array, lora: Lora, keys: jax.Array, index: int) -> dict[str, jax.Array]:
  """The train state's entry of one adapted kernel from M members' initial kernels
  [M, ...]: member 0's as the shared W (the file's, or a function of the seed), and
  per member A from its key (folded with the leaf's `index`) and B = 0."""
  w = kernel[0]
  fan_in, out = math.prod(w.shape[:-1]), w.shape[-1]
  draw = lambda key: jax.random.normal(jax.random.fold_in(key, index), (fan_in, lora.rank),
                                       w.dtype) / math.sqrt(fan_in)
  return {'shared': w, SCALE: jnp.asarray(lora.scale, jnp.float32),
          A: jax.vmap(draw)(keys), B: jnp.zeros((len(keys), lora.rank, out), w.dtype)}


def form(entry: dict[str, Any]) -> Any:
  """One member's kernel from its view of an entry: W + scale * A @ B (numpy or JAX)."""
  w = entry['shared']
  delta = (entry[A] @ entry[B]).reshape(w.shape) * entry[SCALE]
  return (w + delta).astype(w.dtype)
