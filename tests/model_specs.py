"""ModelSpecs for tests: configs/default.py's config.model, some fields replaced.

Built through dist_ens.config.specs.model_spec, as a run builds it, so tests restate no
default of the config's.
"""

import dataclasses
import functools
from pathlib import Path

from dist_ens.config import specs
from dist_ens import models
from dist_ens.config import loading

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / 'configs' / 'default.py'


@functools.cache
def _default() -> models.ModelSpec:
  return specs.model_spec(loading.load_config(DEFAULT_CONFIG))


def model_spec(**fields) -> models.ModelSpec:
  """The default config's ModelSpec with `fields` replaced, e.g. model_spec(name='cnn')."""
  return dataclasses.replace(_default(), **fields)
