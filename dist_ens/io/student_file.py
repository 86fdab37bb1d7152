"""workdir/student.npz: a distilled student (config.distill.student), readable with numpy.

Keys: 'params/<path>' and 'state/<path>' for the student's leaves, paths '/'-joined as
an exported member's (dist_ens.io.member_files.path_key: 'body/0/w', 'heads/w', '0/b'),
and '__meta__', a JSON string: the student kind, its number of heads, the training
step of the ensemble it was distilled from, the temperature, the input shape and the
class count. dist_ens.Ensemble.load(workdir).student() rebuilds it.
"""

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dist_ens.io.member_files import path_key

FILE = 'student.npz'
_META = '__meta__'


def _flat(prefix: str, tree: Any) -> dict[str, np.ndarray]:
  return {f'{prefix}/{path_key(p)}': np.asarray(leaf)
          for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def write(workdir: Path, params: Any, state: Any, meta: dict[str, Any]) -> Path:
  """Writes the student atomically (a temporary file renamed over the old one)."""
  path = Path(workdir) / FILE
  arrays = {**_flat('params', params), **_flat('state', state),
            _META: np.asarray(json.dumps(meta))}
  with tempfile.NamedTemporaryFile(dir=path.parent, suffix='.npz', delete=False) as tmp:
    np.savez(tmp, **arrays)
  os.replace(tmp.name, path)
  return path


def read_meta(workdir: Path) -> dict[str, Any] | None:
  """The student's meta, or None where the workdir holds no student."""
  path = Path(workdir) / FILE
  if not path.exists():
    return None
  with np.load(path) as f:
    return json.loads(str(f[_META]))


def read_variables(workdir: Path, params: Any, state: Any) -> tuple[Any, Any]:
  """(params, state) of the saved student in the structure of `params` and `state`
  (arrays or ShapeDtypeStructs of the same student, e.g. from jax.eval_shape).

  Raises:
    ValueError: the file's leaves are not those of the given structure (one line).
  """
  with np.load(Path(workdir) / FILE) as f:
    stored = {k: f[k] for k in f.files if k != _META}
  wanted = {**_flat_shapes('params', params), **_flat_shapes('state', state)}
  if set(stored) != set(wanted) or any(stored[k].shape != wanted[k] for k in wanted):
    raise ValueError(f'{Path(workdir) / FILE} does not hold this student\'s leaves (it has '
                     f'{sorted(stored)[:4]}..., the student {sorted(wanted)[:4]}...); '
                     'rerun the training command to distil again.')
  fill = lambda prefix, tree: jax.tree_util.tree_map_with_path(
      lambda p, _: stored[f'{prefix}/{path_key(p)}'], tree)
  return fill('params', params), fill('state', state)


def _flat_shapes(prefix: str, tree: Any) -> dict[str, tuple[int, ...]]:
  return {f'{prefix}/{path_key(p)}': tuple(leaf.shape)
          for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
