"""Choosing how each device runs its members (vmap or lax.map) and how many steps
one call of the compiled step runs, where the config says 'auto'.

The rule is data: for a backend and a model family, which form was fastest at
how many members per device, measured by benchmarks/throughput.py (the table and
its evidence are in BENCHMARKS.md). Anything not listed gets 'vmap', the form
that is never far off for matmul-bound models.
"""

import math

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


# train.steps_per_call = 0 ('auto'): on an accelerator, the most steps per call up to
# this many (benchmarks/steps_per_call.py on an H100: 3.2x at 10 and 4.9x at 100 for
# the default run, most of the gain by 50), while K batches of input stay under
# AUTO_INPUT_BYTES; on a CPU the step dominates and 1 is kept.
AUTO_MAX_STEPS_PER_CALL = 100
AUTO_INPUT_BYTES = 64 * 2**20


def steps_per_call(config: ml_collections.ConfigDict, platform: str, start_step: int = 0,
                   input_bytes_per_step: int = 0) -> int:
  """config.train.steps_per_call, with 0 ('auto') resolved.

  'auto' is 1 on a CPU. Elsewhere it is the largest K <= AUTO_MAX_STEPS_PER_CALL that
  divides every cadence the loop stops at (train.steps, log_every, eval_every,
  checkpoint.every, and the step a run resumes from), and whose K batches of input
  (input_bytes_per_step each) stay under AUTO_INPUT_BYTES.
  """
  chosen = config.train.steps_per_call
  if chosen or platform == 'cpu':
    return chosen or 1
  cadence = 0
  for every in (config.train.steps, config.train.log_every, config.train.eval_every,
                config.checkpoint.every, start_step):
    cadence = math.gcd(cadence, every)  # gcd(x, 0) = x: an eval_every of 0 adds nothing.
  bound = min(AUTO_MAX_STEPS_PER_CALL,
              max(1, AUTO_INPUT_BYTES // max(input_bytes_per_step, 1)))
  return max(k for k in range(1, bound + 1) if cadence % k == 0)
