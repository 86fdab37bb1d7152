"""ModelSpec: config.model as the models read it, built once by dist_ens.config.specs.model_spec.

The models take this typed, frozen record instead of the raw config, so nothing in
dist_ens.models depends on the config's library or on fields it does not read.
Fields configs/default.py sets are required (their defaults live there, once); fields
only some models read are Optional, and None means "that model's own default", which
lives in that model's module (resnet.py, vit.py, token_transformer.py) and nowhere
else.
"""

import dataclasses
import types
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """config.model: a built-in `name`, or a user's `factory` called with `kwargs`.

  Error messages name the config field (config.model.<field>), which is where a
  user fixes a bad value.
  """
  name: str  # a key of dist_ens.models.MODELS, used when factory is ''
  factory: str  # 'package.module:factory', or '' for the built-in `name`
  # The factory's keywords; kept as a read-only copy and out of the hash (its values
  # need not be hashable), so specs stay hashable and nobody mutates the config's.
  kwargs: Mapping[str, Any] = dataclasses.field(hash=False)
  widths: tuple[int, ...]  # mlp hidden widths
  channels: tuple[int, ...]  # cnn, per conv layer
  kernel_sizes: tuple[int, ...]
  strides: tuple[int, ...]
  conv_impl: str  # 'auto', 'xla' or 'patches' (models/layers.py)
  dropout: float
  # Variant fields: None = the model's own default (see the module doc).
  depth: int | None = None  # resnet, wide_resnet, vit, token_transformer
  widen_factor: int | None = None  # wide_resnet
  patch_size: int | None = None  # vit
  hidden: int | None = None  # vit, token_transformer
  heads: int | None = None
  mlp_dim: int | None = None
  pool: str | None = None  # vit, token_transformer, Hugging Face encoders ('cls', 'mean')
  vocab_size: int | None = None  # token_transformer
  causal: bool | None = None
  # config.model.init_from when it is 'hf:PATH': the model is the one its config.json
  # describes (dist_ens.models.hf), whatever `name` says.
  hf: str | None = None

  def __post_init__(self):
    object.__setattr__(self, 'kwargs', types.MappingProxyType(dict(self.kwargs)))


# The fields a config may leave out (None: the model's own default); specs.model_spec
# reads these with .get, the others as required.
OPTIONAL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelSpec) if f.default is None)
