"""What a run's workdir holds beside its train state, read back for Ensemble.load: the
data's shapes, the standardiser a regression task trained with, the conformal predictor and
the homoscedastic noise levels fitted after training (final_metrics.json)."""

import json
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np

from dist_ens import data, tasks
from dist_ens.data import uci
from dist_ens.ensembles import methods
from dist_ens.eval import decisions
from dist_ens.specs import data_spec, method_spec


def data_shape(config: ml_collections.ConfigDict,
                meta: dict[str, Any] | None) -> tuple[tuple[int, ...], int, np.dtype]:
  """(input shape, the model's outputs, input dtype) the parameters were built for: from the
  checkpoint (whose meta calls the outputs 'num_classes'), or (older checkpoints)
  from the dataset."""
  if meta and 'input_shape' in meta:
    return (tuple(meta['input_shape']), int(meta['num_classes']),
            np.dtype(meta.get('input_dtype', 'float32')))
  dataset = data.load_dataset(config.data.name, data_spec(config))
  return (dataset.input_shape, tasks.get_task(config.task).output_units(dataset),
          np.dtype(np.int32 if data.is_token_ids(dataset.test.x) else np.float32))


def scale_from(meta: dict[str, Any]) -> uci.Standardizer | None:
  """The training split's statistics a standardising task saved, or None."""
  saved = meta.get('standardizer')
  return None if saved is None else uci.Standardizer(
      **{k: np.asarray(v, np.float32) for k, v in saved.items()})


def _collects(config: ml_collections.ConfigDict) -> bool:
  """Whether the run's method predicts with members it collected (snapshots, SWAG
  samples), not the trained members a fit after training was made on."""
  return methods.from_spec(method_spec(config)).collects


def split_scales_from(meta: dict[str, Any]) -> tuple[uci.Standardizer, ...] | None:
  """Each member split's own statistics (config.data.member_split with a standardising
  task), in split order, or None."""
  saved = meta.get('split_standardizers')
  return None if saved is None else tuple(
      uci.Standardizer(**{k: np.asarray(v, np.float32) for k, v in one.items()})
      for one in saved)


def conformal_from(workdir: Path, config: ml_collections.ConfigDict
                    ) -> decisions.ConformalFit | None:
  """The conformal predictor the run fitted on its validation split (final_metrics.json),
  or None: no validation split, an unfinished run, or a method whose predicting members
  (snapshots, SWAG samples) are not the trained members it was calibrated on."""
  path = workdir / 'final_metrics.json'
  if _collects(config) or not path.is_file():
    return None
  fitted = json.loads(path.read_text()).get('conformal')
  if not isinstance(fitted, dict):
    return None
  return decisions.ConformalFit(*(fitted[f] for f in decisions.ConformalFit._fields))


def noise_from(workdir: Path, config: ml_collections.ConfigDict,
                num_outputs: int) -> np.ndarray | None:
  """The homoscedastic task's per-member noise levels the run fitted (training/noise.py),
  [M, D] in standardised units, or None."""
  path = workdir / 'final_metrics.json'
  if (config.task != 'regression_homoscedastic' or _collects(config)
      or not path.is_file()):
    return None
  fitted = json.loads(path.read_text()).get('noise_variance')
  if not isinstance(fitted, dict):
    return None
  levels = np.asarray(fitted['standardised'], np.float32)
  return np.repeat(levels[:, None], num_outputs, axis=1)
