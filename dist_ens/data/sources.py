"""Datasets small enough to ship or generate offline: MNIST-1D and scikit-learn's digits.

Both load fully into host memory as numpy arrays. Inputs carry a trailing channel
axis ([40, 1] for MNIST-1D, [8, 8, 1] for digits) so 1-D and 2-D models need no
guessing; the MLP flattens them.
"""

import contextlib
import hashlib
import json
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from dist_ens.errors import ConfigError

# The published MNIST-1D split: 5,000 generated examples, 4,000 train / 1,000 test.
_MNIST1D_SEED = 42
_MNIST1D_SAMPLES = 5000


class Source(Protocol):
  """Random access to a split: what the batch pipeline reads from."""

  @property
  def num_examples(self) -> int:
    ...

  def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x float32 [n, *input_shape], y int32 [n]) for the given example indices."""


class Split(NamedTuple):
  """A split held in memory; it is also a Source."""
  x: np.ndarray  # float32 [N, *input_shape]
  y: np.ndarray  # int32 [N]

  @property
  def num_examples(self) -> int:
    return len(self.y)

  def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return self.x[indices], self.y[indices]


class Subset(NamedTuple):
  """The examples `indices` of another source, renumbered 0..len(indices)-1."""
  source: Source
  indices: np.ndarray

  @property
  def num_examples(self) -> int:
    return len(self.indices)

  def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return self.source.read(self.indices[indices])


class Dataset(NamedTuple):
  name: str
  train: Source  # Read batch by batch.
  test: Split  # Held in memory for evaluation.
  num_classes: int
  input_shape: tuple[int, ...]


def cache_dir() -> Path:
  """Where generated data is cached: $DIST_ENS_CACHE or ~/.cache/dist_ens."""
  return Path(os.environ.get('DIST_ENS_CACHE', Path.home() / '.cache' / 'dist_ens'))


@contextlib.contextmanager
def _isolated_global_rng():
  """mnist1d seeds numpy's and Python's global RNGs; put back whatever was there."""
  np_state, py_state = np.random.get_state(), random.getstate()
  try:
    yield
  finally:
    np.random.set_state(np_state)
    random.setstate(py_state)


def _generate_mnist1d() -> dict[str, np.ndarray]:
  # mnist1d imports matplotlib.pyplot at import time; a headless backend keeps that
  # from needing a display, without changing the backend of a user's session.
  os.environ.setdefault('MPLBACKEND', 'Agg')
  from mnist1d.data import get_dataset_args, make_dataset  # pylint: disable=g-import-not-at-top
  args = get_dataset_args()
  args.seed, args.num_samples = _MNIST1D_SEED, _MNIST1D_SAMPLES
  with _isolated_global_rng():
    data = make_dataset(args)
  return {'x': data['x'], 'y': data['y'], 'x_test': data['x_test'], 'y_test': data['y_test']}


def load_mnist1d() -> Dataset:
  """MNIST-1D, generated once with the package's default arguments and cached."""
  key = hashlib.sha256(json.dumps([_MNIST1D_SEED, _MNIST1D_SAMPLES, 'v1']).encode()).hexdigest()[:12]
  path = cache_dir() / f'mnist1d_{key}.npz'
  if path.exists():
    with np.load(path) as f:
      arrays = {k: f[k] for k in f.files}
  else:
    arrays = _generate_mnist1d()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename: concurrent processes or a crash never leave a torn cache file.
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix='.npz', delete=False) as tmp:
      np.savez(tmp, **arrays)
    os.replace(tmp.name, path)
  as_split = lambda x, y: Split(x.astype(np.float32)[..., None], y.astype(np.int32))
  train = as_split(arrays['x'], arrays['y'])
  return Dataset('mnist1d', train, as_split(arrays['x_test'], arrays['y_test']), num_classes=10,
                 input_shape=train.x.shape[1:])


def load_digits() -> Dataset:
  """scikit-learn's bundled 8x8 digits (1,797 images): a fixed 80/20 split, pixels / 16.

  Raises:
    ConfigError: scikit-learn is not installed (an optional dependency).
  """
  try:
    from sklearn.datasets import load_digits as sk_digits  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError("config.data.name='digits' needs scikit-learn, which is not installed: "
                      "pip install 'dist_ens[digits]'") from None
  bunch = sk_digits()
  x = (bunch.images / 16.0).astype(np.float32)[..., None]
  y = bunch.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(y))
  n_train = int(0.8 * len(y))
  train, test = order[:n_train], order[n_train:]
  return Dataset('digits', Split(x[train], y[train]), Split(x[test], y[test]), num_classes=10,
                 input_shape=x.shape[1:])


# data.name -> loader.
SOURCES: dict[str, Callable[[], Dataset]] = {
    'mnist1d': load_mnist1d,
    'digits': load_digits,
}
