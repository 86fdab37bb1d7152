"""Choosing how each device runs its members: vmap or lax.map ('auto').

The rule is data: for a backend and a model family, which form was fastest at
how many members per device, measured by benchmarks/throughput.py (the table and
its evidence are in BENCHMARKS.md). Anything not listed gets 'vmap', the form
that is never far off for matmul-bound models.
"""

import ml_collections

from dist_ens.ensemble import MEMBER_PARALLELISM
from dist_ens.errors import ConfigError

CHOICES = MEMBER_PARALLELISM + ('auto',)

# A form: (parallelism, map_batch_size or None).
Form = tuple[str, int | None]

# (backend platform, model name) -> ((up to this many members per device, form), ...):
# the first entry whose bound is >= the members per device applies; None means any
# number. Measured with benchmarks/throughput.py, one device, batch 128 per member,
# Adam (BENCHMARKS.md):
# - 2-core CPU: vmap beat lax.map, chunked or not, for the MLPs at M = 1..64. CNNs
#   (with model.conv_impl='auto', i.e. 'patches' on a CPU) are fastest vmapped up
#   to 4 members, and as lax.map over chunks of 4 vmapped members beyond: the patches
#   of many members at once fall out of the caches.
# - H100 GPU: vmap was the fastest form for every model and M (1.0-27x lax.map).
AUTO_RULES: dict[tuple[str, str], tuple[tuple[int | None, Form], ...]] = {
    ('cpu', 'mlp'): ((None, ('vmap', None)),),
    ('cpu', 'cnn'): ((4, ('vmap', None)), (None, ('map', 4))),
    ('gpu', 'mlp'): ((None, ('vmap', None)),),
    ('gpu', 'cnn'): ((None, ('vmap', None)),),
}
DEFAULT_FORM: Form = ('vmap', None)


def auto_form(model_name: str, platform: str, members_per_device: int | None = None) -> Form:
  """The form AUTO_RULES picks; with members_per_device unknown, the rule for the most."""
  for bound, form in AUTO_RULES.get((platform, model_name), ()):
    if bound is None or (members_per_device is not None and members_per_device <= bound):
      return form
  return DEFAULT_FORM


def resolve(ensemble_config: ml_collections.ConfigDict, model_name: str, platform: str,
            members_per_device: int | None = None) -> Form:
  """(parallelism, map_batch_size) for the step, resolving 'auto' by AUTO_RULES.

  Args:
    ensemble_config: config.ensemble (member_parallelism, map_batch_size).
    model_name: config.model.name.
    platform: the devices' platform ('cpu', 'gpu', 'tpu').
    members_per_device: config.num_members // mesh.member, where the rule depends
      on it; None takes the rule for the largest count.

  Raises:
    ConfigError: naming config.ensemble.member_parallelism or map_batch_size.
  """
  choice = ensemble_config.member_parallelism
  if not isinstance(choice, str) or choice not in CHOICES:
    raise ConfigError(f'config.ensemble.member_parallelism={choice!r}; use one of {list(CHOICES)}.')
  chunk = ensemble_config.map_batch_size
  if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
    raise ConfigError(f'config.ensemble.map_batch_size={chunk!r} must be an int >= 0 (0: one '
                      'member at a time).')
  if choice == 'auto':
    return auto_form(model_name, platform, members_per_device)
  return choice, (chunk or None)
