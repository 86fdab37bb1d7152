"""Using a trained ensemble: load a workdir's final checkpoint, predict, export members.

  ens = Ensemble.load('/tmp/run')             # onto whatever devices are present
  out = ens.predict(x)                        # raw inputs, any batch size
  out.probs, out.member_probs, out.entropy, out.mutual_information
  lap = ens.predict(x, laplace=True)          # the members' Laplace posteriors (eval.laplace)
  params_3 = ens.member(3)                    # member 3's own parameter pytree
  ens.export('/tmp/members')                  # member_i.npz, loadable with numpy alone
  student = ens.student()                     # the distilled student (config.distill)

The abstract train state is built from the workdir's config.json by the same chain
training uses (dist_ens.run.assemble), so the orbax checkpoint restores straight into
this machine's shardings, whatever mesh wrote it. The input shape and class count
come from the checkpoint itself, so no dataset is needed.
"""

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from dist_ens import data, tasks
from dist_ens.config import specs
from dist_ens.data import uci
from dist_ens.core import stacks as stacks_lib
from dist_ens.core.state import member_flags
from dist_ens.core.model import Model
from dist_ens.ensembles import methods, stored
from dist_ens.errors import ConfigError
from dist_ens.eval import conformal as conformal_lib, decisions, laplace_predictive, metrics
from dist_ens.eval.evaluate import member_logits, pad_rows, padded_chunks
from dist_ens.io import member_files
from dist_ens.parallel import load_mesh, mesh as mesh_lib
from dist_ens.inference import saved_run, student as student_lib
from dist_ens.inference.prediction import (GaussianPrediction, Prediction, Preprocess,
                                           model_inputs, preprocess_for)

PyTree = Any


class Ensemble:
  """A trained ensemble on the present devices: predict, inspect and export members.

  Build it with `Ensemble.load(workdir)`. Members are sharded over the mesh's
  'member' axis and each batch over 'data', as in training; on a mesh with a 'model'
  axis each member's leaves are split over it by the run's layout (docs/mesh.md).

  Attributes:
    config: the run's config (from config.json).
    model: the single-member Model (init/apply pair, see dist_ens.core.model).
    params: the stacked parameters, every leaf [M, ...], sharded over 'member'. Where
      members share leaves (config.ensemble.own, batchensemble) this forms M copies of
      them; predict, member(i) and export read the params as stored, each shared leaf once.
    model_state: the stacked model state (e.g. BatchNorm running statistics), or {}.
    frozen: [M] bool numpy; frozen members are left out of the ensemble's mean.
    step: the training step of the restored checkpoint.
    input_shape, num_classes: the model's input shape and number of classes.
    mesh: the ('member', 'data'[, 'model']) mesh the parameters live on.
    laplace: the members' last-layer Laplace posteriors the run fitted
      (config.eval.laplace; workdir/laplace.npz, dist_ens.evaluators.laplace_file): a tuple of
      LaplaceFit, one per stack, or None.
    places, stack_models, stack_names, stack_configs: where each stack's members sit, its
      predicting model, its name (a member group's) and the config it was built from
      (assemble.Run.stack_configs), for an ensemble of several stacks (core/stacks.py;
      default one stack of `model`, built from `config`).
  """

  def __init__(self, config: ml_collections.ConfigDict, model: Model, params: PyTree,
               frozen: np.ndarray, step: int, input_shape: tuple[int, ...], num_classes: int,
               mesh: jax.sharding.Mesh, preprocess: Preprocess | None = None,
               model_state: PyTree = None, scale: uci.Standardizer | None = None,
               conformal: decisions.ConformalFit | None = None,
               noise_variance: np.ndarray | None = None, predict_model: Model | None = None,
               split_scales: tuple[uci.Standardizer, ...] | None = None,
               laplace: tuple[laplace_predictive.LaplaceFit, ...] | None = None,
               places: stacks_lib.Places | None = None,
               stack_models: tuple[Model, ...] = (), stack_names: tuple[str, ...] = (),
               stack_configs: tuple[ml_collections.ConfigDict, ...] = ()):
    # `predict_model` reads `params` as stored (stored.predicting_model); default `model`.
    self.config, self.model, self._stored = config, model, params
    self._predict_model = model = predict_model or model
    self.conformal = conformal  # what predict_sets calibrates with (None: not fitted)
    self.laplace = laplace  # what predict(laplace=True) uses (None: not fitted)
    self._stack_models = tuple(stack_models) or (self._predict_model,)
    self._stack_names = tuple(stack_names)
    self._stack_configs = tuple(stack_configs) or (config,)
    self.task, self.scale = tasks.get_task(config.task), scale
    # config.data.member_split's per-split statistics: split s's members predict in their
    # own units, so predict standardises and converts back per split (None: one `scale`).
    self.split_scales = split_scales
    if noise_variance is not None:  # The levels training fitted, [M, D] (evaluators/noise.py).
      self.task = tasks.regression_homoscedastic(noise_variance.shape[1], noise_variance)
    self.model_state = {} if model_state is None else model_state
    self.frozen, self.step, self.mesh = np.asarray(frozen, bool), step, mesh
    self.input_shape, self.num_classes = tuple(input_shape), num_classes
    self._places = places or stacks_lib.Places.one(len(self.frozen))
    self.preprocess = preprocess or preprocess_for(specs.data_spec(config), input_shape)
    if self.frozen.all():
      logging.warning('every member of this ensemble is frozen (non-finite); its mean '
                      'prediction is undefined (NaN).')
    members = mesh_lib.member_sharding(mesh)
    self._member_mask = jax.device_put(~self.frozen, members)

    def forward(variables, x, member_mask):
      logits = member_logits(model, variables, x)
      uncertainty = metrics.member_uncertainty(logits, member_mask)
      return (jnp.exp(metrics.ensemble_log_probs(logits, member_mask)),
              jax.nn.softmax(logits.astype(jnp.float32), axis=-1),
              uncertainty['entropy'], uncertainty['mutual_information'])

    # Replicated outputs: every process can read the whole prediction.
    # The params as they lie (None): a shared leaf is replicated, not split over 'member'.
    self._forward = jax.jit(forward, in_shardings=(None, mesh_lib.batch_sharding(mesh), members),
                            out_shardings=mesh_lib.replicated(mesh))
    # Each stack's member taker: a member formed from its stack's stored params.
    self._takes = [jax.jit(functools.partial(stored.take_member, m),
                           out_shardings=mesh_lib.replicated(mesh)) for m in self._stack_models]
    self._take_state = jax.jit(lambda state, i: jax.tree.map(lambda a: a[i], state),
                               out_shardings=mesh_lib.replicated(mesh))

  @property
  def params(self) -> PyTree:
    if not hasattr(self, '_formed'):
      self._formed = self._places.join_tree([
          stored.form_all(m, p, self.mesh)
          for m, p in zip(self._stack_models, self._places.split_tree(self._stored))])
    return self._formed

  @classmethod
  def load(cls, workdir: str | os.PathLike, *, devices: Sequence[jax.Device] | None = None,
           mesh: load_mesh.MeshArg = None, memory_gb: float | None = None,
           preprocess: Preprocess | None = None) -> 'Ensemble':
    """Restores the newest checkpoint of a dist_ens workdir onto `devices`.

    Example:
      ens = Ensemble.load('/tmp/run')                          # all devices, as trained
      ens1 = Ensemble.load('/tmp/run', devices=jax.devices()[:1])
      ens2 = Ensemble.load('/tmp/run', mesh={'member': 4, 'data': 2})  # members whole

    Args:
      workdir: a directory train.run wrote (config.json and checkpoints/).
      devices: the devices to place members on (default: all).
      mesh: where the members go. None (default): the run's own layout, each member
        split over the devices training split it over (the saved mesh.model; fewer,
        with a warning, where the devices do not allow as many) by the run's rules,
        gcd(num_members, groups) of the groups on 'member' and the rest on 'data'. Or
        the config's mesh fields as a dict, {'member': m, 'data': d, 'model': k}
        (absent: -1, 1, 1; -1 fills `devices`), or a jax Mesh with axes
        ('member', 'data'[, 'model']).
      memory_gb: the memory of one device (1e9 bytes, as `dist-ens plan --memory_gb`);
        default: what the device reports (GPUs, TPUs; a CPU reports none).
      preprocess: replaces preprocess_for(specs.data_spec(config), input_shape) on predict's raw inputs.

    Returns:
      The Ensemble; its `step` is the checkpoint's step (a warning is logged when
      that is not config.train.steps, i.e. the run has not finished).

    Raises:
      FileNotFoundError: `workdir` holds no config.json or no restorable checkpoint.
      ConfigError: one line, before anything is restored or compiled, for a mesh that
        cannot hold the members: they do not split evenly over its 'member' axis, the
        run's mesh.rules do not divide its 'model' axis, or a device would hold more of
        the params than memory_gb (naming a split over 'model' that fits).
    """
    workdir = Path(workdir)
    devices = list(jax.devices() if devices is None else devices)
    config, meta, parts, mesh, restored, stack_configs = saved_run.restore_newest(
        workdir, devices, mesh, memory_gb)
    # Snapshots or SWAG samples predict where the run used such a method.
    members = methods.predictive_members(parts.method, restored.state, config.seed, mesh)
    replicated = jax.jit(lambda f: f, out_shardings=mesh_lib.replicated(mesh))
    frozen = np.asarray(member_flags(jax.tree.map(np.asarray, replicated(members.frozen))))
    ensemble = cls(config, parts.model, members.params, frozen, restored.step,
                   parts.input_shape, parts.num_outputs, mesh, preprocess,
                   model_state=members.model_state, scale=saved_run.scale_from(meta),
                   conformal=saved_run.conformal_from(workdir, config),
                   noise_variance=saved_run.noise_from(workdir, config, parts.num_outputs),
                   predict_model=parts.predict_model,
                   split_scales=saved_run.split_scales_from(meta),
                   laplace=saved_run.laplace_from(workdir, restored.step),
                   places=parts.places if parts.stacked else None,  # One stack: its K x M rows.
                   stack_models=tuple(s.predict_model for s in parts.stacks),
                   stack_names=tuple(s.stack.name for s in parts.stacked),
                   stack_configs=stack_configs)
    ensemble.workdir = workdir  # what export_adapters reads the factors from
    return ensemble

  @property
  def num_members(self) -> int:
    """Members that predict: config.num_members, times the snapshots or SWAG samples
    per member where config.ensemble.method keeps them (member m's are rows m*K..m*K+K-1)."""
    return len(self.frozen)

  def _row(self, tree: PyTree, i: int, what: str) -> tuple[PyTree, int, int]:
    """(the stack of `tree` that holds member i, its row there, the stack's index)."""
    self._check_member(i, what)
    s, row = self._places.locate(i)
    return self._places.split_tree(tree)[s], row, s

  def _check_member(self, i: int, what: str) -> None:
    if not 0 <= i < self.num_members:
      raise IndexError(f'{what}({i}): this ensemble has members 0..{self.num_members - 1}.')

  def member(self, i: int) -> PyTree:
    """Member i's parameters as a plain pytree of numpy arrays (no member axis).

    Example:
      params = ens.member(0)
      logits = ens.model.apply(params, x)  # one member, as trained
    """
    stack, row, s = self._row(self._stored, i, 'member')
    return jax.tree.map(np.asarray, self._takes[s](stack, np.int32(row)))

  def member_state(self, i: int) -> PyTree:
    """Member i's model state as a plain pytree of numpy arrays (no member axis): its
    BatchNorm statistics, a randomized prior's network; {} for a model without one.

    Example:
      logits, _ = ens.model.apply(ens.member(0), ens.member_state(0), x, train=False)
    """
    stack, row, _ = self._row(self.model_state, i, 'member_state')
    return jax.tree.map(np.asarray, self._take_state(stack, np.int32(row)))

  def member_config(self, i: int) -> ml_collections.ConfigDict:
    """The config member i was built from: its stack's (the run's, with its member group's
    model, optim and ensemble overrides where groups give members different architectures).

    Example:
      spec = dist_ens.config.specs.model_spec(ens.member_config(5))
      model = dist_ens.models.get_model(spec, ens.num_classes)   # member 5's architecture
    """
    self._check_member(i, 'member_config')
    return self._stack_configs[self._places.locate(i)[0]]

  def export(self, directory: str | os.PathLike) -> list[Path]:
    """Writes each member as its own .npz file (member_{i}.npz, member_{i}_state.npz where
    the model has a state, ensemble.json), usable without dist_ens or JAX; the files'
    format: dist_ens.io.member_files.export_members. Only process 0 writes.

    Example:
      paths = ens.export('/tmp/members')
      params = load_member(paths[0])        # ens.member(0)'s leaves, as nested dicts

    Returns:
      The member files' paths, in member order.
    """
    stacks = []  # Each stack's, where there are several: which model each member file is.
    for name, place in zip(self._stack_names, self._places):
      one = self.member_config(place.first)
      stacks.append({'name': name, 'members': list(range(place.first, place.first + place.count)),
                     'model': one.model.to_dict(), 'method': one.ensemble.method,
                     'own': one.ensemble.own})
    about = {'data': self.config.data.name, 'model': self.config.model.to_dict(),
             'task': self.config.task}
    return member_files.export_members(self, Path(directory), about, stacks)

  def export_adapters(self, directory: str | os.PathLike) -> list[Path]:
    """A LoRA ensemble on a Hugging Face model (init_from='hf:PATH', own='lora') as PEFT
    adapters, directory/member_{i}/ (adapter_config.json, adapter_model.safetensors):
    `peft.PeftModel.from_pretrained(transformers_model, directory / 'member_0')` gives
    member 0's outputs (dist_ens.io.peft_adapters; docs/pretrained.md). Only process 0
    writes."""
    if self._places.joined:
      raise ConfigError(f'Ensemble.export_adapters does not support member groups yet '
                        f'(docs/groups.md): this run joins {len(self._places)} stacks, one per '
                        'group; export the adapters of a run without groups.')
    if getattr(self, 'workdir', None) is None:
      raise ValueError('export_adapters needs an Ensemble from Ensemble.load(workdir).')
    if jax.process_index() != 0:
      return [Path(directory) / f'member_{i}' for i in range(self.num_members)]
    from dist_ens.io import peft_adapters  # pylint: disable=import-outside-toplevel
    return peft_adapters.export_peft(self.workdir, directory)

  def _chunk_size(self, n: int, batch_size: int) -> int:
    # Padded shapes come from a few sizes (powers of two up to batch_size), so
    # predict compiles a handful of times however many batch sizes it sees.
    d = self.mesh.shape[mesh_lib.DATA]
    size = batch_size if n >= batch_size else 1 << max(n - 1, 0).bit_length()
    return -(-size // d) * d

  def predict(self, x: np.ndarray, batch_size: int | None = None, *,
              preprocessed: bool = False, laplace: bool = False) -> Prediction:
    """The ensemble's and every member's probabilities for a batch of any size.

    Example:
      out = Ensemble.load('/tmp/run').predict(raw_x[:13])
      out.probs.argmax(-1), out.mutual_information

    Args:
      x: [N, ...] raw inputs, as the dataset stores them (e.g. uint8 images);
        `self.preprocess` turns them into model inputs.
      batch_size: examples per device step (default config.eval.batch_size); the
        last chunk is padded, so any N works.
      preprocessed: x is already model inputs, e.g. a split from
        dist_ens.data.load_dataset(name, config.data), which preprocesses itself.
      laplace: predict with each member's last-layer Laplace posterior instead of its
        trained weights (a classifier trained with config.eval.laplace): member_probs
        are the members' Laplace predictives, by the run's eval.laplace_samples (0:
        the probit approximation; k: the mean over k weight draws, the same draws for
        every input), and probs their mixture, as final_metrics.json's 'laplace'.

    Returns:
      Prediction of numpy arrays; frozen members are left out of `probs`, `entropy`
      and `mutual_information` but keep their `member_probs`.

    Raises:
      ValueError: laplace=True on a run that fitted no Laplace posteriors (one line).
    """
    forward = self._laplace_forward(draws=False) if laplace else self._forward
    x = model_inputs(x, preprocessed, self.preprocess)
    if self.task.predict is not None and not laplace:
      return self._predict_task(x, batch_size)
    parts = [(np.asarray(p)[:k], np.asarray(mp)[:, :k], np.asarray(e)[:k], np.asarray(mi)[:k])
             for k, (p, mp, e, mi) in self._outputs(x, batch_size, forward)]
    probs, member_probs, entropy, mi = zip(*parts)
    return Prediction(np.concatenate(probs), np.concatenate(member_probs, axis=1),
                      np.concatenate(entropy), np.concatenate(mi))

  def laplace_samples(self, x: np.ndarray, batch_size: int | None = None, *,
                      preprocessed: bool = False) -> np.ndarray:
    """[M, S, N, C] the probabilities of each member's S Laplace weight draws (the run's
    config.eval.laplace_samples), whose means over S are predict(x, laplace=True)'s
    member_probs: one draw is one function, so they give joint predictions
    (dist_ens.eval.joint, as final_metrics.json's 'laplace'.'joint').

    Example:
      draws = ens.laplace_samples(test_x)           # [M, S, N, C]

    Raises:
      ValueError: no Laplace fit, or one with the probit approximation (no draws).
    """
    forward = self._laplace_forward(draws=True)
    x = model_inputs(x, preprocessed, self.preprocess)
    return np.concatenate([np.asarray(d)[:, :, :k] for k, d in
                           self._outputs(x, batch_size, forward)], axis=2)

  def _laplace_forward(self, draws: bool) -> Callable[..., Any]:
    """The Laplace forward of this ensemble's fit (laplace_predictive.Forwards), refusing
    in one line a run without one."""
    laplace_predictive.check_predictable(self.laplace, self.config.eval.laplace, self.task.name,
                                         self.step, draws)
    if not hasattr(self, '_laplace_forwards'):
      self._laplace_forwards = laplace_predictive.Forwards(
          self._stack_models, self.laplace, self.config.seed, self.num_classes, self.mesh,
          joined=self._places.joined)
    return self._laplace_forwards.draws if draws else self._laplace_forwards.predict

  def predict_sets(self, x: np.ndarray, batch_size: int | None = None, *,
                   preprocessed: bool = False, seed: int = 0) -> Any:
    """Conformal prediction sets (classification: [N, C] bool, APS) or intervals
    (regression: (lower, upper), in the targets' units) holding the label with probability
    1 - config.eval.conformal_alpha, as calibrated on the run's validation split.

    Example:
      sets = Ensemble.load('/tmp/run').predict_sets(raw_x)   # sets[i, c]: class c in set i

    Args:
      x, batch_size, preprocessed: as for predict.
      seed: the seed of APS's randomisation (classification).

    Raises:
      ValueError: the run fitted no conformal predictor (data.validation_size=0, an
        unfinished run, or a snapshot / SWAG ensemble).
    """
    if self.conformal is None:
      raise ValueError('this run fitted no conformal predictor: train with '
                       'data.validation_size > 0 (and a deep, BatchEnsemble or MIMO ensemble).')
    out = self.predict(x, batch_size, preprocessed=preprocessed)
    if isinstance(out, GaussianPrediction):  # normalised residuals: q is unit-free
      return conformal_lib.residual_bounds(out.mean, self.conformal.threshold,
                                           np.sqrt(out.variance))
    return conformal_lib.aps_sets(out.probs, self.conformal.threshold, seed=seed)

  def _outputs(self, x: np.ndarray, batch_size: int | None, forward) -> list:
    """[(real rows k, forward((params, model_state), padded chunk, member_mask))] over x
    in padded chunks."""
    if x.shape[1:] != self.input_shape:
      raise ValueError(f'predict() needs model inputs of shape [N, *{self.input_shape}]; got '
                       f'{x.shape}.')
    if len(x) == 0:
      raise ValueError('predict() got an empty batch; pass at least one input.')
    batch_size = int(batch_size or self.config.eval.batch_size)
    sharding, outs = mesh_lib.batch_sharding(self.mesh), []
    for start, valid in padded_chunks(len(x), batch_size):
      padded = pad_rows(x[start:start + valid], self._chunk_size(valid, batch_size))
      outs.append((valid, forward((self._stored, self.model_state),
                                  data.to_global(padded, sharding), self._member_mask)))
    return outs

  def _predict_task(self, x: np.ndarray, batch_size: int | None) -> GaussianPrediction:
    """The task's own prediction (regression: the mixture), in the targets' units."""
    if self.split_scales is not None:
      return self._predict_per_split(x, batch_size)
    return self._predict_scaled(x, batch_size, self.scale)

  def _predict_per_split(self, x: np.ndarray, batch_size: int | None) -> GaussianPrediction:
    """Member splits: split s's members predict on x standardised with split s's statistics
    and convert back with them; the mixture is then formed in the targets' units."""
    rows = self.num_members // len(self.split_scales)  # predicting members per split
    means, variances = [], []
    for s, scale in enumerate(self.split_scales):
      own = self._predict_scaled(x, batch_size, scale)
      means.append(own.member_mean[s * rows:(s + 1) * rows])
      variances.append(own.member_variance[s * rows:(s + 1) * rows])
    return GaussianPrediction.mixture(np.concatenate(means), np.concatenate(variances),
                                      ~self.frozen)

  def _predict_scaled(self, x: np.ndarray, batch_size: int | None,
                      scale: uci.Standardizer | None) -> GaussianPrediction:
    if scale is not None:
      x = scale.apply_inputs(x)
    if not hasattr(self, '_task_forward'):
      task, model = self.task, self._predict_model
      self._task_forward = jax.jit(
          lambda v, xs, mask: task.predict(member_logits(model, v, xs), mask),
          out_shardings=mesh_lib.replicated(self.mesh))
    parts = self._outputs(x, batch_size, self._task_forward)
    # Members' arrays are [M, B, ...]: their examples (and padding) on axis 1.
    cut = lambda k, a, n: np.asarray(a)[:, :n] if k.startswith('member_') else np.asarray(a)[:n]
    out = {k: np.concatenate([cut(k, p[k], n) for n, p in parts],
                             axis=1 if k.startswith('member_') else 0) for k in parts[0][1]}
    if scale is not None:  # Standardised units -> the targets'.
      std, mean = scale.y_std, scale.y_mean
      out = {k: v * std + mean if k.endswith('mean') else v * std ** 2 for k, v in out.items()}
    return GaussianPrediction(**out)

  def student(self) -> student_lib.Student:
    """The student this run distilled (config.distill.student; workdir/student.npz):
    one network whose predict(x) takes what Ensemble.predict takes.

    Example:
      student = Ensemble.load('/tmp/run').student()
      student.predict(raw_x).probs               # [N, C]

    Raises:
      FileNotFoundError: the run distilled no student (one line).
    """
    if getattr(self, 'workdir', None) is None:
      raise ValueError('student() needs an Ensemble from Ensemble.load(workdir).')
    return student_lib.load_student(self.workdir, self.model, self.preprocess,
                                    self.config.eval.batch_size)
