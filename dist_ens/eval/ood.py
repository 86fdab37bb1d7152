"""Out-of-distribution inputs for config.eval.ood_dataset.

An OOD split must have the model's input shape, and the embedded datasets do not
share one (MNIST-1D is [40, 1], digits [8, 8, 1]). So besides any dataset that
dist_ens.data.load_dataset knows (embedded or TFDS; its test split is used, e.g.
mnist as OOD for fashion_mnist), this module has OOD-only sources derived from
the embedded test splits (noise and shuffles). They live here rather than in data.SOURCES because nobody
should train on them (config.data.name must not offer them). Every OOD split gets
the training data's preprocessing (config.data.mean / std).
"""

from collections.abc import Callable

import numpy as np

from dist_ens import data
from dist_ens.data import Dataset, Split
from dist_ens.errors import ConfigError

# Fixed, not config.seed: every run is scored against the same OOD examples.
_OOD_SEED = 0


def _noise_like(name: str) -> Split:
  """Gaussian noise with the per-position mean and std of dataset `name`'s test inputs."""
  x = data.load_dataset(name).test.x
  rng = np.random.default_rng(_OOD_SEED)
  noise = x.mean(0) + x.std(0) * rng.standard_normal(x.shape)
  return Split(noise.astype(np.float32), np.zeros(len(x), np.int32))


def mnist1d_noise() -> Split:
  """Gaussian noise with MNIST-1D test inputs' per-position mean and std (1,000 x [40, 1]).

  Example:
    >>> mnist1d_noise().x.shape
    (1000, 40, 1)
  """
  return _noise_like('mnist1d')


def digits_noise() -> Split:
  """Gaussian noise with the 8x8 digits' test inputs' per-pixel mean and std (360 x
  [8, 8, 1]), for runs on config.data.name='digits'.

  Example:
    >>> digits_noise().x.shape
    (360, 8, 8, 1)
  """
  return _noise_like('digits')


def mnist1d_shuffled() -> Split:
  """MNIST-1D test inputs with each signal's 40 positions randomly permuted.

  The values are those of real signals (same marginal distribution); only their
  order, the shape of the digit, is destroyed: a harder OOD set than noise.

  Example:
    >>> mnist1d_shuffled().x.shape
    (1000, 40, 1)
  """
  x = data.load_dataset('mnist1d').test.x
  rng = np.random.default_rng(_OOD_SEED)
  order = np.argsort(rng.random(x.shape[:2]), axis=1)  # An independent permutation per row.
  shuffled = np.take_along_axis(x, order[..., None], axis=1)
  return Split(shuffled.astype(np.float32), np.zeros(len(x), np.int32))


# config.eval.ood_dataset -> loader of an OOD split (labels unused, zeros).
OOD_SOURCES: dict[str, Callable[[], Split]] = {
    'mnist1d_noise': mnist1d_noise,
    'mnist1d_shuffled': mnist1d_shuffled,
    'digits_noise': digits_noise,
}


def _sources_like(name: str) -> list[str]:
  """The OOD sources derived from dataset `name` (all of them if none is)."""
  return [n for n in sorted(OOD_SOURCES) if n.startswith(f'{name}_')] or sorted(OOD_SOURCES)


def load_ood_split(name: str, dataset: Dataset, spec: data.DataSpec | None = None) -> Split:
  """The OOD split that config.eval.ood_dataset names, checked against `dataset`.

  Example:
    >>> load_ood_split('mnist1d_noise', data.load_dataset('mnist1d')).x.shape
    (1000, 40, 1)

  Args:
    name: an OOD_SOURCES name, or a dataset name for data.load_dataset (embedded
      or TFDS) whose test split is used.
    dataset: the in-distribution (training) dataset.
    spec: the training data's DataSpec; its preprocessing (mean / std) and data_dir
      apply to the OOD split too. None: no preprocessing.

  Returns:
    The OOD split, with the model's input shape.

  Raises:
    ConfigError: naming config.eval.ood_dataset, for an unknown name, the training
      dataset itself, or inputs of another shape than the model's.
  """
  if name == dataset.name:
    raise ConfigError(f'config.eval.ood_dataset={name!r} is the training dataset '
                      f'(config.data.name); name another one, e.g. one of {sorted(OOD_SOURCES)}, '
                      "or '' for none.")
  if name in OOD_SOURCES:
    split = OOD_SOURCES[name]()
    if spec is not None:
      split = Split(data.preprocess(split.x, spec), split.y)
  else:
    try:
      split = data.load_dataset(name, spec).test
    except ConfigError as e:
      raise ConfigError(f'config.eval.ood_dataset={name!r} cannot be loaded ({e}); use one of '
                        f"{sorted(OOD_SOURCES)}, another dataset, or '' for none.") from None
  if split.x.shape[1:] != dataset.input_shape:
    raise ConfigError(
        f'config.eval.ood_dataset={name!r} has inputs of shape {tuple(split.x.shape[1:])} but '
        f'the model takes {dataset.input_shape} (config.data.name={dataset.name!r}); use an '
        f'OOD set of that shape, e.g. one of {_sources_like(dataset.name)}.')
  return split
