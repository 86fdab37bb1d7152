"""config.eval.shift -> the (corruption, severity) pairs a shift evaluation runs.

Read once at the edge (config.checks.validate checks names and severities; build_run
checks them against the data's input shape, finds the prepared TFDS configs of a
'tfds:NAME' spec and reads eval.shift_baseline's pairs), so a typo fails before anything
is compiled or written, with the list of what works.
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

from dist_ens.data import corruptions, tfds_corrupted
from dist_ens.errors import ConfigError
from dist_ens.eval import mce

FIELD = 'config.eval.shift'
TFDS = 'tfds:'  # 'tfds:NAME': every prepared NAME/<corruption>_<severity> config's test split


class ShiftSet(NamedTuple):
  """One shifted test set: corrupted on device, or a prepared TFDS config's test split."""
  corruption: str
  severity: int
  tfds_config: str = ''  # 'NAME/CONFIG' to read; '' = the test split corrupted on device


def tfds_name(spec: Any) -> str:
  """NAME of a 'tfds:NAME' spec, else ''."""
  if isinstance(spec, str) and spec.strip().startswith(TFDS):
    return spec.strip()[len(TFDS):].strip()
  return ''


def check_fields(spec: Any, baseline: Any) -> None:
  """config.checks.validate's check of eval.shift and eval.shift_baseline (no I/O)."""
  if isinstance(spec, str) and spec.strip().startswith(TFDS):
    if not tfds_name(spec) or ',' in spec or '/' in tfds_name(spec):
      raise ConfigError(f"{FIELD}={spec!r}: 'tfds:NAME' takes one TFDS dataset name and "
                        "evaluates all its prepared configs, e.g. 'tfds:cifar10_corrupted'; "
                        'it does not mix with on-device corruptions.')
  else:
    resolve_shift(spec)
  if not isinstance(baseline, str) or (baseline and not spec.strip()):
    raise ConfigError(f'config.eval.shift_baseline={baseline!r} must be a string: a finished '
                      "run's workdir (with eval.shift set too), or '' for no mCE.")


def shift_sets(spec: str, example_shape: Sequence[int], data_spec: Any) -> list[ShiftSet]:
  """The shifted test sets of eval.shift for a run's inputs (data_spec: the run's
  DataSpec, which TFDS configs are read with); ConfigError as resolve_shift's."""
  if name := tfds_name(spec):
    return [ShiftSet(*found) for found in
            tfds_corrupted.prepared_configs(name, data_spec, example_shape)]
  return [ShiftSet(name, severity) for name, severity in resolve_shift(spec, example_shape)]


def check_run(spec: str, baseline: str, example_shape: Sequence[int],
              data_spec: Any) -> list[ShiftSet]:
  """build_run's check, before training: the shifted sets of eval.shift (`spec`) exist
  for these inputs and eval.shift_baseline (if set) has every one of their pairs."""
  sets = shift_sets(spec, example_shape, data_spec)
  mce.load_baseline(baseline, [s[:2] for s in sets])
  return sets


def resolve_shift(spec: str, example_shape: Sequence[int] | None = None
                  ) -> list[tuple[str, int]]:
  """The (corruption name, severity 1..5) pairs `spec` names; [] for ''.

  Example:
    >>> resolve_shift('gaussian_noise:1-2,contrast:3')
    [('gaussian_noise', 1), ('gaussian_noise', 2), ('contrast', 3)]

  Args:
    spec: '' (off), 'all', or a comma list of 'name', 'name:k' or 'name:j-k'.
    example_shape: one input's shape; given, 'all' keeps the families that apply and a
      named one that does not is refused. Tabular inputs ([F], features in no order)
      are refused: blurs, pixelation and warps of unordered features mean nothing.

  Raises:
    ConfigError: naming config.eval.shift and listing what works.
  """
  if not isinstance(spec, str):
    raise ConfigError(f"{FIELD}={spec!r} must be a string: '', 'all' or e.g. "
                      "'gaussian_noise:1-5,contrast:3'.")
  if not spec.strip():
    return []
  if example_shape is not None and len(tuple(example_shape)) == 1:
    raise ConfigError(f'{FIELD}={spec!r}: the inputs are tabular features {tuple(example_shape)}, '
                      'which the -C corruptions (made for images [H, W, C] and signals [L, C]) '
                      "do not apply to; set eval.shift=''.")
  try:
    pairs = corruptions.resolve(spec, example_shape)
  except ConfigError as e:
    names = '' if 'valid names' in str(e) else f'; names: {", ".join(corruptions.CORRUPTIONS)}'
    raise ConfigError(f"{FIELD}={spec!r}: {e} Use 'all' or a comma list of NAME, NAME:k or "
                      f'NAME:j-k (k in 1..{corruptions.NUM_SEVERITIES}{names}).') from None
  zero = [f'{name}:0' for name, severity in pairs if severity == 0]
  if zero:
    raise ConfigError(f'{FIELD}={spec!r} asks for severity 0 ({", ".join(zero)}), which is the '
                      f'clean test set (reported already); use severities 1..'
                      f'{corruptions.NUM_SEVERITIES}.')
  return pairs
