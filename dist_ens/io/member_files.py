"""Exported members: one .npz per member, leaves under '/'-joined pytree paths, readable
with numpy alone (Ensemble.export writes them; load_member reads one back)."""

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

PyTree = Any


def path_key(path: tuple[Any, ...]) -> str:
  """A leaf's path as the key it is stored under: '0/w', 'convs/1/b', 'head/w'."""
  parts = []
  for entry in path:
    if isinstance(entry, jax.tree_util.SequenceKey):
      parts.append(str(entry.idx))
    elif isinstance(entry, jax.tree_util.DictKey):
      parts.append(str(entry.key))
    elif isinstance(entry, jax.tree_util.GetAttrKey):
      parts.append(entry.name)
    else:
      parts.append(str(entry))
  return '/'.join(parts)


def write_members(files: dict[Path, PyTree]) -> None:
  """Writes each pytree to its .npz path (leaves under path_key), each file replaced
  atomically; the directories are created."""
  for path, tree in files.items():
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = {path_key(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix='.npz', delete=False) as tmp:
      np.savez(tmp, **flat)
    os.replace(tmp.name, path)


def load_member(path: str | os.PathLike) -> PyTree:
  """One exported member's parameters as nested dicts and lists (numpy only).

  Nested dicts are rebuilt from the '/'-joined keys; a level whose keys are all
  integers becomes a list. A model whose params are dicts and lists (the built-in MLP,
  CNN, ResNets, ViT; linen's and Haiku's params) gets its pytree back as trained; any
  other node (the NamedTuples of an SNGP or rank-1 member, an Equinox module, an nnx
  State) comes back as a dict of its children under their key names.

  Example:
    params = load_member('/tmp/members/member_0.npz')
    params[0]['w'].shape  # MLP: first layer's weights
  """
  with np.load(path) as f:
    flat = {key: f[key] for key in f.files}
  tree: dict[str, Any] = {}
  for key, value in flat.items():
    node = tree
    *parents, leaf = key.split('/')
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value

  def listify(node: Any) -> Any:
    if not isinstance(node, dict):
      return node
    node = {k: listify(v) for k, v in node.items()}
    if node and all(k.isdigit() for k in node):
      return [node[str(i)] for i in range(len(node))]
    return node

  return listify(tree)


def standardizer_dict(scale: Any) -> dict[str, list[float]]:
  """A uci.Standardizer (x_mean, x_std, y_mean, y_std) as JSON lists."""
  return {k: np.asarray(v).tolist() for k, v in scale._asdict().items()}


def export_members(ensemble: Any, directory: Path, about: dict[str, Any],
                   stacks: Sequence[dict[str, Any]] = ()) -> list[Path]:
  """Writes `ensemble` (an inference.Ensemble) member by member under `directory`
  (created if missing; existing member files are replaced); only process 0 writes.

  Files: `member_{i}.npz` holding the member's leaves under '/'-joined pytree paths
  (e.g. '0/w', 'convs/1/b', 'head/w'; integer parts are list indices);
  `member_{i}_state.npz`, the same for its model state (BatchNorm statistics, a
  randomized prior's network) where the model has one; and `ensemble.json` with the
  model config, input shape, class count, step and the frozen members, and, where the
  members are several stacks of their own architectures (docs/groups.md), `groups`: each
  stack's name, member ids and whole model config, the architecture of those members'
  files. Read one back
  with numpy alone (`np.load(path)`) or as the original pytree with `load_member(path)`.
  Returns the member files' paths, in member order.
  """
  m = ensemble.num_members
  paths = [directory / f'member_{i}.npz' for i in range(m)]
  files = {path: ensemble.member(i) for i, path in enumerate(paths)}  # Every process takes part.
  if jax.tree.leaves(ensemble.model_state):
    files.update({directory / f'member_{i}_state.npz': ensemble.member_state(i)
                  for i in range(m)})
  if jax.process_index() != 0:
    return paths
  write_members(files)
  meta = {'format': 'dist_ens member .npz: leaves under "/"-joined pytree paths; integer '
                    'parts are list indices',
          'num_members': m, 'step': ensemble.step,
          'frozen_members': np.flatnonzero(ensemble.frozen).tolist(),
          'input_shape': list(ensemble.input_shape), 'num_classes': ensemble.num_classes,
          **about,  # the run's data set, model config and task
          'model_state_files': len(files) > len(paths)}  # member_{i}_state.npz
  if stacks:  # Members of different architectures: which model each member's file is.
    meta['groups'] = list(stacks)
  if ensemble.scale is not None:  # A standardising task's members predict standardised units.
    meta['standardizer'] = standardizer_dict(ensemble.scale)
  if ensemble.split_scales is not None:  # Member splits: member i uses split i // per_split's.
    meta['members_per_split'] = m // len(ensemble.split_scales)
    meta['split_standardizers'] = [standardizer_dict(s) for s in ensemble.split_scales]
  (directory / 'ensemble.json').write_text(json.dumps(meta, indent=2, default=list))
  return paths
