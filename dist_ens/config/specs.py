"""config -> typed, frozen specs: where the ConfigDict is read, once per part.

assemble builds every part from these and the run's RunSpec (what the loop and its
actions read: the loop's cadences, evaluation, selection, distillation), so nothing below
build_run reads a ConfigDict. A spec has no defaults for what the package's defaults hold
(dist_ens/config/defaults.py is where every default lives); a field only some configs
set is optional in its spec, with its default there.
"""

import functools
from typing import Any, NamedTuple

import ml_collections

from dist_ens import data, models, tasks
from dist_ens.config.loading import DATA_OPTIONAL_FIELDS
from dist_ens.core import hparams as hparams_lib
from dist_ens.core.optim import OptimSpec
from dist_ens.core.step import StepOptions
from dist_ens.data import augment as augment_lib
from dist_ens.ensembles import distill, methods, own as own_lib, pbt, students
from dist_ens.errors import ConfigError
from dist_ens.importing import is_import_path, load_object
from dist_ens.io import init_from as init_from_lib
from dist_ens.io.init_from import InitFrom
from dist_ens.models import hf as hf_models
from dist_ens.parallel import mesh as mesh_lib


def mesh_spec(config: ml_collections.ConfigDict) -> mesh_lib.MeshSpec:
  m = config.mesh
  return mesh_lib.MeshSpec(member=m.member, data=m.data, hosts_along=m.hosts_along,
                           model=m.model)


def data_spec(config: ml_collections.ConfigDict) -> data.DataSpec:
  """config.data's loading fields (the TFDS-only ones where a config sets them)."""
  d = config.data
  optional = {k: d[k] for k in DATA_OPTIONAL_FIELDS if k in d}
  if data.is_text(d.name):  # Fields only text reads: other configs need not have them.
    init_from = _field(config, 'model.init_from')
    optional.update({k: _field(config, f'data.{k}') for k in data.TEXT_FIELDS},
                    checkpoint=init_from if hf_models.is_hf(init_from) else '')
  return data.DataSpec(name=d.name, data_dir=d.data_dir, mean=tuple(d.mean), std=tuple(d.std),
                       **optional)


def init_from_spec(config: ml_collections.ConfigDict) -> InitFrom:
  """config.model's init_from fields: which pretrained leaves every member starts from."""
  init_map = _field(config, 'model.init_map')
  if isinstance(init_map, str) or not all(
      isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(s, str) for s in p)
      for p in init_map):
    raise ConfigError(f'config.model.init_map={init_map!r} must be (regex, replacement) '
                      "pairs, e.g. (('^encoder/', ''), ('/kernel$', '/w')).")
  return InitFrom(source=str(_field(config, 'model.init_from')),
                  init_map=tuple((str(r), str(s)) for r, s in init_map),
                  owned_from_file=bool(_field(config, 'model.init_owned_from_file')))


def method_spec(config: ml_collections.ConfigDict,
                num_outputs: int | None = None) -> methods.MethodSpec:
  """config.ensemble's method, with the run's steps, schedule and mode it depends on; the
  method's own fields are its config.ensemble group (ensemble.options for a user's).
  Given the task's `num_outputs`, the spec can build second networks of config.model's
  kind (MethodSpec.build_model)."""
  ensemble, optim = config.ensemble, config.optim
  group = methods.options_group(ensemble.method)
  options = ensemble.get(group) if group else None
  build_model = None if num_outputs is None else functools.partial(
      models.resized, model_spec(config), num_outputs)
  return methods.MethodSpec(
      name=ensemble.method, total_steps=config.train.steps,
      restartable_schedule=optim.schedule != 'constant' or bool(optim.warmup_steps),
      reproducible=config.reproducible,
      options=options.to_dict() if options is not None else {}, own=ensemble.own,
      lora_rank=ensemble.lora_rank, lora_alpha=ensemble.lora_alpha,
      lora_targets=ensemble.lora_targets,
      train_shared=_field(config, 'ensemble.train_shared'), build_model=build_model,
      seed=config.seed, model='' if config.model.factory or model_spec(config).hf
      else config.model.name, num_members=config.num_members,
      model_spec=model_spec(config))


def optim_spec(config: ml_collections.ConfigDict) -> OptimSpec:
  """config.optim: the fields the optimizer and its schedule read (core.optim.OptimSpec)."""
  return OptimSpec(**{name: _field(config, f'optim.{name}') for name in OptimSpec._fields})


def hparams_spec(config: ml_collections.ConfigDict) -> hparams_lib.HparamsSpec:
  """num_members, seed and the per-member fields as configured (core.hparams.FIELDS)."""
  return hparams_lib.HparamsSpec(config.num_members, config.seed,
                                 {field: _field(config, field) for field in hparams_lib.FIELDS})


def resolve_hparams(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Each member's value of every per-member field, [num_members] float32 each
  (core.hparams.resolve); a value that cannot be resolved is said as its config field."""
  try:
    return hparams_lib.resolve(hparams_spec(config))
  except hparams_lib.HparamsError as e:
    raise ConfigError(f'config.{e}') from None


def pbt_spec(config: ml_collections.ConfigDict) -> pbt.PbtSpec | None:
  """config.pbt, checked, each explored field's rule read from its sweep spec; None when
  population-based training is off."""
  p = config.pbt
  if not p.enabled:
    return None
  configured = {field: _field(config, field) for field in hparams_lib.FIELDS}
  resolved = resolve_hparams(config)
  return pbt.make_spec(
      interval=p.interval, metric=p.metric, quantile=p.quantile, fields=tuple(p.fields),
      perturb_factors=tuple(p.perturb_factors), resample_probability=p.resample_probability,
      seed=p.seed, configured=configured, varying=hparams_lib.varying(resolved),
      select_metrics=tasks.get_task(config.task).select_metrics)


def _field(config: ml_collections.ConfigDict, dotted: str) -> Any:
  # Specs have no defaults (configs/default.py holds every field): a config not started
  # from it gets one line naming the field it lacks, not a KeyError.
  section, name = dotted.split('.')
  if section not in config or name not in config[section]:
    raise ConfigError(f'config.{dotted} is missing; start from configs/default.py, which '
                      'has every field.')
  return config[section][name]


def model_spec(config: ml_collections.ConfigDict) -> models.ModelSpec:
  """config.model; a field only some models read may be absent (None: the model's own
  default), and kwargs become a plain dict (nested ConfigDicts included)."""
  m = config.model
  kwargs = m.get('kwargs') or {}
  optional = {name: m.get(name) for name in models.OPTIONAL_FIELDS}
  if hf_models.is_hf(m.get('init_from')):
    optional['hf'] = m.init_from
  return models.ModelSpec(
      name=m.name, factory=m.factory,
      kwargs=kwargs.to_dict() if isinstance(kwargs, ml_collections.ConfigDict) else kwargs,
      widths=tuple(m.widths), channels=tuple(m.channels), kernel_sizes=tuple(m.kernel_sizes),
      strides=tuple(m.strides), conv_impl=m.conv_impl, dropout=m.dropout, **optional)


class TrainSpec(NamedTuple):
  """config.train's fields the loop reads (defaults.py says what each means)."""
  steps: int  # resolved from train.epochs where that is set
  log_every: int
  eval_every: int
  sync_every: int
  steps_per_call: int
  on_nonfinite: str
  profile_steps: int


class EvalSpec(NamedTuple):
  """config.eval: what the evaluations after (and during) training read."""
  batch_size: int
  metrics: tuple[str, ...]
  evaluators: tuple[str, ...]
  ood_dataset: str
  mc_samples: int
  temperature_scaling: bool
  laplace: str
  laplace_samples: int
  shift: str
  shift_baseline: str
  conformal_alpha: float
  joint_tau: int
  joint_batches: int


class SelectSpec(NamedTuple):
  """config.select: member selection on the validation split."""
  metric: str
  top_k: int
  method: str
  greedy_size: int
  greedy_replacement: bool


class RunSpec(NamedTuple):
  """What the loop and its actions read of a run's config, read once by build_run."""
  num_members: int
  seed: int
  precision: str
  reproducible: bool
  task: str
  batch_size: int  # config.data.batch_size: each member's examples a step
  data: data.DataSpec
  train: TrainSpec
  eval: EvalSpec
  select: SelectSpec
  checkpoint_every: int
  checkpoint_keep: int
  pbt: pbt.PbtSpec | None  # None: population-based training is off
  distill: distill.DistillSpec | None  # None: no student
  writers: tuple[str, ...]
  members_text: str  # '8 x mlp', or each stack's count and model


def run_spec(config: ml_collections.ConfigDict, members_text: str) -> RunSpec:
  """The run-wide spec of a checked config (train.steps already resolved from epochs),
  with the description of its members build_run gives (each stack's, where there are
  several)."""
  return RunSpec(
      num_members=config.num_members, seed=config.seed, precision=config.precision,
      reproducible=config.reproducible, task=config.task,
      batch_size=config.data.batch_size, data=data_spec(config),
      train=_section(config.train, TrainSpec), eval=_section(config.eval, EvalSpec),
      select=_section(config.select, SelectSpec), checkpoint_every=config.checkpoint.every,
      checkpoint_keep=config.checkpoint.keep, pbt=pbt_spec(config),
      distill=distill_spec(config), writers=tuple(config.writers),
      members_text=members_text)


def distill_spec(config: ml_collections.ConfigDict) -> distill.DistillSpec | None:
  """config.distill, its student's kind (for config.model) and numbers checked; None
  without a student."""
  d = config.distill
  if not d.student:
    return None
  students.check_kind(d.student, config.model.name == 'mlp' and not config.model.factory)
  field = f'config.distill.student={d.student!r}'
  for name, least in (('steps', 1), ('batch_size', 0)):
    value = d[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise ConfigError(f'config.distill.{name}={value!r} must be an int >= {least} with '
                        f'{field} (e.g. {1000 if name == "steps" else 0}).')
  for name in ('temperature', 'learning_rate'):
    value = d[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
      raise ConfigError(f'config.distill.{name}={value!r} must be a number > 0 with {field} '
                        f'(e.g. {2.0 if name == "temperature" else 1e-3}).')
  return distill.DistillSpec(d.student, d.steps, float(d.temperature),
                             float(d.learning_rate), d.batch_size or config.data.batch_size)


def _section(section: ml_collections.ConfigDict, spec: type) -> Any:
  """spec's fields read from a config section, sequences as tuples."""
  plain = lambda v: tuple(v) if isinstance(v, (list, tuple)) else v
  return spec(**{name: plain(section[name]) for name in spec._fields})


class StackSpec(NamedTuple):
  """What one stack of members (the run's, or a member group's with its overrides) builds
  its step, initial state and member form from, read once by build_parts."""
  seed: int
  options: StepOptions  # augmentation, precision, micro-batches, reproducible mode
  batch_size: int  # config.data.batch_size: each member's examples a step
  init_from: InitFrom
  member_parallelism: str  # config.ensemble's 'auto', 'vmap' or 'map'
  map_batch_size: int
  model_name: str
  # What the measured member forms' cache keys this stack by (run.member_forms.form_key):
  # its model (less where it starts from), data set, precision, optimizer, method.
  form_fields: dict[str, Any]
  distill: distill.DistillSpec | None  # config.distill as this stack's model checks it
  # Logged when the run starts fresh: shared leaves nothing trains (own.random_frozen_base).
  warning: str | None
  name: str = ''  # what tables call the stack: a member group's name ('' for the run's one)
  # The model and optim fields this stack's config overrides of the run's, as given
  # ({'model': {...}, 'optim': {...}}: a member group's); None for the run's one stack.
  overrides: dict[str, dict[str, Any]] | None = None


def stack_spec(config: ml_collections.ConfigDict) -> StackSpec:
  """The stack spec of a checked config (a member group's own config for a group)."""
  e = config.ensemble
  model = {k: v for k, v in config.model.to_dict().items() if k not in init_from_lib.FIELDS}
  form_fields = {'model': model, 'data': config.data.name, 'precision': config.precision,
                 'optim': config.optim.name, 'method': e.method,
                 'per_member_batches': config.data.member_order != 'shared'}
  if e.own != 'all':  # (Absent otherwise: the keys measured before stay.)
    form_fields['own'] = e.own
  return StackSpec(seed=config.seed, options=step_options(config),
                   batch_size=config.data.batch_size, init_from=init_from_spec(config),
                   member_parallelism=e.member_parallelism, map_batch_size=e.map_batch_size,
                   model_name=config.model.name, form_fields=form_fields,
                   distill=distill_spec(config),
                   warning=own_lib.random_frozen_base(e.own, config.model.init_from,
                                                      e.train_shared))


def step_options(config: ml_collections.ConfigDict) -> StepOptions:
  """Augmentation, precision, micro-batches and reproducible mode, as the config says."""
  augment = config.data.augment
  if is_import_path(augment):
    augment = load_object(augment, 'config.data.augment')
  augment = augment_lib.get_augmentation(augment, 'config.data.augment')
  return StepOptions(augment=None if augment is augment_lib.identity
                     else augment_lib.member_augmentation(augment, config.seed),
                     precision=config.precision, micro_batches=config.train.micro_batches,
                     reproducible=config.reproducible)
