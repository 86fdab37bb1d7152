"""Corrupted test sets prepared with TFDS (cifar10_corrupted and the like), read locally.

TFDS stores each corruption x severity of a -C benchmark as its own builder config,
'<corruption>_<severity>' (e.g. cifar10_corrupted/gaussian_noise_3); its default config
is one of them, so loading the bare name silently evaluates one corruption at severity
1 (hendrycks/robustness#29). config.eval.shift='tfds:NAME' instead evaluates every config
of NAME prepared (as ArrayRecord) under config.data.data_dir: this finds them by the
folders TFDS writes (data_dir/NAME/CONFIG/VERSION/) and checks each with TFDS itself.
Their test splits are read with the run's preprocessing, like the run's own test split
(dist_ens.data.tfds_source), without TensorFlow.

Example (prepared once, with TensorFlow):
  tfds build cifar10_corrupted/gaussian_noise_1 --file_format=array_record
  dist-ens --config=configs/cifar10_cnn.py --config.eval.shift=tfds:cifar10_corrupted
"""

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dist_ens.data.sources import Split
from dist_ens.data.spec import DataSpec
from dist_ens.data.tfds_source import TfdsSource, prepare_command
from dist_ens.errors import ConfigError

FIELD = 'config.eval.shift'
_CONFIG = re.compile(r'^(?P<corruption>[a-z][a-z0-9_]*?)_(?P<severity>[1-5])$')


def _tfds(name: str) -> Any:
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError(f"{FIELD}='tfds:{name}' reads TFDS data, which needs tensorflow-datasets: "
                      "pip install 'dist_ens[tfds]'.") from None
  return tfds


def _builder(tfds: Any, full_name: str, data_dir: str) -> Any | None:
  """The prepared builder of NAME/CONFIG, or None (not prepared, not found)."""
  try:
    builder = tfds.builder(full_name, data_dir=data_dir or None)
    return builder if builder.is_prepared() else None
  except Exception:  # pylint: disable=broad-except  # DatasetNotFoundError and kin.
    return None


def _check_shape(builder: Any, full_name: str, input_shape: Sequence[int] | None,
                 add_channel: bool) -> tuple[str, str, bool]:
  """(input key, label key, add a channel axis) of a config whose images match the run's."""
  input_key, label_key = builder.info.supervised_keys or ('image', 'label')
  shape = tuple(builder.info.features[input_key].shape)
  add = len(shape) in (1, 2) and add_channel
  found = shape + (1,) if add else shape
  if input_shape is not None and found != tuple(input_shape):
    raise ConfigError(f"{FIELD}: the prepared {full_name!r} holds inputs of shape {found}, the "
                      f'run\'s test split {tuple(input_shape)}; name the -C set of the training '
                      "data (e.g. 'tfds:cifar10_corrupted' for cifar10).")
  return input_key, label_key, add


def prepared_configs(name: str, spec: DataSpec,
                     input_shape: Sequence[int] | None = None) -> list[tuple[str, int, str]]:
  """(corruption, severity, 'NAME/CONFIG') of every prepared config of `name`, sorted.

  Raises:
    ConfigError: naming config.eval.shift, when none is prepared (saying how to prepare
      one) or their inputs do not have the run's shape.
  """
  tfds = _tfds(name)
  root = Path(spec.data_dir or tfds.core.constants.DATA_DIR).expanduser() / name
  found = []
  for folder in sorted(root.iterdir()) if root.is_dir() else []:
    match = _CONFIG.match(folder.name)
    builder = match and _builder(tfds, f'{name}/{folder.name}', spec.data_dir)
    if builder:
      _check_shape(builder, f'{name}/{folder.name}', input_shape, spec.add_channel)
      found.append((match['corruption'], int(match['severity']), f'{name}/{folder.name}'))
  if not found:
    example = prepare_command(f'{name}/gaussian_noise_1', spec.data_dir)
    raise ConfigError(f"{FIELD}='tfds:{name}': no prepared {name}/<corruption>_<severity> "
                      f'config in {root}; prepare each one wanted (once, with TensorFlow): '
                      f'{example}, or set config.data.data_dir to where they are.')
  return found


def load_test(full_name: str, spec: DataSpec) -> Split:
  """The test split of a prepared NAME/CONFIG, preprocessed as the run's data."""
  tfds = _tfds(full_name)
  builder = _builder(tfds, full_name, spec.data_dir)
  if builder is None:
    raise ConfigError(f'{FIELD}: {full_name!r} is no longer prepared in '
                      f'{spec.data_dir or tfds.core.constants.DATA_DIR}.')
  input_key, label_key, add = _check_shape(builder, full_name, None, spec.add_channel)
  source = TfdsSource(tfds.data_source(full_name, split='test', data_dir=spec.data_dir or None,
                                       download=False), input_key, label_key, spec, add)
  return Split(*source.read(np.arange(source.num_examples)))
