"""Model registry: config.model.name -> a constructor of a pure single-member model.

Every model is a `Model(init, apply)` pair of pure functions over one member's
parameters; dist_ens vmaps them over the member axis itself, so a model never
knows it is part of an ensemble.
"""

from collections.abc import Callable

import ml_collections

from dist_ens.errors import ConfigError
from dist_ens.models.base import Model
from dist_ens.models.cnn import make_cnn
from dist_ens.models.mlp import make_mlp

# name -> constructor(model_config, num_classes) -> Model
MODELS: dict[str, Callable[[ml_collections.ConfigDict, int], Model]] = {
    'mlp': make_mlp,
    'cnn': make_cnn,
}


def get_model(model_config: ml_collections.ConfigDict, num_classes: int) -> Model:
  """Builds the model that `model_config.name` names."""
  try:
    constructor = MODELS[model_config.name]
  except KeyError:
    raise ConfigError(
        f'config.model.name={model_config.name!r} is not a known model; '
        f'use one of {sorted(MODELS)}.') from None
  return constructor(model_config, num_classes)


__all__ = ['MODELS', 'Model', 'get_model', 'make_cnn', 'make_mlp']
