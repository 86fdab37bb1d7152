"""config (+ devices) -> everything a run needs: the one place that wires parts.

  run = build_run(config)              # checks, mesh, data, parts, member form
  run.step(steps_per_call)             # the compiled train step
  run.batches(data_state, k, ...)      # the input pipeline
  run.evaluator()                      # the sharded evaluator of the run's task
  run.checkpointer(workdir)            # orbax state + data position + meta

`dist-ens plan` and `Ensemble.load` call build_run(config, shapes=...) (no data
loaded); the steps inside are build_mesh, build_data, build_parts and build_step (the mesh
and the layout: mesh_layout.py).

Data flows one way: config -> specs (dist_ens/specs.py) -> mesh, model, task,
optimizer, method, per-member hyperparameters -> the abstract (sharded) state -> the
compiled step. Only this module knows how the parts are wired; nothing here trains or
writes files.
"""

import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from dist_ens import data, models, tasks
from dist_ens.config import groups as member_groups
from dist_ens.config import checks
from dist_ens.io.checkpoint import Checkpointer
from dist_ens.core import hparams as hparams_lib, stacks as stacks_lib
from dist_ens.core.model import Model, init_shapes
from dist_ens.core.optim import Optimizer, SpecError, make_optimizer
from dist_ens.core.state import TrainState, init_state
from dist_ens.ensembles import methods, stored
from dist_ens.errors import ConfigError
from dist_ens.eval import shift_spec, user_metrics
from dist_ens.eval.evaluate import Evaluator
from dist_ens.run.member_forms import member_form
from dist_ens.run.mesh_layout import build_layout, build_mesh
from dist_ens.parallel import mesh as mesh_lib, sharding_rules, strategy
from dist_ens.parallel.layout import Layout
from dist_ens.core.step import Objective, TrainStep, make_train_step
from dist_ens.run.run_data import RunData, build_data
from dist_ens.run.evaluation import build_evaluator
from dist_ens.run.split_frames import SplitFrames
from dist_ens.config.specs import (RunSpec, StackSpec, data_spec, method_spec,
                                   model_spec, optim_spec, resolve_hparams, run_spec,
                                   stack_spec)


class Parts(NamedTuple):
  """A run's parts, before any state exists (all shapes, no arrays)."""
  stack: StackSpec  # what the step, init and member form read of the config
  mesh: Mesh
  model: Model
  optimizer: Optimizer
  hparams: dict[str, np.ndarray]  # per-member hyperparameters, each [M] (core.hparams)
  input_shape: tuple[int, ...]
  num_outputs: int  # the model's outputs per example (per head), task.output_units
  abstract_state: TrainState  # ShapeDtypeStructs carrying their shardings
  # init(pretrained=None): jit this (out_shardings) to get the state born sharded; given
  # core.state.Pretrained leaves (init_sharded reads config.model.init_from's), from them.
  init: Callable[..., TrainState]
  method: methods.Method  # config.ensemble.method: what members collect and predict with
  task: tasks.Task  # config.task: the loss, metrics and what the outputs mean
  loss: tasks.Loss  # config.train.loss resolved: the task's own, a built-in or the user's
  layout: Layout  # where every leaf of the state lives on the mesh
  input_dtype: Any = jnp.float32  # the model's inputs: float32, or int32 token ids
  # The stacks this run joins (config.ensemble.groups: each group's own Parts, their
  # members ids first_member ..); () where these parts are the one stack.
  stacked: tuple['Parts', ...] = ()
  first_member: int = 0  # the id of this stack's first member
  # Member splits of a standardising task: evaluation scores every member in one frame's
  # units (run/split_frames.py); None otherwise.
  split_frames: SplitFrames | None = None

  @property
  def state_shardings(self) -> Any:
    return jax.tree.map(lambda s: s.sharding, self.abstract_state)

  @property
  def num_members(self) -> int:
    return sum(f.shape[0] for f in jax.tree.leaves(self.abstract_state.frozen))

  @property
  def stacks(self) -> tuple['Parts', ...]:
    """Each stack's own parts (its model, method, optimizer, layout), in id order."""
    return self.stacked or (self,)

  @property
  def places(self) -> stacks_lib.Places:
    """Where each stack's members sit, and how the state holds them (core/stacks.py)."""
    return stacks_lib.Places(tuple(stacks_lib.Place(s.first_member, s.num_members)
                                   for s in self.stacks), joined=bool(self.stacked))

  @property
  def predict_model(self) -> Model:
    """The model that evaluation runs on the stacked params as the state stores them
    (of joined stacks, each stack's own predicting model on its stack; with split_frames,
    every member in the frame's units)."""
    model = self.model if self.stacked else stored.predicting_model(self.method, self.model)
    if self.split_frames is not None:
      return self.split_frames.model(model, self.task.reframe, self.num_members)
    return model

  def device_hparams(self) -> dict[str, jax.Array] | tuple[dict[str, jax.Array], ...]:
    """The per-member hyperparameters on the mesh, sharded over 'member' like the state:
    each stack's own (what its step takes, with no resharding)."""
    return self.places.join_tree([
        jax.device_put({k: np.asarray(v) for k, v in s.hparams.items()},
                       mesh_lib.member_sharding(s.mesh)) for s in self.stacks])

  def with_hparams(self, values: dict[str, np.ndarray]) -> 'Parts':
    """These parts with every member's hyperparameters [M] set to `values` (each
    stack's its own members')."""
    stacked = tuple(s._replace(hparams={f: v[s.first_member:s.first_member + s.num_members]
                                        for f, v in values.items()}) for s in self.stacked)
    return self._replace(hparams=values, stacked=stacked)


class Run(NamedTuple):
  """A run wired from its config (build_run): what train, plan and Ensemble.load consume."""
  config: ml_collections.ConfigDict  # checked; train.steps resolved from epochs (saved as is)
  spec: RunSpec  # what the loop and its actions read of it
  parts: Parts
  data: RunData | None  # None where no dataset was loaded (shapes given)
  form: strategy.Form  # how each device runs its members
  # The config each stack of parts.stacks was built from (a member group's: the run's with
  # the group's overrides), in id order; (config,) for one stack.
  stack_configs: tuple[ml_collections.ConfigDict, ...] = ()

  def step(self, steps_per_call: int = 1, loss: tasks.Loss | None = None) -> TrainStep:
    """The compiled train step (traced at its first call)."""
    per_member = self.data is not None and self.data.order.per_member
    return build_step(self.parts, per_member_batches=per_member, form=self.form,
                      steps_per_call=steps_per_call, loss=loss)

  def batches(self, data_state: data.IteratorState, steps_per_call: int,
              with_index: bool) -> data.Batches:
    """The input pipeline from `data_state` (a checkpoint's data position)."""
    return data.Batches(self.data.dataset.train, self.data.order, self.parts.mesh,
                        self.spec.num_members, data_state, prefetch=self.config.data.prefetch,
                        steps_per_call=steps_per_call, with_index=with_index,
                        member_scale=self.data.member_scale, loader=self.config.data.loader,
                        workers=self.config.data.grain_workers)

  def evaluator(self) -> Evaluator:
    """The sharded evaluator of every member and the ensemble, by the run's task."""
    parts = self.parts
    return build_evaluator(self.spec.eval, parts.task, parts.predict_model, parts.mesh, self.data)

  def checkpointer(self, workdir: Path) -> Checkpointer:
    """The run's checkpoints under workdir/checkpoints."""
    return Checkpointer(Path(workdir) / 'checkpoints', self.spec.checkpoint_every,
                        self.spec.checkpoint_keep)


def build_run(config: ml_collections.ConfigDict, *,
              devices: Sequence[jax.Device] | None = None, dataset: data.Dataset | None = None,
              optimizer: Optimizer | optax.GradientTransformation | None = None,
              mesh: Mesh | None = None,
              shapes: tuple[Sequence[int], int] | None = None) -> Run:
  """Checks the config and wires the run: mesh, data, parts and member form.

  Everything that can be wrong with the input surfaces here (the state is traced
  abstractly), before anything is compiled or written. Training loads the data;
  `dist-ens plan` and `Ensemble.load` give `shapes` instead and load none.

  Args:
    config: a config like configs/default.py's (train.epochs already resolved where
      `shapes` is given: without the data there is no split size to resolve it by).
    devices: the devices to build the mesh from (default: all).
    dataset: replaces config.data.name's (e.g. dist_ens.data.from_arrays(...)).
    optimizer: replaces config.optim's (see build_parts).
    mesh: replaces the config's mesh (Ensemble.load fits one to the devices at hand).
    shapes: (input shape, the model's outputs per example[, input dtype: float32 unless
      given]): no data is loaded.

  Raises:
    ConfigError: naming the field and what would work.
  """
  checks.validate(config)
  mesh = mesh or build_mesh(config, devices, fitted_members(config))
  run_data = None
  metrics = user_metrics.load_metrics(config.eval.metrics)  # Fails here, before any work.
  if shapes is None:
    run_data = build_data(config, dataset)
    dataset = run_data.dataset
    # An epoch is one pass over a member's training examples (all of train, or its split's).
    config = checks.resolve_epochs(config, run_data.order.examples_per_epoch)
    if config.eval.shift and data.is_token_ids(dataset.test.x):
      raise ConfigError(f'config.eval.shift={config.eval.shift!r} corrupts images and signals; '
                        f'{dataset.name!r} has integer token inputs (config.task='
                        f'{config.task!r}). Set eval.shift=\'\'.')
    shift_spec.check_run(config.eval.shift, config.eval.shift_baseline,  # sets, mCE baseline
                         dataset.input_shape, data_spec(config))
    shapes = (dataset.input_shape, tasks.get_task(config.task).output_units(dataset),
              jnp.int32 if data.is_token_ids(dataset.test.x) else jnp.float32)
  input_shape, num_outputs, *dtype = shapes
  parts = build_parts(config, mesh, input_shape, num_outputs, optimizer=optimizer,
                      input_dtype=dtype[0] if dtype else jnp.float32)
  if run_data is not None and run_data.split_scales is not None:
    parts = parts._replace(split_frames=SplitFrames.of_run(
        run_data, parts.task, config.data.member_split, config.task))
  if metrics and run_data is not None:
    user_metrics.check_metrics(metrics, shapes[1], np.asarray(dataset.test.y))
  # Each stack picks its own form (build_step); the first's stands for the run.
  return Run(config, run_spec(config, member_groups.describe(config)), parts, run_data,
             member_form(parts.stacks[0], config.data.batch_size),
             # Each group's config (checked by checks.validate above: not checked again).
             tuple(member_groups.group_config(config, s)
                   for s in member_groups.group_specs(config)) or (config,))


def fitted_members(config: ml_collections.ConfigDict) -> int:
  """The member count a mesh's 'member' axis must divide: num_members, or with member
  groups the gcd of their counts (each group is split over all member devices:
  _group_parts)."""
  specs = member_groups.group_specs(config)
  return math.gcd(*(s.group.count for s in specs)) if specs else config.num_members


def build_parts(config: ml_collections.ConfigDict, mesh: Mesh, input_shape: Sequence[int],
                num_outputs: int, num_members: int | None = None,
                optimizer: Optimizer | optax.GradientTransformation | None = None,
                input_dtype: Any = jnp.float32, first_member: int = 0) -> Parts:
  """Model, optimizer, per-member hyperparameters and the abstract sharded state.

  Model/data mismatches surface here (the state is traced with jax.eval_shape),
  before anything is compiled or written.

  Args:
    num_outputs: the model's outputs per example (config.task's output_units of the
      dataset: a classifier's number of classes).
    num_members: overrides config.num_members (plan compiles the step for 2M).
    optimizer: replaces the config's: optimizer(member_hparams) -> GradientTransformation,
      or one GradientTransformation for every member.
    first_member: the id of the first member (a member group's): num_members members from
      it, keyed and given hyperparameters by their ids.
  """
  if config.ensemble.groups:
    return _group_parts(config, mesh, input_shape, num_outputs, num_members, optimizer,
                        input_dtype)
  method = methods.from_spec(method_spec(config, num_outputs))
  task = tasks.get_task(config.task)
  model = models.get_model(model_spec(config), num_outputs * method.outputs_per_output)
  if config.pbt.enabled and not method.copyable:
    raise ConfigError(f'config.pbt.enabled=True copies whole members, which '
                      f'config.ensemble.method={config.ensemble.method!r} does not allow (its '
                      "members' state is not each member's own); use ensemble.method='deep'.")
  if method.wrap_model is not None:  # e.g. MIMO's slots and heads, a randomized prior.
    model = method.wrap_model(model, task)
  input_shape = tuple(int(d) for d in input_shape)
  sample_x = jax.ShapeDtypeStruct((1, *input_shape), input_dtype)
  one_member = lambda: init_shapes(model, sample_x)[0]
  if method.own != 'all':  # config.ensemble.own: the leaves members own, the rest shared.
    method = methods.with_owned(method, one_member(), num_outputs * method.outputs_per_output)
  optimizer = _optimizer(config, method, optimizer)
  m = config.num_members if num_members is None else num_members
  member_hparams = _member_hparams(config, method, m, first_member)

  def init(pretrained=None):
    hp = {k: jnp.asarray(v) for k, v in member_hparams.items()}
    return init_state(model, optimizer, config.seed, m, jnp.zeros(sample_x.shape, input_dtype),
                      hp, method.hooks, pretrained, first_member=first_member)

  tasks.check_outputs(model, input_shape, num_outputs,
                      f'{_model_field(config)} (for config.task={config.task!r})', input_dtype,
                      task.example_outputs(num_outputs, input_shape))
  layout = build_layout(method, mesh, config.mesh, one_member)
  state = jax.eval_shape(init)
  _check_rules_match(config.mesh.rules, layout, state)
  abstract = layout.place(state, mesh)
  return Parts(stack_spec(config), mesh, model, optimizer, member_hparams, input_shape,
               num_outputs, abstract, init, method, task,
               tasks.loss_for(config.train.loss, task), layout, input_dtype,
               first_member=first_member)


def _check_rules_match(rules: Any, layout: Layout, state: TrainState) -> None:
  """Refuses a config.mesh.rules entry that matches no leaf of the state: it would be
  ignored without a word (checked on any mesh, so a typo shows on a laptop before a run
  that splits members)."""
  sharding_rules.check_rules_match(
      sharding_rules.config_rules(rules),
      [sharding_rules.path_str(layout.rule_path(p))
       for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]])


def _group_parts(config: ml_collections.ConfigDict, mesh: Mesh, input_shape: Sequence[int],
                 num_outputs: int, num_members: int | None,
                 optimizer: Optimizer | optax.GradientTransformation | None,
                 input_dtype: Any) -> Parts:
  """config.ensemble.groups' parts: each group's own (its model and optim overrides, its
  members' ids), joined into one state whose params are a tuple of the groups'
  (core/stacks.py); the joined model predicts with every group's members in id order."""
  specs = member_groups.check(config)
  if num_members not in (None, config.num_members):
    raise ConfigError(f'{member_groups.FIELD}: planning another num_members than the '
                      f'config\'s ({config.num_members}) is not supported with groups.')
  member_groups.check_divides(specs, mesh.shape[mesh_lib.MEMBER])
  built = []
  for s in specs:
    with member_groups.in_group(s):
      one = build_parts(member_groups.group_config(config, s), mesh, input_shape,
                        num_outputs, s.group.count, optimizer, input_dtype, s.group.first)
    built.append(one._replace(stack=one.stack._replace(
        name=s.name, overrides={'model': s.model, 'optim': s.optim})))
  stacks = tuple(built)
  places = stacks_lib.Places(tuple(s.group for s in specs), joined=True)
  abstract = stacks_lib.join_states([g.abstract_state for g in stacks])
  hparams = {k: np.concatenate([g.hparams[k] for g in stacks]) for k in stacks[0].hparams}
  # The task and input are every group's; the method (each group's gives one predicting
  # member per trained member, none collects), optimizer and layout are the first group's:
  # whatever needs a stack's own (the step, init, calibration, Laplace) reads parts.stacks.
  return stacks[0]._replace(
      stack=stack_spec(config),
      model=stacks_lib.members_model([g.predict_model for g in stacks], places),
      hparams=hparams, abstract_state=abstract,
      init=stacks_lib.join_inits([g.init for g in stacks]), stacked=stacks)


def _optimizer(config: ml_collections.ConfigDict, method: methods.Method,
               optimizer: Optimizer | optax.GradientTransformation | None) -> Optimizer:
  """The config's optimizer for `method`'s schedule, or the caller's as an Optimizer; a
  field of config.optim that core cannot use is refused as that config field."""
  try:
    if optimizer is None and method.optimizer is not None:  # its own (SG-MCMC's samplers)
      return method.optimizer(optim_spec(config), config.train.steps)
    if optimizer is None:
      return make_optimizer(optim_spec(config), config.train.steps, cycles=method.cycles,
                            cycles_from=method.cycles_from, cycle_rate=method.cycle_rate)
  except SpecError as e:
    raise ConfigError(f'config.optim.{e}') from None
  if isinstance(optimizer, optax.GradientTransformation):
    return functools.partial(lambda tx, hp=None: tx, optimizer)
  return optimizer


def _member_hparams(config: ml_collections.ConfigDict, method: methods.Method,
                    num_members: int, first_member: int = 0) -> dict[str, np.ndarray]:
  """Each member's hyperparameters, [num_members] each: members first_member .. of the
  config's (a group's), or repeated where plan asks for more members than
  config.num_members."""
  member_hparams = resolve_hparams(config)
  if method.shares and method.owned is None:
    _check_shared_optimizer(member_hparams, method.name)
  if first_member:
    return {k: v[first_member:first_member + num_members] for k, v in member_hparams.items()}
  if num_members != config.num_members:
    member_hparams = {k: np.resize(v, num_members) for k, v in member_hparams.items()}
  return member_hparams


def _model_field(config: ml_collections.ConfigDict) -> str:
  """The config field that chose the model, as an error message names it."""
  if model_spec(config).hf:  # a Hugging Face checkpoint's config.json made the model
    return f'config.model.init_from={config.model.init_from!r}'
  return (f'config.model.factory={config.model.factory!r}' if config.model.factory
          else f'config.model.name={config.model.name!r}')


def _check_shared_optimizer(member_hparams: dict[str, np.ndarray], name: str) -> None:
  """Shared weights (BatchEnsemble's) take one optimizer: its hyperparameters cannot vary."""
  varying = [k for k in hparams_lib.varying(member_hparams) if k.startswith('optim.')]
  if varying:
    raise ConfigError(f"config.ensemble.method={name!r} trains shared weights with one "
                      f'optimizer, but config.hparams varies {varying} over members; sweep '
                      "them with method='deep', or fix them.")


def build_step(parts: Parts, *, per_member_batches: bool, form: strategy.Form,
               steps_per_call: int = 1, loss: tasks.Loss | None = None) -> TrainStep:
  """The compiled train step for these parts (traced at its first call); `loss`
  replaces config.train.loss: each stack's own step (and member form), joined."""
  if not parts.stacked:
    return _stack_step(parts, per_member_batches=per_member_batches, form=form,
                       steps_per_call=steps_per_call, loss=loss)
  steps = [_stack_step(one, per_member_batches=per_member_batches,
                       form=member_form(one, one.stack.batch_size),
                       steps_per_call=steps_per_call, loss=loss) for one in parts.stacked]
  return stacks_lib.join_steps(steps, parts.places, parts.state_shardings,
                               per_member_batches=per_member_batches,
                               steps_per_call=steps_per_call)


def _stack_step(parts: Parts, *, per_member_batches: bool, form: strategy.Form,
                steps_per_call: int, loss: tasks.Loss | None) -> TrainStep:
  """The train step of one stack."""
  parallelism, map_batch_size = form
  loss = loss or parts.loss
  if parts.method.wrap_loss is not None:  # e.g. MIMO: the sum of its heads' losses
    loss = parts.method.wrap_loss(loss)
  objective = Objective(loss, parts.task.batch_metrics)
  return make_train_step(parts.model, parts.optimizer, parts.mesh, parts.abstract_state,
                         seed=parts.stack.seed, objective=objective,
                         per_member_batches=per_member_batches,
                         member_parallelism=parallelism, map_batch_size=map_batch_size,
                         steps_per_call=steps_per_call, options=parts.stack.options,
                         hooks=parts.method.hooks, first_member=parts.first_member)
