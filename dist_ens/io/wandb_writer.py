"""`WandbWriter`: events to Weights & Biases (optional: `pip install wandb`)."""

import importlib.util
import os
import secrets
from pathlib import Path
from typing import Any

from dist_ens.errors import ConfigError
from dist_ens.io.file_sinks import flatten
from dist_ens.io.run_files import is_writer, write_text_atomic

WANDB_MISSING = ("config.writers names 'wandb' but the wandb package is not installed: "
                 "pip install wandb")


class WandbWriter:
  """Logs events to Weights & Biases (optional: `pip install wandb`), under `workdir`.

  Each value of `flatten(event)` is logged as '{split}/{name}' (e.g. 'test/ensemble/nll',
  'train/members/loss/3') at the event's step. The run's files go to
  `{workdir}/wandb/`; with WANDB_MODE=offline nothing leaves the machine (upload later
  with `wandb sync {workdir}/wandb/offline-run-*`). The project is $WANDB_PROJECT, else
  'dist_ens'; the run is named after the workdir. wandb's console capture is off (the
  run's log stays as it is).

  On resume (keep_through_step not None) the run id saved in `{workdir}/wandb/run_id`
  is resumed, so online the curves continue in the same run. W&B cannot delete history:
  steps the interrupted run logged after the checkpoint are replayed with the same
  values (resumed training is bit-for-bit the uninterrupted one) and W&B ignores the
  repeats. A fresh run (None) starts a new W&B run.
  """

  def __init__(self, workdir: str | os.PathLike, keep_through_step: int | None = None):
    self._run = None
    if not is_writer():
      return
    wandb = _import_wandb()
    directory = Path(workdir) / 'wandb'
    directory.mkdir(parents=True, exist_ok=True)
    id_file = directory / 'run_id'
    resume = keep_through_step is not None and id_file.exists()
    run_id = id_file.read_text().strip() if resume else secrets.token_hex(4)
    if not resume:
      write_text_atomic(id_file, run_id + '\n')
    self._run = wandb.init(
        project=os.environ.get('WANDB_PROJECT', 'dist_ens'), name=Path(workdir).resolve().name,
        id=run_id, resume='allow' if resume else None, dir=str(workdir),
        settings=wandb.Settings(console='off'))

  def write(self, event: dict[str, Any]) -> None:
    if self._run is None:
      return
    split = event.get('split', 'train')
    values = {f'{split}/{k}': v for k, v in flatten(event).items() if not isinstance(v, str)}
    self._run.log(values, step=int(event['step']))

  def close(self) -> None:
    if self._run is not None:
      self._run.finish()
      self._run = None


def wandb_installed() -> bool:
  """Whether wandb is installed (found on the path, not imported)."""
  return importlib.util.find_spec('wandb') is not None


def _import_wandb() -> Any:
  if not wandb_installed():
    raise ConfigError(WANDB_MISSING)
  import wandb  # pylint: disable=g-import-not-at-top
  return wandb
