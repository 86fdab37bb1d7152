"""What a trained ensemble's predictions are, and how raw inputs become model inputs
(dist_ens.Ensemble.predict gives these; the report and the student read them)."""

from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from dist_ens import data
from dist_ens.eval import regression

Preprocess = Callable[[np.ndarray], np.ndarray]

# One program for the mixture's moments (run eagerly, each array operation compiled its own).
_mixture_moments = jax.jit(regression.mixture_moments)


class GaussianPrediction(NamedTuple):
  """A regression ensemble's prediction for N inputs, in the targets' units (numpy):
  [N] (or [N, D] for D targets); the members' [M, N] (or [M, N, D])."""
  mean: np.ndarray  # the mixture's mean
  variance: np.ndarray  # total: aleatoric + epistemic
  aleatoric: np.ndarray  # mean of the members' variances
  epistemic: np.ndarray  # variance of the members' means
  member_mean: np.ndarray
  member_variance: np.ndarray

  @classmethod
  def mixture(cls, means: np.ndarray, variances: np.ndarray,
              included: np.ndarray) -> 'GaussianPrediction':
    """The mixture of the `included` members' Gaussians (means, variances [M, N, ...])."""
    moments = _mixture_moments(means, variances, included)
    return cls(mean=np.asarray(moments.mean), variance=np.asarray(moments.total),
               aleatoric=np.asarray(moments.aleatoric),
               epistemic=np.asarray(moments.epistemic), member_mean=means,
               member_variance=variances)


class Prediction(NamedTuple):
  """The ensemble's prediction for N inputs (numpy arrays on the host)."""
  probs: np.ndarray  # [N, C] mean of the (non-frozen) members' probabilities
  member_probs: np.ndarray  # [M, N, C] every member's probabilities
  entropy: np.ndarray  # [N] predictive entropy H[probs], nats
  mutual_information: np.ndarray  # [N] H[probs] - mean_m H[member_probs[m]]


def preprocess_for(spec: data.DataSpec, input_shape: tuple[int, ...]) -> Preprocess:
  """The preprocessing a run's raw inputs get between the dataset and the model.

  The data pipeline's own `data.preprocess` (uint8 images / 255, then
  spec.mean / std per channel, config.data's; a float32 cast), then the trailing channel
  axis the pipeline adds to single-channel data, so raw MNIST-1D [N, 40] signals or
  [N, 28, 28] uint8 images are accepted as well as [N, ..., 1].

  Example:
    >>> prep = preprocess_for(data.DataSpec('mnist1d'), (40, 1))
    >>> prep(np.zeros((3, 40))).shape
    (3, 40, 1)

  Args:
    spec: the run's data spec (dist_ens.config.specs.data_spec of its config).
    input_shape: the model's input shape, without the batch axis.

  Returns:
    A function from a batch of raw inputs to the model's inputs.
  """
  input_shape = tuple(input_shape)

  def preprocess(x: np.ndarray) -> np.ndarray:
    x = data.preprocess(np.asarray(x), spec)
    if x.shape[1:] == input_shape:
      return x
    if input_shape[-1] == 1 and x.shape[1:] == input_shape[:-1]:
      return x[..., None]
    raise ValueError(f'predict() takes a batch of inputs of shape [N, *{input_shape}] (or '
                     f'[N, *{input_shape[:-1]}] for one channel); got {x.shape}.')

  return preprocess


# Model inputs already: only the dtype (float32, or int32 token ids) is set.
_NO_PREPROCESSING = data.DataSpec('')


def model_inputs(x: np.ndarray, preprocessed: bool, preprocess: Preprocess) -> np.ndarray:
  """`x` as the model takes it: `preprocess(x)` for raw inputs; for inputs already
  preprocessed, only the dtype set."""
  return data.preprocess(np.asarray(x), _NO_PREPROCESSING) if preprocessed else preprocess(x)
