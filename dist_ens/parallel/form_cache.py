"""The cache of measured member forms: what `dist-ens plan --calibrate` found fastest.

`member_parallelism='auto'` uses a cached form when one was measured for the run's
key (what a step's speed depends on: the platform and device kind, the model config,
precision, optimizer, members per device and each device's batch), else the rules of
parallel/strategy.py. The measuring itself is dist_ens/plan/calibration.py.

The cache is one JSON file: $DIST_ENS_CALIBRATION, else
~/.cache/dist_ens/calibration.json.
"""


import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from dist_ens.parallel.strategy import Form

CACHE_ENV = 'DIST_ENS_CALIBRATION'


def cache_path() -> Path:
  return Path(os.environ.get(CACHE_ENV) or Path.home() / '.cache' / 'dist_ens' /
              'calibration.json')


def key(run_fields: Mapping[str, Any], device: jax.Device, members_per_device: int,
        batch_per_device: int) -> str:
  """What a step's speed depends on, as a short stable hash: `run_fields` (the run's
  model config, data set, precision, optimizer, method and whether each member has
  its own batches: member_forms.form_key), the device, and how much each device holds."""
  fields = {'platform': device.platform, 'device_kind': device.device_kind, **run_fields,
            'members_per_device': members_per_device, 'batch_per_device': batch_per_device,
            'jax': jax.__version__}
  text = json.dumps(fields, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read() -> dict[str, Any]:
  try:
    return json.loads(cache_path().read_text())
  except (FileNotFoundError, json.JSONDecodeError):
    return {}


def lookup(cache_key: str) -> Form | None:
  """The calibrated form for this key, or None."""
  entry = _read().get(cache_key)
  return (entry['form'][0], entry['form'][1]) if entry else None


def store(cache_key: str, form: Form, seconds: dict[str, float], about: str) -> None:
  entries = _read()
  entries[cache_key] = {'form': list(form), 'seconds_per_step': seconds, 'about': about,
                        'date': time.strftime('%Y-%m-%d')}
  path = cache_path()
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix('.tmp')
  tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
  tmp.replace(path)

