"""Pretrained weights as one flat {leaf name: numpy array} dict, whatever file holds them.

  load_pretrained('/ckpt/vit.npz')          # np.savez of '/'-joined leaf names
  load_pretrained('/ckpt/vit.msgpack')      # flax.serialization.to_bytes / msgpack_serialize
  load_pretrained('/ckpt/vit.safetensors')  # read here with numpy (no dependency)
  load_pretrained('/ckpt/orbax_dir')        # an orbax pytree checkpoint directory
  load_pretrained('/runs/pretrain')         # a dist_ens workdir: its member 0
  load_pretrained('/runs/pretrain#3')       # ... its member 3
  load_pretrained('hf:/ckpt/tiny-llama')    # a Hugging Face checkpoint (dist_ens.models.hf)

Leaf names are the '/'-joined key paths the project uses everywhere
(parallel.sharding_rules.path_str): 'head/w', 'blocks/0/attn/q/w',
'params/Dense_0/kernel'. A dist_ens workdir's leaves come as 'params/...' and
'model_state/...'. What the names mean for a model (renames, heads) is
io/init_from.py's business; this module only reads.
"""

import math
import os
import re
from pathlib import Path
from typing import Any

import jax
from absl import logging
import numpy as np

from dist_ens.ensembles import batchensemble
from dist_ens.errors import ConfigError
from dist_ens.models.hf import safetensors_file
from dist_ens.parallel.sharding_rules import path_str

FIELD = 'config.model.init_from'
FORMATS = ('an .npz, a Flax .msgpack or a .safetensors file, an orbax checkpoint directory, '
           "or a dist_ens workdir ('PATH#i' for its member i)")


def flatten(tree: Any) -> dict[str, np.ndarray]:
  """A nested pytree (dicts, lists) as {'/'-joined path: numpy array}."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_str(path): np.asarray(leaf) for path, leaf in leaves}


def split_member(source: str) -> tuple[str, int | None]:
  """('PATH', i) for 'PATH#i'; (source, None) when it names no member."""
  match = re.fullmatch(r'(.*)#(\d+)', source)
  return (match[1], int(match[2])) if match else (source, None)


def load_pretrained(source: str | os.PathLike) -> dict[str, np.ndarray]:
  """Every leaf the file (or directory) holds, as {leaf name: numpy array}.

  Args:
    source: a path as in the module doc; 'PATH#i' picks member i of a dist_ens workdir.

  Raises:
    ConfigError: (one line, naming config.model.init_from) the path does not exist,
      is of no known format, or cannot be read.
  """
  if _is_hf(source):
    return _hf_leaves(source, log=True)
  path, member = _checked_path(source)
  try:
    if path.is_dir():
      return _read_directory(path, member or 0)
    return _READERS[path.suffix.lower()](path)
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # Any reader's failure: one line.
    detail = str(e).splitlines()[0][:300] if str(e) else ''
    raise ConfigError(f'{FIELD}={os.fspath(source)!r} cannot be read: {type(e).__name__}: '
                      f'{detail}') from None


def leaf_shapes(source: str | os.PathLike) -> dict[str, Any] | None:
  """{leaf name: an object with the leaf's .shape}, from headers alone, for the formats
  that have one: a Hugging Face checkpoint (its lazy leaves, each checked against the
  architecture and its file) and a .safetensors file (checked against its header).
  None for the others, which are read only whole; their path and format are checked.

  Cheap (no tensor is read): training calls it before it claims the workdir, so a file
  that load_pretrained would refuse is refused before anything is written.

  Raises:
    ConfigError: as load_pretrained, for what the headers and paths show.
  """
  if _is_hf(source):
    return _hf_leaves(source, log=False)
  path, _ = _checked_path(source)
  if path.is_dir() or path.suffix.lower() != '.safetensors':
    return None
  where = f'{FIELD}={str(path)!r}'
  return {name: jax.ShapeDtypeStruct(entry.shape, safetensors_file.numpy_dtype(entry, name, where))
          for name, entry in safetensors_file.read_header(path, where).items()}


def _is_hf(source: str | os.PathLike) -> bool:
  return isinstance(source, str) and source.startswith('hf:')


def _hf_leaves(source: str, log: bool) -> dict[str, Any]:
  """A Hugging Face checkpoint's lazy leaves (dist_ens.models.hf.load_leaves)."""
  from dist_ens.models import hf  # pylint: disable=import-outside-toplevel  # models import io
  return hf.load_leaves(source, where=f'{FIELD}={source!r}', log=log)


def _checked_path(source: str | os.PathLike) -> tuple[Path, int | None]:
  """(the path, the member 'PATH#i' picks), refused where the path does not exist, '#i'
  follows no workdir, or a file has no known format."""
  path, member = split_member(os.fspath(source))
  p = Path(path)
  if not p.exists():
    raise ConfigError(f'{FIELD}={os.fspath(source)!r}: no such file or directory; give '
                      f'{FORMATS}.')
  if member is not None and not (p / 'checkpoints').is_dir():
    raise ConfigError(f"{FIELD}={os.fspath(source)!r}: '#{member}' picks a member of a dist_ens "
                      f'workdir, but {path} is not one (it has no checkpoints/ directory).')
  if not p.is_dir() and p.suffix.lower() not in _READERS:
    raise ConfigError(f'{FIELD}={path!r}: unknown format {p.suffix.lower() or "(no suffix)"!r}; '
                      f'give {FORMATS}.')
  return p, member


def _read_npz(path: Path) -> dict[str, np.ndarray]:
  with np.load(path, allow_pickle=False) as f:
    return {key: f[key] for key in f.files}


def _read_msgpack(path: Path) -> dict[str, np.ndarray]:
  try:
    from flax import serialization  # pylint: disable=import-outside-toplevel  # optional extra
  except ImportError:
    raise ConfigError(f'{FIELD}={str(path)!r} is a Flax msgpack file; reading it needs flax '
                      '(pip install flax), or save the weights as .npz instead.') from None
  return flatten(serialization.msgpack_restore(path.read_bytes()))


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
  """Every tensor of a safetensors file, its header checked against the file first (a
  file cut short is refused naming the tensor: safetensors_file.read_header)."""
  where = f'{FIELD}={str(path)!r}'
  entries = safetensors_file.read_header(path, where)
  raw = path.read_bytes()
  out = {}
  for name, entry in entries.items():
    dtype = safetensors_file.numpy_dtype(entry, name, where)
    array = np.frombuffer(raw, dtype, math.prod(entry.shape), entry.begin).reshape(entry.shape)
    out[name] = array.astype(array.dtype.newbyteorder('='))
  return out


_READERS = {'.npz': _read_npz, '.msgpack': _read_msgpack, '.safetensors': _read_safetensors}


def _read_directory(path: Path, member: int) -> dict[str, np.ndarray]:
  """A dist_ens workdir's member, or an orbax pytree checkpoint (an item directory, or a
  step directory holding one item)."""
  if (path / 'checkpoints').is_dir():
    return _read_workdir(path, member)
  if _is_orbax_item(path):
    return flatten(read_orbax(path))
  items = [d for d in sorted(path.iterdir()) if d.is_dir() and _is_orbax_item(d)]
  if len(items) == 1:  # A step directory of one item (CheckpointManager's 'default').
    return flatten(read_orbax(items[0]))
  if items:
    raise ConfigError(f'{FIELD}={str(path)!r} is an orbax checkpoint of {len(items)} items '
                      f'{[d.name for d in items]}; name one item\'s directory.')
  raise ConfigError(f'{FIELD}={str(path)!r} is a directory but neither a dist_ens workdir '
                    f'(no checkpoints/) nor an orbax checkpoint; give {FORMATS}.')


def _is_orbax_item(path: Path) -> bool:
  return (path / '_METADATA').exists() or (path / 'manifest.ocdbt').exists()


def read_orbax(path: Path) -> Any:
  """An orbax pytree checkpoint as saved, every array read whole into host memory."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel  # slow import
  from etils import epath  # pylint: disable=import-outside-toplevel  # orbax's own paths

  # The handler's metadata, not a Checkpointer's: an item of a CheckpointManager's step
  # (a dist_ens checkpoint's 'model') has no step metadata of its own to warn about.
  tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(path.absolute())).tree
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
    return checkpointer.restore(path.absolute(), args=ocp.args.PyTreeRestore(restore_args=args))


def _read_workdir(workdir: Path, member: int) -> dict[str, np.ndarray]:
  """Member `member`'s params and model state from the workdir's newest checkpoint that
  reads ('params/...', 'model_state/...'); BatchEnsemble members formed from W, r, s."""
  steps = sorted((int(d.name) for d in (workdir / 'checkpoints').iterdir()
                  if d.name.isdigit() and (d / 'model').is_dir()), reverse=True)
  if not steps:
    raise ConfigError(f'{FIELD}={str(workdir)!r} is a dist_ens workdir without a '
                      'checkpoint; train it first (its run saves one at the end).')
  saved = read_orbax(workdir / 'checkpoints' / str(steps[0]) / 'model')
  count = len(saved['frozen'])
  if member >= count:
    raise ConfigError(f"{FIELD}='{workdir}#{member}': that run has members 0..{count - 1}.")
  if saved['frozen'][member]:
    logging.warning('%s: member %d of %s was frozen (non-finite) in training; its last finite '
                    'parameters are used.', FIELD, member, workdir)
  params = jax.tree_util.tree_map_with_path(
      lambda path, leaf: leaf if batchensemble.is_shared(path) else leaf[member],
      saved['params'])
  if any(batchensemble.is_shared(path) for path, _ in
         jax.tree_util.tree_flatten_with_path(saved['params'])[0]):
    params = jax.tree.map(np.asarray, batchensemble.member_params(params))
  model_state = jax.tree.map(lambda leaf: leaf[member], saved.get('model_state', {}))
  return {**{f'params/{k}': v for k, v in flatten(params).items()},
          **{f'model_state/{k}': v for k, v in flatten(model_state).items()}}
