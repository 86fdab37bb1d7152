"""The UCI regression benchmark: its text format, its random splits, and standardisation.

Files hold one example a row, whitespace-separated numbers, the target in the last column
(the format of the benchmark's usual copies; see uci_data/README.md). The protocol of the
literature (Hernandez-Lobato & Adams 2015; Lakshminarayanan et al. 2017): 20 random 90% / 10%
train/test splits, inputs and targets standardised with the TRAINING split's mean and std,
metrics reported in the original target units. This module keeps that protocol's pieces as
plain numpy: `load_uci` gives a split in original units, `Standardizer` moves between units.

Typical use:

  train, test = load_uci('uci:energy', split_index=0)
  scale = Standardizer.fit(train.x, train.y)
  x_train, y_train = scale.apply(train.x, train.y)   # what the model trains on
  ...
  mean = pred_mean * scale.y_std + scale.y_mean                 # in target units
  var = pred_var * scale.y_std ** 2
"""

import math
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dist_ens.data.sources import Split
from dist_ens.errors import ConfigError

_DATA_DIR = Path(__file__).with_name('uci_data')

# Names for 'uci:NAME' -> the file shipped inside the package (uci_data/README.md credits them).
SHIPPED: dict[str, Path] = {
    name: _DATA_DIR / f'{name}.txt' for name in ('concrete', 'energy', 'yacht', 'wine-quality-red')
}

_PREFIX = 'uci:'
# Below this a training column counts as constant: it is centred but not scaled (see fit).
_MIN_STD = 1e-8


def _parse_row(path: Path, lineno: int, fields: list[str], num_columns: int | None) -> list[float]:
  """One row's numbers, or a ConfigError that names the file, the line and what is wrong."""
  where = f'{path}, line {lineno}'
  if len(fields) < 2:
    raise ConfigError(f'{where}: {len(fields)} column; a UCI file needs at least one feature and '
                      'the target (last column).')
  if num_columns is not None and len(fields) != num_columns:
    raise ConfigError(f'{where}: {len(fields)} columns where the rows above have {num_columns}.')
  values = []
  for column, text in enumerate(fields):
    what = 'the target' if column == len(fields) - 1 else f'feature {column}'
    try:
      value = float(text)
    except ValueError:
      raise ConfigError(f'{where}: {what} is {text!r}, not a number.') from None
    if not math.isfinite(value):
      raise ConfigError(f'{where}: {what} is {text!r}; values must be finite.')
    values.append(value)
  return values


def read_uci(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
  """Reads a UCI regression file: whitespace-separated numbers, the target last.

  Blank lines and lines starting with '#' are skipped. Targets stay floating point.

  Example:
    >>> x, y = read_uci(SHIPPED['yacht'])
    >>> x.shape, y.shape, y.dtype
    ((308, 6), (308,), dtype('float32'))

  Args:
    path: the text file.

  Returns:
    (x float32 [N, F], y float32 [N]).

  Raises:
    ConfigError: for a missing or empty file, or a row that is ragged, holds something that is
      not a number, a NaN or an infinity, or has fewer than two columns; the message names the
      file and the line.
  """
  path = Path(path)
  try:
    text = path.read_text()
  except OSError as e:
    raise ConfigError(f'UCI data file {path} cannot be read: {e.strerror or e}.') from None
  rows, num_columns = [], None
  for lineno, line in enumerate(text.splitlines(), start=1):
    fields = line.split()
    if not fields or fields[0].startswith('#'):
      continue
    rows.append(_parse_row(path, lineno, fields, num_columns))
    num_columns = len(fields)
  if not rows:
    raise ConfigError(f'UCI data file {path} holds no rows.')
  data = np.asarray(rows, np.float64)
  return data[:, :-1].astype(np.float32), data[:, -1].astype(np.float32)


def uci_split(num_examples: int, split_index: int, test_fraction: float = 0.1,
              seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """The protocol's random train/test split number `split_index`.

  The permutation comes from numpy's Generator seeded with (seed, split_index), so a split
  depends only on those two and the number of examples, never on other splits.

  Example:
    >>> train, test = uci_split(10, split_index=0)
    >>> len(train), len(test), sorted(np.concatenate([train, test]).tolist()) == list(range(10))
    (9, 1, True)

  Args:
    num_examples: N, the rows of the data set.
    split_index: which of the protocol's splits (0, 1, ...).
    test_fraction: the share of examples held out, rounded to a whole count of at least one.
    seed: the seed of the split family (runs with the same seed see the same splits).

  Returns:
    (train_idx, test_idx): disjoint, sorted int64 index arrays covering range(num_examples).

  Raises:
    ConfigError: for a negative seed or split_index, or a split that leaves a side empty.
  """
  if seed < 0 or split_index < 0:
    raise ConfigError(f'UCI split: seed={seed} and split_index={split_index} must be >= 0.')
  num_test = max(1, int(round(test_fraction * num_examples)))
  if not 0 < test_fraction < 1 or num_test >= num_examples:
    raise ConfigError(f'UCI split: test_fraction={test_fraction} of {num_examples} examples '
                      'leaves no training or no test example; use a value in (0, 1).')
  order = np.random.default_rng([seed, split_index]).permutation(num_examples)
  return np.sort(order[num_test:]), np.sort(order[:num_test])


class Standardizer(NamedTuple):
  """Per-column mean and std of a training split, for inputs and target.

  Standardised values are (value - mean) / std. A column constant on the training split has
  std 1 (it is centred, not scaled): a floor near zero would blow a test value that differs
  from the constant up to ~1e8.
  """
  x_mean: np.ndarray  # float32 [F]
  x_std: np.ndarray  # float32 [F]
  y_mean: np.ndarray  # float32 [] (or [D] for targets [N, D])
  y_std: np.ndarray  # float32 [] (or [D])

  @classmethod
  def fit(cls, x: np.ndarray, y: np.ndarray) -> 'Standardizer':
    """The statistics of a training split: x [N, F], y [N] or [N, D] (population std)."""
    def stats(a):
      a = np.asarray(a, np.float64)  # float64 sums: float32 loses digits on large offsets
      mean, std = a.mean(axis=0), a.std(axis=0)
      return mean.astype(np.float32), np.where(std < _MIN_STD, 1.0, std).astype(np.float32)
    return cls(*stats(x), *stats(y))

  def apply(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) in standardised units, float32."""
    return self.apply_inputs(x), ((np.asarray(y) - self.y_mean) / self.y_std).astype(np.float32)

  def apply_inputs(self, x: np.ndarray) -> np.ndarray:
    """Inputs in standardised units, float32 (for prediction, where there is no target)."""
    return ((np.asarray(x) - self.x_mean) / self.x_std).astype(np.float32)


def resolve_uci_name(name: str) -> Path:
  """The file that a data name 'uci:NAME' (a shipped set) or 'uci:PATH' (a file) means.

  Example:
    >>> resolve_uci_name('uci:energy').name
    'energy.txt'

  Raises:
    ConfigError: `name` does not start with 'uci:', or names neither a shipped set nor an
      existing file; the message lists the shipped names.
  """
  shipped = ', '.join(f"'uci:{n}'" for n in SHIPPED)
  if not name.startswith(_PREFIX):
    raise ConfigError(f'{name!r} is not a UCI data name; use one of {shipped} or '
                      "'uci:/path/to/file.txt'.")
  rest = name[len(_PREFIX):]
  if rest in SHIPPED:
    return SHIPPED[rest]
  path = Path(rest).expanduser()
  if not path.is_file():
    raise ConfigError(f'{name!r}: no shipped UCI set of that name and no file {path}; shipped: '
                      f"{shipped}; other files by path ('uci:/path/to/kin8nm.txt').")
  return path


def load_uci(name: str, split_index: int = 0, seed: int = 0,
             test_fraction: float = 0.1) -> tuple[Split, Split]:
  """A UCI data set's train and test split, in ORIGINAL units.

  Standardise with `Standardizer.fit(train.x, train.y)`; the test split must not inform it.

  Example:
    >>> train, test = load_uci('uci:yacht')
    >>> train.num_examples, test.num_examples, test.y.dtype
    (277, 31, dtype('float32'))

  Args:
    name: 'uci:NAME' for a shipped set (see SHIPPED) or 'uci:PATH' for a file.
    split_index, seed, test_fraction: which split (see uci_split).

  Returns:
    (train, test) Splits with x float32 [n, F] and y float32 [n].
  """
  x, y = read_uci(resolve_uci_name(name))
  train, test = uci_split(len(y), split_index, test_fraction, seed)
  return Split(x[train], y[train]), Split(x[test], y[test])
