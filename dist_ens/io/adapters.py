"""A LoRA ensemble's adapters unmerged (config.ensemble.own='lora', ensembles/lora.py).

`Ensemble.member(i)` and `Ensemble.export` give each member's MERGED params, W + scale *
A @ B, the tree model.apply takes. `export_adapters` writes what the run trained instead:
the frozen base once and each member's small adapter file, as peft keeps adapters apart
from their base model (M members of a large backbone: one backbone file, M small ones).
"""

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from dist_ens.ensembles import lora
from dist_ens.io.pretrained import flatten, read_orbax


def _save(path: Path, arrays: dict[str, np.ndarray]) -> None:
  with tempfile.NamedTemporaryFile(dir=path.parent, suffix='.npz', delete=False) as tmp:
    np.savez(tmp, **arrays)
  os.replace(tmp.name, path)


def newest_params(workdir: Path) -> tuple[int, dict[str, Any]]:
  """(step, params) of the newest checkpoint in `workdir`, the params flat by path."""
  root = workdir / 'checkpoints'
  steps = sorted(int(d.name) for d in root.iterdir() if d.name.isdigit()) if root.is_dir() else []
  if not steps:
    raise FileNotFoundError(f'{root} holds no checkpoint: train the LoRA run first.')
  return steps[-1], flatten(read_orbax(root / str(steps[-1]) / 'model')['params'])


def export_adapters(workdir: str | os.PathLike, directory: str | os.PathLike) -> list[Path]:
  """Writes a LoRA run's newest checkpoint as base.npz and adapter_{i}.npz per member.

  base.npz holds every shared leaf once under the model's names ('0/w', '0/b'): the
  frozen kernels W and the rest of the backbone. adapter_{i}.npz holds member i's own
  leaves (its head, '1/w') and, per adapted kernel NAME, 'NAME/lora_a' [in, r],
  'NAME/lora_b' [r, out] and 'NAME/lora_scale' (alpha / r), so that its kernel is

    base[NAME] + s * (a[NAME + '/lora_a'] @ a[NAME + '/lora_b']).reshape(base[NAME].shape)

  Example:
    paths = export_adapters('/tmp/lora_run', '/tmp/adapters')

  Returns:
    The adapter files' paths, in member order.

  Raises:
    FileNotFoundError: `workdir` has no checkpoint.
    ValueError: its run is not a LoRA ensemble (no factors in the checkpoint).
  """
  step, params = newest_params(Path(workdir))
  if not any(name.endswith('/' + lora.A) for name in params):
    raise ValueError(f"{workdir} holds no LoRA factors: export_adapters needs a run with "
                     "config.ensemble.own='lora' (Ensemble.export writes any run's members).")
  base, per_member, count = {}, {}, 0
  for name, leaf in params.items():
    head, key = name.rsplit('/', 1)
    if key == 'shared':
      base[head] = leaf
    elif key == lora.SCALE:
      per_member[name] = leaf
    else:
      per_member[head if key == 'own' else name] = leaf
      count = len(leaf)
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  _save(directory / 'base.npz', base)
  paths = [directory / f'adapter_{i}.npz' for i in range(count)]
  for i, path in enumerate(paths):
    _save(path, {k: v if k.endswith(lora.SCALE) else v[i] for k, v in per_member.items()})
  (directory / 'adapters.json').write_text(json.dumps(
      {'format': 'member i kernel NAME = base[NAME] + NAME/lora_scale * NAME/lora_a @ '
                 'NAME/lora_b (adapter_i.npz); other leaves from base.npz or adapter_i.npz',
       'step': step, 'num_members': count}, indent=2))
  return paths
