"""config.eval.shift -> the (corruption, severity) pairs a shift evaluation runs.

Read once at the edge (configuration.validate checks names and severities; build_run
checks them against the data's input shape), so a typo fails before anything is
compiled or written, with the list of what works.
"""

from collections.abc import Sequence

from dist_ens.data import corruptions
from dist_ens.errors import ConfigError

FIELD = 'config.eval.shift'


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
