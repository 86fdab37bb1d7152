"""Models: the built-in registry (config.model.name) or a user's factory (config.model.factory).

Every model is a `Model(init, apply)` pair of pure functions over one member's
parameters; dist_ens vmaps them over the member axis itself, so a model never
knows it is part of an ensemble. A user's own model is named by import path,
config.model.factory = 'my_pkg.nets:make_net', called with config.model.kwargs and
adapted by dist_ens.core.adapters (Flax linen / NNX, Equinox, Haiku or plain JAX).
config.model.init_from='hf:PATH' builds the model a Hugging Face checkpoint's
config.json describes (dist_ens.models.hf; `from_hf(path)` outside training).

Models read config.model as a ModelSpec (dist_ens.models.spec), which
dist_ens.config.specs.model_spec builds once; nothing here takes the raw config.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from dist_ens import importing
from dist_ens.core import adapters
from dist_ens.core.model import Model
from dist_ens.errors import ConfigError
from dist_ens.models import hf, layers
from dist_ens.models.cnn import make_cnn
from dist_ens.models.hf import from_hf
from dist_ens.models.lenet import make_lenet5
from dist_ens.models.mlp import make_mlp
from dist_ens.models.resnet import make_resnet, make_resnet18, make_wide_resnet
from dist_ens.models.spec import OPTIONAL_FIELDS, ModelSpec
from dist_ens.models.token_transformer import make_token_transformer
from dist_ens.models.vit import make_vit

# name -> constructor(spec, num_classes) -> Model
MODELS: dict[str, Callable[[ModelSpec, int], Model]] = {
    'mlp': make_mlp,
    'cnn': make_cnn,
    'lenet5': make_lenet5,
    'resnet': make_resnet,  # CIFAR ResNet, depth 6n+2 (config.model.depth: 20, 32, 56, ...)
    'resnet18': make_resnet18,
    'wide_resnet': make_wide_resnet,  # WRN-depth-widen_factor (default 28-10)
    'vit': make_vit,  # Vision Transformer (patch_size, hidden, depth, heads, mlp_dim, pool)
    # Encoder (or causal decoder) over int token ids [B, L] (vocab_size, causal, ...).
    'token_transformer': make_token_transformer,
}
# The config.model fields that size each built-in's layers: what a second network of the
# same kind (a method's, e.g. ensemble.prior.widths) may set otherwise (`resized`).
SIZE_FIELDS: dict[str, tuple[str, ...]] = {
    'mlp': ('widths',),
    'cnn': ('channels', 'kernel_sizes', 'strides'),
    'resnet': ('depth',),
    'wide_resnet': ('depth', 'widen_factor'),
    'vit': ('patch_size', 'hidden', 'depth', 'heads', 'mlp_dim'),
    'token_transformer': ('hidden', 'depth', 'heads', 'mlp_dim'),
}


def import_factory(path: str) -> Callable[..., Any]:
  """The callable that an import path 'package.module:attribute' names.

  Example:
    >>> import_factory('examples.plain_jax:make_model').__name__
    'make_model'

  Raises:
    ConfigError: the path is malformed, its module does not import or lacks the
      attribute; the message names config.model.factory and the cause in one line.
  """
  if not importing.is_import_path(path):
    raise ConfigError(f"config.model.factory={path!r} must be an import path "
                      "'package.module:factory', e.g. 'my_pkg.nets:make_net'.")
  obj = importing.load_object(path, 'config.model.factory')
  if not callable(obj):
    raise ConfigError(f'config.model.factory={path!r} is a {type(obj).__name__}, not callable.')
  return obj


def _factory_model(spec: ModelSpec, num_classes: int) -> Model:
  """The Model of config.model.factory called with config.model.kwargs."""
  factory = import_factory(spec.factory)
  kwargs = dict(spec.kwargs)  # a fresh dict: the factory may change its keywords
  try:
    return adapters.to_model(factory, num_classes, kwargs=kwargs)
  except TypeError as e:
    raise ConfigError(f'config.model.factory={spec.factory!r} with config.model.kwargs='
                      f'{kwargs!r} does not make a model: {e}') from e


def _hf_model(spec: ModelSpec, num_classes: int) -> Model:
  """The model config.model.init_from='hf:PATH' describes in its config.json (an
  encoder's padding masked, config.model.pool read: models/hf/bert.py)."""
  where = f'config.model.init_from={spec.hf!r}'
  if spec.factory:
    raise ConfigError(f'{where} builds its own model; config.model.factory='
                      f"{spec.factory!r} cannot replace it: set factory=''.")
  return hf.build(spec.hf, num_classes, layers.dropout_rate_for(spec.dropout), where,
                  training=True, pool=spec.pool)


def get_model(spec: ModelSpec, num_classes: int) -> Model:
  """The model config.model.factory names (if set), else the built-in config.model.name.

  A factory gets num_classes as a keyword when its signature has a `num_classes`
  parameter and config.model.kwargs does not set it (dist_ens.core.adapters).
  """
  if not isinstance(spec, ModelSpec):  # callers that still pass config.model itself
    raise TypeError(f'get_model takes a ModelSpec, not a {type(spec).__name__}; build one '
                    'with dist_ens.config.specs.model_spec(config).')
  if spec.hf:
    return _hf_model(spec, num_classes)
  if spec.factory:
    return _factory_model(spec, num_classes)
  check_name(spec)
  return MODELS[spec.name](spec, num_classes)


def check_name(spec: ModelSpec) -> None:
  """Raises ConfigError unless `spec` names a model get_model can look up: a built-in
  name, or a factory's import path that loads (a Hugging Face checkpoint is read later)."""
  if spec.hf:
    return
  if spec.factory:
    import_factory(spec.factory)
  elif spec.name not in MODELS:
    raise ConfigError(f'config.model.name={spec.name!r} is not a known model; '
                      f'use one of {sorted(MODELS)}.')


def resized(spec: ModelSpec, num_classes: int, fields: Mapping[str, Any], asking: str) -> Model:
  """The model `spec` builds, with the config.model `fields` set otherwise (e.g.
  {'widths': (32,)}): a second network of the run's kind, for a method (a randomized
  prior's smaller network). `asking` names the config field that asked, as
  'config.ensemble.prior.widths=(32,)', for the refusal.

  Raises:
    ConfigError: the model takes no such field (a user's factory, a Hugging Face
      model, or a built-in that does not read it; SIZE_FIELDS).
  """
  kind = (f'config.model.init_from={spec.hf!r}' if spec.hf else
          f'config.model.factory={spec.factory!r}' if spec.factory else
          f'config.model.name={spec.name!r}')
  takes = () if spec.factory or spec.hf else SIZE_FIELDS.get(spec.name, ())
  for field in fields:
    if field not in takes:
      takers = ', '.join(name for name, sized in SIZE_FIELDS.items() if field in sized)
      raise ConfigError(f'{asking} needs a model that takes config.model.{field} (built-in '
                        f'{takers or "none"}), and {kind} does not; leave it at its default.')
  return get_model(dataclasses.replace(spec, **fields), num_classes)


__all__ = ['MODELS', 'OPTIONAL_FIELDS', 'Model', 'ModelSpec', 'from_hf', 'get_model',
           'import_factory', 'make_cnn', 'make_mlp', 'resized', 'SIZE_FIELDS']
