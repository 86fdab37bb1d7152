"""Tasks (what members predict and how it is scored): built-in by name, yours by import path.

  task = dist_ens.tasks.get_task('classification')  # or 'regression', 'regression_homoscedastic',
                                                    # 'token_classification'
  task = dist_ens.tasks.get_task('my_pkg.tasks:my_task')  # a Task, or a function -> Task
"""

from collections.abc import Callable

from dist_ens import importing
from dist_ens.errors import ConfigError
from dist_ens.tasks.classification import classification, smoothed_cross_entropy
from dist_ens.tasks.regression import (gaussian_nll_loss, mse_loss, regression,
                                       regression_homoscedastic)
from dist_ens.tasks.task import Loss, Task, check_outputs, check_steps
from dist_ens.tasks.token_classification import token_classification

TASKS: dict[str, Callable[[], Task]] = {
    'classification': classification,
    'regression': regression,
    'regression_homoscedastic': regression_homoscedastic,
    'token_classification': token_classification,
}


# config.train.loss: '' (the task's own), a name here, or your own by import path
# 'my_pkg.losses:fn' with fn(outputs [B, ...], targets [B, ...], hparams) -> the mean
# loss of one member's batch.
LOSSES: dict[str, Loss] = {'cross_entropy': smoothed_cross_entropy,
                           'gaussian_nll': gaussian_nll_loss, 'mse': mse_loss}
# The built-in tasks whose outputs each built-in loss reads: class scores, a mean and a
# variance per target, or the means alone. Another pairing fails inside the step's trace.
_LOSS_TASKS = {'cross_entropy': ('classification', 'token_classification'),
               'gaussian_nll': ('regression',), 'mse': ('regression_homoscedastic',)}


def loss_for(name: str, task: Task | None = None) -> Loss:
  """The loss config.train.loss names; '' is `task`'s own (classification's if None)."""
  if not name:
    return (task or classification()).loss
  if importing.is_import_path(name):
    return importing.load_object(name, 'config.train.loss')
  if name not in LOSSES:
    raise ConfigError(f'config.train.loss={name!r}; use one of {sorted(LOSSES)}, or your own '
                      "by import path, 'my_pkg.losses:my_loss'.")
  fits = _LOSS_TASKS[name]
  if task is not None and task.name in TASKS and task.name not in fits:
    raise ConfigError(f'config.train.loss={name!r} does not fit config.task={task.name!r}, '
                      f'whose outputs it cannot read; use it with task {" or ".join(fits)}, '
                      "or train.loss='' (the task's own loss).")
  return LOSSES[name]


def get_task(name: str, field: str = 'config.task') -> Task:
  """The task `name` names: a built-in (TASKS) or an import path to a Task or a
  function returning one."""
  if importing.is_import_path(name):
    obj = importing.load_object(name, field)
    task = obj if isinstance(obj, Task) else obj()
    if not isinstance(task, Task):
      raise ConfigError(f'{field}={name!r} gave a {type(task).__name__}, not a '
                        'dist_ens.tasks.Task (or a function returning one).')
    return task
  if name not in TASKS:
    raise ConfigError(f'{field}={name!r}; use one of {sorted(TASKS)}, or your own by import '
                      "path, 'my_pkg.tasks:my_task'.")
  return TASKS[name]()


__all__ = ['LOSSES', 'Loss', 'TASKS', 'Task', 'check_outputs', 'check_steps', 'classification', 'get_task', 'loss_for',
           'regression', 'regression_homoscedastic', 'token_classification']
