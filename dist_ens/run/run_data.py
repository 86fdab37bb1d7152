"""A run's data: the dataset loaded, validation carved, the OOD split, the batch order,
member splits and standardisation (build_data; assemble.build_run calls it)."""

from typing import NamedTuple

import ml_collections
import numpy as np
from absl import logging

from dist_ens import data, tasks
from dist_ens.data import resident, uci
from dist_ens.errors import ConfigError
from dist_ens.eval import ood
from dist_ens.config.specs import data_spec


class RunData(NamedTuple):
  """The data of a training run."""
  # train (possibly without its validation examples; a data.resident.ResidentSource where
  # config.data.resident puts it on the devices) and test
  dataset: data.Dataset
  validation: data.Split | None  # config.data.validation_size examples, or None
  ood: data.Split | None  # config.eval.ood_dataset's split, or None
  order: data.Order  # which examples each step's batch holds
  # The training split's statistics every split was standardised with, for a task
  # that trains on standardised data (Task.unscale); None otherwise. With member_splits
  # they standardise only what evaluation scores (test, validation, OOD, held-out rows):
  # the pool's means and input stds, and per target dim the smallest split's std, the
  # units evaluation scores every member in (run/split_frames.py).
  scale: uci.Standardizer | None = None
  # config.data.member_split's splits of the training split (each member trains on its
  # split's part, order draws from it; evaluators/held_out.py evaluates the rest), or None.
  member_splits: data.MemberSplits | None = None
  # With member_splits and a standardising task: one Standardizer per split, fitted on
  # that split's training rows alone (held-out rows never enter them). dataset.train then
  # stays in its own units; the input pipeline standardises each member's batch with its
  # split's statistics (member_scale) and held_out.py each split's held-out rows.
  split_scales: tuple[uci.Standardizer, ...] | None = None

  @property
  def member_scale(self) -> uci.Standardizer | None:
    """split_scales per member: every field with a leading [M] axis (member m's split's
    statistics), what data.Batches standardises each member's batch with; else None."""
    if self.split_scales is None:
      return None
    splits = self.member_splits
    of = [splits.split_of(m) for m in range(splits.count * splits.members_per_split)]
    return uci.Standardizer(*(np.stack([s[i] for s in (self.split_scales[j] for j in of)])
                              for i in range(4)))


def build_data(config: ml_collections.ConfigDict, dataset: data.Dataset | None = None) -> RunData:
  """Loads the dataset (unless given), carves validation, loads the OOD split and fixes
  the batch order.

  Raises:
    ConfigError: a dataset that cannot load, targets the task refuses in the splits
      held in memory, or a batch larger than the training split.
  """
  if dataset is None:
    dataset = data.load_dataset(config.data.name, data_spec(config))
  task = tasks.get_task(config.task)
  for name, split in (('train', dataset.train), ('test', dataset.test)):
    if isinstance(split, data.Split):  # (A streamed TFDS split holds uint8 images.)
      data.check_finite_inputs(split.x, f'dataset {dataset.name!r} ({name} split)')
      task.check_targets(split.y, dataset, f'dataset {dataset.name!r} ({name} split)')
  _warn_class_ids_as_targets(config, task, dataset)
  validation = None
  if config.data.validation_size:
    train_source, validation = data.split_validation(dataset.train, config.data.validation_size)
    dataset = dataset._replace(train=train_source)
  if config.data.batch_size > dataset.train.num_examples:
    raise ConfigError(f'config.data.batch_size={config.data.batch_size} exceeds the '
                      f'{dataset.train.num_examples} training examples of {dataset.name}.')
  ood_name = config.eval.ood_dataset
  ood_split = ood.load_ood_split(ood_name, dataset, data_spec(config)) if ood_name else None
  if ood_split is not None:
    data.check_finite_inputs(ood_split.x, f'config.eval.ood_dataset={ood_name!r}')
  splits = _member_splits(config, dataset.train.num_examples)
  order = data.Order(config.data.member_order, dataset.train.num_examples,
                     config.data.batch_size, config.seed,
                     pools=splits and splits.train,
                     member_pool=splits and [splits.split_of(m) for m in range(config.num_members)])
  run_data = RunData(dataset, validation, ood_split, order, member_splits=splits)
  return _resident(config, run_data if task.unscale is None else _standardized(run_data))


def _resident(config: ml_collections.ConfigDict, run_data: RunData) -> RunData:
  """run_data with its training split resident on the devices (data/resident.py) where
  config.data.resident and its budget say so: data.Batches then gathers each batch there."""
  copies = 1 if run_data.split_scales is None else len(run_data.split_scales)
  train = resident.choose(config.data.resident, config.data.resident_budget_mb,
                          run_data.dataset.train, copies)
  return run_data._replace(dataset=run_data.dataset._replace(train=train))


def _warn_class_ids_as_targets(config: ml_collections.ConfigDict, task: tasks.Task,
                               dataset: data.Dataset) -> None:
  """One warning for a classification data set (integer labels, num_classes > 0) given to
  a task that fits its targets as numbers in their units (one with `unscale`: regression),
  where class 3 lies nearer 4 than 9: it trains, to a meaningless RMSE."""
  if dataset.num_classes and task.unscale is not None:
    logging.warning(
        'dataset %r has integer labels 0..%d, the class ids of a classification data set, '
        'and config.task=%r fits them as numbers; use task=\'classification\' if they are '
        'classes.', dataset.name, dataset.num_classes - 1, config.task)


def _member_splits(config: ml_collections.ConfigDict,
                   num_examples: int) -> data.MemberSplits | None:
  """config.data.member_split's splits of the training split, checked against the batch."""
  spec = config.data.member_split
  if not spec:
    return None
  splits = data.make_member_splits(spec, num_examples, config.num_members, config.seed)
  smallest = min(map(len, splits.train))
  if config.data.batch_size > smallest:
    raise ConfigError(f'config.data.batch_size={config.data.batch_size} exceeds the {smallest} '
                      f'training examples a member of config.data.member_split={spec!r} has; '
                      f'use a batch of at most {smallest}.')
  return splits


def _standardized(run_data: RunData) -> RunData:
  """Every split standardised with the training split's statistics (inputs and targets).

  With member splits, each split's statistics come from its own training rows only (a
  held-out row must not move them, or the held-out metrics see the test rows twice);
  the pool stays in its units for the pipeline to standardise per member.
  """
  train = run_data.dataset.train
  if not isinstance(train, data.Split):  # Streamed (TFDS) or carved: read it into memory.
    train = data.Split(*train.read(np.arange(train.num_examples)))
  scale = uci.Standardizer.fit(train.x, train.y)
  splits, split_scales = run_data.member_splits, None
  if splits is not None:
    split_scales = tuple(uci.Standardizer.fit(train.x[rows], train.y[rows])
                         for rows in splits.train)
    # Evaluation scores every member in these units (run/split_frames.py): a member's
    # variances there are its own times (its split's std / this std)^2 >= 1, so none falls
    # under the regression task's variance floor, however the splits' spreads differ.
    scale = scale._replace(y_std=np.min([s.y_std for s in split_scales], axis=0))
  apply = lambda split: split and data.Split(*scale.apply(split.x, split.y))
  dataset = run_data.dataset._replace(train=train if splits is not None else apply(train),
                                      test=apply(run_data.dataset.test))
  return run_data._replace(dataset=dataset, validation=apply(run_data.validation),
                           ood=apply(run_data.ood), scale=scale, split_scales=split_scales)
