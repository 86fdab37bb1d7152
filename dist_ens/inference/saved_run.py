"""What a run's workdir holds, read back for Ensemble.load: its checkpoints and config, the
run's parts on the mesh asked for, the data's shapes, the standardiser a regression task
trained with, the conformal predictor and the homoscedastic noise levels fitted after
training (final_metrics.json), and the Laplace posteriors (laplace.npz)."""

import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
from absl import logging

from dist_ens import data, tasks
from dist_ens.run import assemble
from dist_ens.config import loading
from dist_ens.io.checkpoint import Checkpointer
from dist_ens.data import uci
from dist_ens.ensembles import methods
from dist_ens.errors import ConfigError
from dist_ens.eval import decisions
from dist_ens.eval.laplace_predictive import LaplaceFit
from dist_ens.evaluators import laplace_file
from dist_ens.parallel import load_mesh
from dist_ens.config.specs import data_spec, method_spec


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
  """The homoscedastic task's per-member noise levels the run fitted (evaluators/noise.py),
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


def laplace_from(workdir: Path, step: int) -> tuple[LaplaceFit, ...] | None:
  """The last-layer Laplace posteriors the run fitted after training (config.eval.laplace;
  evaluators/laplace_file.py; one fit, or one per member group), or None: none fitted, or fitted
  on another checkpoint than the restored one at `step` (a warning)."""
  fits = laplace_file.read(workdir)
  if fits is not None and fits[0].step != step:
    logging.warning('%s was fitted at step %d, the restored checkpoint is at step %d: its '
                    'Laplace posteriors are not used.', workdir / laplace_file.FILE,
                    fits[0].step, step)
    return None
  return fits


def open_checkpoints(workdir: Path) -> Checkpointer:
  """The workdir's checkpoints, to read (a FileNotFoundError saying so where there are none)."""
  checkpoints = workdir / 'checkpoints'
  if not checkpoints.is_dir():
    raise FileNotFoundError(f'{checkpoints} does not exist: {workdir} is not a dist_ens '
                            'workdir, or its run saved no checkpoint yet; train one with '
                            'dist-ens --config=... --workdir=...')
  return Checkpointer(checkpoints, every=1, keep=1 << 30)


def saved_config(checkpointer: Checkpointer,
                 workdir: Path) -> tuple[ml_collections.ConfigDict, dict[str, Any]]:
  """The run's config (upgraded to this release's fields) and the newest checkpoint's meta."""
  meta = checkpointer.newest_meta() or {}
  # The checkpoint carries its config; config.json is the fallback (older ones).
  config_path = workdir / 'config.json'
  config_dict = meta.get('config') or (
      json.loads(config_path.read_text()) if config_path.is_file() else None)
  if config_dict is None:
    raise FileNotFoundError(f'{workdir / "checkpoints"} holds no readable checkpoint with a '
                            f'config, and {config_path} does not exist.')
  return ml_collections.ConfigDict(loading.upgrade(config_dict)), meta


def run_on_mesh(config: ml_collections.ConfigDict, meta: dict[str, Any],
                devices: list[jax.Device], mesh: load_mesh.MeshArg,
                memory_gb: float | None) -> tuple[assemble.Run, jax.sharding.Mesh]:
  """The run wired on the mesh Ensemble.load was asked for (None: the saved layout),
  refused in one line where that mesh cannot hold the members (see Ensemble.load)."""
  shapes = data_shape(config, meta)
  fitted = assemble.fitted_members(config)  # what the 'member' axis must divide
  run_on = lambda m: assemble.build_run(config, mesh=m, shapes=shapes)
  if mesh is None:
    mesh = load_mesh.saved_layout(fitted, config.mesh.to_dict(), meta, devices)
    run = run_on(mesh)
  else:
    mesh = load_mesh.requested(mesh, fitted, devices)
    try:
      run = run_on(mesh)
    except ConfigError as e:  # The run's rules on this mesh, say.
      raise ConfigError(f'Ensemble.load: the mesh {load_mesh.describe(mesh)} cannot hold '
                        f'the members: {e}') from None
  budget = load_mesh.memory_budget(memory_gb, mesh)
  if budget is not None:
    load_mesh.check_holds(mesh, load_mesh.held_bytes(run.parts.abstract_state), budget,
                          devices, config.num_members,
                          lambda m: load_mesh.held_bytes(run_on(m).parts.abstract_state))
  return run, mesh


class Restored(NamedTuple):
  """A saved run restored for prediction (Ensemble.load)."""
  config: ml_collections.ConfigDict
  meta: dict[str, Any]
  parts: Any  # assemble.Parts on `mesh`
  mesh: jax.sharding.Mesh
  checkpoint: Any  # the checkpoint's Restored: .step, .state (no optimizer state)
  stack_configs: tuple[ml_collections.ConfigDict, ...]  # assemble.Run.stack_configs


def restore_newest(workdir: Path, devices: list[jax.Device], mesh: load_mesh.MeshArg,
                   memory_gb: float | None) -> Restored:
  """The newest checkpoint of `workdir` on `mesh` (see Ensemble.load), with a warning
  where the run has not finished."""
  checkpointer = open_checkpoints(workdir)
  try:
    config, meta = saved_config(checkpointer, workdir)
    run, mesh = run_on_mesh(config, meta, devices, mesh, memory_gb)
    restored = checkpointer.restore(run.parts.abstract_state, with_optimizer=False)
  finally:
    checkpointer.close()
  if restored is None:
    raise FileNotFoundError(f'no checkpoint in {workdir / "checkpoints"} could be restored.')
  if restored.step != config.train.steps:
    logging.warning('the newest checkpoint in %s is at step %d of %d: the run has not '
                    'finished.', workdir / 'checkpoints', restored.step, config.train.steps)
  return Restored(config, meta, run.parts, mesh, restored, run.stack_configs)
