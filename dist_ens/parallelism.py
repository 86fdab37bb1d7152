"""Choosing how each device runs its members: vmap or lax.map ('auto').

The rule is data: each entry says which form was fastest for a model family on a
backend, from benchmarks/throughput.py (see BENCHMARKS.md). Anything not listed
gets 'vmap', the form that is never far off for matmul-bound models.
"""

import ml_collections

from dist_ens.ensemble import MEMBER_PARALLELISM
from dist_ens.errors import ConfigError

CHOICES = MEMBER_PARALLELISM + ('auto',)

# (backend platform, model name) -> (parallelism, map_batch_size or None).
AUTO_RULES: dict[tuple[str, str], tuple[str, int | None]] = {
    ('cpu', 'mlp'): ('vmap', None),
    ('cpu', 'cnn'): ('vmap', None),
}


def resolve(ensemble_config: ml_collections.ConfigDict, model_name: str,
            platform: str) -> tuple[str, int | None]:
  """(parallelism, map_batch_size) for the step, resolving 'auto' by AUTO_RULES."""
  choice = ensemble_config.member_parallelism
  if choice not in CHOICES:
    raise ConfigError(f'config.ensemble.member_parallelism={choice!r}; use one of {list(CHOICES)}.')
  chunk = ensemble_config.map_batch_size
  if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
    raise ConfigError(f'config.ensemble.map_batch_size={chunk!r} must be an int >= 0 (0: one '
                      'member at a time).')
  if choice == 'auto':
    return AUTO_RULES.get((platform, model_name), ('vmap', None))
  return choice, (chunk or None)
