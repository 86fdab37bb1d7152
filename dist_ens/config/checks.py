"""The config checked before any device work: each field's declared check
(dist_ens/config/defaults.py) and what depends on other fields or on code, so a bad
config fails with one message that names the field, and nothing is compiled or written;
and train.epochs resolved into steps once the training split's size is known.
"""

import copy
import importlib
from typing import Any

import ml_collections
from absl import logging

from dist_ens import importing, models, tasks
from dist_ens.config import schema, specs
from dist_ens.config.loading import DEFAULT_CONFIG, check_declared, field_value, require
from dist_ens.core import hparams, model as model_lib, optim
from dist_ens.data.augment import AUGMENTATIONS
from dist_ens.data import grain_loader, resident
from dist_ens.data.pipeline import MEMBER_ORDERS
from dist_ens.ensembles import methods
from dist_ens.errors import ConfigError
from dist_ens.eval import shift_spec as shift_lib

# config.precision: what the model computes in (parameters stay float32 either way).
PRECISIONS = tuple(model_lib.PRECISIONS)
# The features that declare their fields beside their code (get_config's `_declared_in`),
# each module with its check: stack_configs(config) checks the feature's fields and returns
# the configs of the stacks it builds the run from ([] where it builds none).
FEATURES = tuple(importlib.import_module(f'dist_ens.config.{name}')
                 for name in schema.feature_modules(DEFAULT_CONFIG.read_text()))


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks the fields every run reads; raises ConfigError naming the first bad one.

  A field's own type and range are declared beside it in dist_ens/config/defaults.py
  (check_declared); what is checked here depends on other fields or on code. Names that
  live in registries (method, model, optimizer, schedule) are checked by their registry,
  here, with the list of valid names; a data set's name where it is read.
  """
  check_declared(config)
  _validate_names(config)
  calls = config.train.steps_per_call
  # With train.epochs, train.steps is set (and this checked again) by resolve_epochs.
  by_epochs = _validate_run_fields(config)
  for field in ('train.log_every', 'train.eval_every', 'checkpoint.every',
                *(() if by_epochs else ('train.steps',))):
    value = field_value(config, field)
    require(calls == 0 or value % calls == 0, field, value,
            f'must be a multiple of train.steps_per_call={calls} (a call runs that many '
            'steps; logs, evaluations and checkpoints happen between calls)')
  require(field_value(config, 'data.member_order') in MEMBER_ORDERS, 'data.member_order',
          config.data.member_order, f'use one of {list(MEMBER_ORDERS)}')
  require(resident.is_setting(field_value(config, 'data.resident')), 'data.resident',
          config.data.resident, "use 'auto', True or False")
  grain_loader.check_config(field_value(config, 'data.loader'), config.data.name,
                            config.data.resident)
  for field in ('data.mean', 'data.std'):
    value = field_value(config, field)
    require(isinstance(value, (tuple, list)) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value), field, value,
            'must be a tuple of numbers, one per input channel (or empty)')
  require(all(v > 0 for v in config.data.std), 'data.std', config.data.std, 'must be > 0')
  for field in ('data.mean', 'data.std'):
    value = field_value(config, field)
    require(hparams.float32_normal(value), field, value,
            'must be 0 or of float32 size (between 1.2e-38 and 3.4e38), as inputs are float32')
  eps = config.optim.eps
  require(hparams.float32_normal(eps), 'optim.eps', eps,
          'must be a number > 0 of float32 size, e.g. 1e-8')
  # The features first: a pairing one refuses is named as its own, not as the other
  # field's. The configs a stack is built from: each feature's stacks', or the run's.
  stacks = [one for feature in FEATURES for one in feature.stack_configs(config)] or [config]
  _validate_select(config)
  _validate_eval(config)
  # Per-member fields: numbers, lists of M numbers or specs.
  resolved = specs.resolve_hparams(config)
  _validate_pbt(config, by_epochs, stacks)
  _warn_shared_optimizer(config, resolved)


def _validate_names(config: ml_collections.ConfigDict) -> None:
  """The method, model and optimizer names a run builds from, each checked by its
  registry before any data is read: a misspelt name should not wait for a data set to
  load (a feature's stacks' own names are checked by the feature)."""
  methods.check_name(config.ensemble.method)
  models.check_name(specs.model_spec(config))
  try:
    optim.check_names(specs.optim_spec(config))
  except optim.SpecError as e:
    raise ConfigError(f'config.optim.{e}') from None


def _warn_shared_optimizer(config: ml_collections.ConfigDict, resolved: dict[str, Any]) -> None:
  """ensemble.train_shared: the shared leaves take one optimizer, with member 0's
  hyperparameters; a sweep of optim.* over members is said to reach only the owned ones."""
  varying = [k for k in hparams.varying(resolved) if k.startswith('optim.')]
  if field_value(config, 'ensemble.train_shared') is True and varying:
    logging.warning('config.ensemble.train_shared=True: the shared leaves train with member '
                    "0's %s; config.hparams' sweep of them over members applies to each "
                    "member's own leaves only.", ', '.join(varying))


def _validate_select(config: ml_collections.ConfigDict) -> None:
  """select.metric is one config.task ranks by; top_k needs a validation split."""
  task = tasks.get_task(field_value(config, 'task'))
  require(field_value(config, 'select.metric') in task.select_metrics, 'select.metric',
          config.select.metric, f'use one of {list(task.select_metrics)} (config.task='
          f'{task.name!r})')
  value = config.select.top_k
  require(value <= config.num_members, 'select.top_k', value,
          f'must be an int in [0, num_members={config.num_members}]')
  require(value == 0 or config.data.validation_size > 0, 'select.top_k', value,
          'selects members on a validation split; set data.validation_size > 0 (e.g. 500)')


def _validate_pbt(config: ml_collections.ConfigDict, by_epochs: bool,
                  stacks: list[ml_collections.ConfigDict]) -> None:
  """config.pbt: its own fields (specs.pbt_spec), and what it needs of the rest of the run
  (of each stack's config: `stacks`)."""
  enabled = config.pbt.enabled
  if not enabled:
    return
  require(config.data.validation_size > 0, 'pbt.enabled', enabled,
          'ranks members on a validation split; set data.validation_size > 0 (e.g. 500)')
  for one in stacks:  # A stack may have its own `own`.
    require(one.ensemble.own == 'all', 'pbt.enabled', enabled,
            f'copies whole members, so it needs ensemble.own=\'all\' (not '
            f'{one.ensemble.own!r}, whose shared leaves are no member\'s to copy)')
  require(not config.data.member_split, 'pbt.enabled', enabled,
          f'copies members between data.member_split={config.data.member_split!r}\'s splits, '
          'whose members train on different data; use one or the other')
  spec = specs.pbt_spec(config)
  require(by_epochs or spec.interval < config.train.steps, 'pbt.interval', spec.interval,
          f'must be below train.steps={config.train.steps} (no round at the last step)')
  calls = config.train.steps_per_call
  require(calls == 0 or spec.interval % calls == 0, 'pbt.interval', spec.interval,
          f'must be a multiple of train.steps_per_call={calls} (rounds happen between calls)')


def _validate_eval(config: ml_collections.ConfigDict) -> None:
  """eval.shift names known corruptions and severities (or 'tfds:NAME'), with
  eval.shift_baseline a string."""
  shift_lib.check_fields(field_value(config, 'eval.shift'),
                         field_value(config, 'eval.shift_baseline'))


def _validate_run_fields(config: ml_collections.ConfigDict) -> bool:
  """Checks precision, data.augment, train.micro_batches against the batch and the two
  ways of giving the warm-up; returns whether the run's length is given in epochs."""
  value = field_value(config, 'precision')
  require(value in PRECISIONS, 'precision', value, f'use one of {list(PRECISIONS)}')
  value = field_value(config, 'data.augment')
  require(value in AUGMENTATIONS or importing.is_import_path(value), 'data.augment', value,
          f"use one of {sorted(AUGMENTATIONS)}, or your own fn(key, x_example) -> x_example "
          "by import path, 'my_pkg.aug:fn'")
  value, batch = config.train.micro_batches, config.data.batch_size
  require(batch % value == 0, 'train.micro_batches', value,
          f'must divide data.batch_size={batch}, e.g. '
          f'{max(d for d in range(1, min(value, batch) + 1) if batch % d == 0)}')
  warmup_epochs = config.optim.warmup_epochs
  require(not (warmup_epochs and config.optim.warmup_steps), 'optim.warmup_epochs',
          warmup_epochs, f'and optim.warmup_steps={config.optim.warmup_steps} are both set; '
          'give the warm-up in one of them and set the other to 0')
  return config.train.epochs > 0


def steps_per_epoch(config: ml_collections.ConfigDict, num_train_examples: int) -> int:
  """Batches in one pass over the training examples (the last partial batch dropped)."""
  return num_train_examples // config.data.batch_size


def resolve_epochs(config: ml_collections.ConfigDict,
                   num_train_examples: int) -> ml_collections.ConfigDict:
  """The config with train.steps = train.epochs * steps_per_epoch when train.epochs > 0
  and optim.warmup_steps = round(optim.warmup_epochs * steps_per_epoch) when
  optim.warmup_epochs > 0 (a copy; the config itself if it counts steps).

  Call it once the training split's size is known (after any validation examples are
  carved off) and before the optimizer is built, so that the trainer, the schedule and
  the plan all see one number of steps. The copy records the steps it trains for, so
  a resumed run compares them like any other.

  Example:
    >>> config.train.epochs, config.data.batch_size = 200, 512
    >>> resolve_epochs(config, 50_000).train.steps  # 200 * (50000 // 512)
    19400

  Raises:
    ConfigError: naming train.epochs if it gives no step, or the field that the
      resulting train.steps does not suit (e.g. a multiple of train.steps_per_call).
  """
  epochs, warmup_epochs = config.train.epochs, config.optim.warmup_epochs
  if not epochs and not warmup_epochs:
    return config
  per_epoch = steps_per_epoch(config, num_train_examples)
  require(per_epoch >= 1, 'data.batch_size', config.data.batch_size,
          f'exceeds the {num_train_examples} training examples')
  resolved = copy.deepcopy(config)  # Keeps the lock and the per-member fields' types.
  if warmup_epochs:
    resolved.optim.warmup_steps = round(warmup_epochs * per_epoch)
  if not epochs:
    return resolved
  resolved.train.steps = epochs * per_epoch
  calls = resolved.train.steps_per_call
  require(calls == 0 or resolved.train.steps % calls == 0, 'train.epochs', epochs,
          f'gives train.steps={resolved.train.steps} ({per_epoch} steps an epoch), not a '
          f'multiple of train.steps_per_call={calls}; use train.steps_per_call=0 (automatic)')
  return resolved
