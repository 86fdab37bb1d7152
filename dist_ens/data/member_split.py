"""K-fold and repeated hold-out as one program: each member its own training subset.

config.data.member_split names a family of S splits of the training pool (the training
split, after any validation examples are carved off):

  'kfold:K'            K folds of one seeded permutation (sizes differ by at most one);
                       split k holds fold k out and trains on the other K - 1.
  'holdout:S'          S independent random hold-outs of 10% each ...
  'holdout:S:F'        ... or of the fraction F; split s is dist_ens.data.uci.uci_split(N, s,
                       F, seed): with the whole of a UCI set as the pool and seed 0 these are
                       the protocol's splits, the ones load_uci(name, split_index=s) gives.
  'blocks:S'           S contiguous blocks of the pool, in order (N a multiple of S); split
                       s trains on block s and holds nothing out: S data sets of one shape
                       concatenated (e.g. S synthetic problems) train as one program.

M = config.num_members must be a multiple of S: members [s * E, (s + 1) * E), E = M / S,
form split s's ensemble. They train on split s's training part only (their batches come
from it) and are evaluated on its held-out part (evaluators/held_out.py); results are
aggregated over the S splits as mean and standard error. So 20 splits x 5 members of a UCI
set train as one compiled run of 100 members.

Everything here depends on (spec, N, M, seed) only: not on the mesh or the process count.
"""

import math
from typing import NamedTuple

import numpy as np

from dist_ens.data import uci
from dist_ens.errors import ConfigError

KINDS = ('kfold', 'holdout', 'blocks')  # The forms' names, before the first ':'.
_DEFAULT_HOLDOUT = 0.1
# Keeps the k-fold permutation's random stream apart from the batch orders' streams.
_KFOLD_STREAM = 11


class MemberSplits(NamedTuple):
  """S splits of a pool of N examples, and which members train on which."""
  spec: str  # config.data.member_split, as given
  train: tuple[np.ndarray, ...]  # per split: sorted pool indices it trains on
  held_out: tuple[np.ndarray, ...]  # per split: sorted pool indices it is evaluated on
  members_per_split: int  # E: members [s * E, (s + 1) * E) belong to split s

  @property
  def count(self) -> int:
    return len(self.train)

  def split_of(self, member: int) -> int:
    return member // self.members_per_split

  def member_pools(self, num_members: int) -> list[np.ndarray]:
    """Each member's training indices (its split's), in member order."""
    return [self.train[self.split_of(m)] for m in range(num_members)]


def parse(spec: str) -> tuple[str, int, float]:
  """'kfold:K' / 'holdout:S[:F]' / 'blocks:S' -> (kind, count, held-out fraction; 0 for k-fold
  and blocks).

  Raises:
    ConfigError: naming config.data.member_split and the forms that work.
  """
  forms = ("'kfold:K' (e.g. 'kfold:5'), 'holdout:S' or 'holdout:S:F' (e.g. 'holdout:20:0.1'), "
           "'blocks:S'")
  bad = ConfigError(f'config.data.member_split={spec!r}; use {forms}, or \'\' for none.')
  parts = spec.split(':')
  if parts[0] not in KINDS or not 2 <= len(parts) <= (3 if parts[0] == 'holdout' else 2):
    raise bad
  try:
    count = int(parts[1])
    fraction = float(parts[2]) if len(parts) == 3 else _DEFAULT_HOLDOUT
  except ValueError:
    raise bad from None
  if parts[0] == 'kfold':
    if count < 2:
      raise ConfigError(f'config.data.member_split={spec!r}: k-fold needs K >= 2 folds.')
    return 'kfold', count, 0.0
  if parts[0] == 'blocks':
    if count < 1:
      raise ConfigError(f'config.data.member_split={spec!r}: needs S >= 1 blocks.')
    return 'blocks', count, 0.0
  if count < 1 or not 0 < fraction < 1 or not math.isfinite(fraction):
    raise ConfigError(f'config.data.member_split={spec!r}: needs S >= 1 splits and a held-out '
                      'fraction F in (0, 1).')
  return 'holdout', count, fraction


def make_member_splits(spec: str, num_examples: int, num_members: int,
                       seed: int) -> MemberSplits:
  """The splits `spec` names of a pool of `num_examples`, for `num_members` members.

  Example:
    >>> s = make_member_splits('kfold:3', 10, 6, seed=0)
    >>> [len(t) for t in s.held_out], s.split_of(5)
    ([4, 3, 3], 2)

  Raises:
    ConfigError: a malformed spec, M not a multiple of S, or a split that leaves a side
      empty.
  """
  kind, count, fraction = parse(spec)
  if num_members % count:
    raise ConfigError(
        f'config.data.member_split={spec!r} has {count} splits; config.num_members='
        f'{num_members} must be a multiple of {count} (members per split x splits, e.g. '
        f'{count * max(1, round(num_members / count))}).')
  if kind == 'blocks':
    if num_examples % count:
      raise ConfigError(f'config.data.member_split={spec!r}: {num_examples} training examples '
                        f'do not split into {count} equal blocks; give a multiple of {count}.')
    train = tuple(np.arange(num_examples).reshape(count, -1))
    held = tuple(np.zeros(0, np.int64) for _ in range(count))
  elif kind == 'kfold':
    if count > num_examples:
      raise ConfigError(f'config.data.member_split={spec!r}: {count} folds of '
                        f'{num_examples} training examples leave a fold empty.')
    order = np.random.default_rng([seed, _KFOLD_STREAM]).permutation(num_examples)
    held = [np.sort(fold) for fold in np.array_split(order, count)]
    train = [np.setdiff1d(np.arange(num_examples), h) for h in held]
  else:
    pairs = [uci.uci_split(num_examples, s, fraction, seed) for s in range(count)]
    train, held = [p[0] for p in pairs], [p[1] for p in pairs]
  return MemberSplits(spec, tuple(train), tuple(held), num_members // count)


def aggregate(values: list[float]) -> dict[str, float]:
  """Mean and standard error of the mean over splits (s.e. = sample std / sqrt(S); 0 for
  one split), as the literature's tables report them."""
  v = np.asarray(values, np.float64)
  se = float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0
  return {'mean': float(v.mean()), 'se': se}
