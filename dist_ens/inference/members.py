"""One member of a loaded ensemble on its own: its parameters, model state and config,
and the files that carry members out of dist_ens (npz, PEFT adapters).

MemberAccess is the part of inference.Ensemble that reads single members; Ensemble
sets what it reads: config, num_members, model_state, workdir (after load), the stored
params `_stored`, the jitted row takers `_takes` (each stack's: a member formed from its
stack's stored params, shared leaves included) and `_take_state` (one row of a stack),
and `_places` (where each stack's members sit: core/stacks.py).
"""

import os
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from dist_ens.config import groups as member_groups
from dist_ens.io import member_files

PyTree = Any


class MemberAccess:
  """Ensemble's per-member methods (see the module doc for what Ensemble provides)."""

  def _row(self, tree: PyTree, i: int, what: str) -> tuple[PyTree, int, int]:
    """(the stack of `tree` that holds member i, its row there, the stack's index)."""
    self._check_member(i, what)
    s, row = self._places.locate(i)
    return self._places.split_tree(tree)[s], row, s

  def _check_member(self, i: int, what: str) -> None:
    if not 0 <= i < self.num_members:
      raise IndexError(f'{what}({i}): this ensemble has members 0..{self.num_members - 1}.')

  def member(self, i: int) -> PyTree:
    """Member i's parameters as a plain pytree of numpy arrays (no member axis).

    Example:
      params = ens.member(0)
      logits = ens.model.apply(params, x)  # one member, as trained
    """
    stack, row, s = self._row(self._stored, i, 'member')
    return jax.tree.map(np.asarray, self._takes[s](stack, np.int32(row)))

  def member_state(self, i: int) -> PyTree:
    """Member i's model state as a plain pytree of numpy arrays (no member axis): its
    BatchNorm statistics, a randomized prior's network; {} for a model without one.

    Example:
      logits, _ = ens.model.apply(ens.member(0), ens.member_state(0), x, train=False)
    """
    stack, row, _ = self._row(self.model_state, i, 'member_state')
    return jax.tree.map(np.asarray, self._take_state(stack, np.int32(row)))

  def member_config(self, i: int) -> ml_collections.ConfigDict:
    """The config member i was built from: the run's, with its group's model and optim
    overrides where config.ensemble.groups gives members different architectures.

    Example:
      spec = dist_ens.config.specs.model_spec(ens.member_config(5))
      model = dist_ens.models.get_model(spec, ens.num_classes)   # member 5's architecture
    """
    self._check_member(i, 'member_config')
    return member_groups.member_config(self.config, i)

  def export(self, directory: str | os.PathLike) -> list[Path]:
    """Writes each member as its own .npz file (member_{i}.npz, member_{i}_state.npz where
    the model has a state, ensemble.json), usable without dist_ens or JAX; the files'
    format: dist_ens.io.member_files.export_members. Only process 0 writes.

    Example:
      paths = ens.export('/tmp/members')
      params = load_member(paths[0])        # == ens.member(0)

    Returns:
      The member files' paths, in member order.
    """
    groups = []
    for spec in member_groups.group_specs(self.config):
      one = member_groups.group_config(self.config, spec)
      groups.append({'name': spec.name, 'members': list(range(spec.group.first,
                                                              spec.group.first + spec.group.count)),
                     'model': one.model.to_dict(), 'method': one.ensemble.method,
                     'own': one.ensemble.own})
    about = {'data': self.config.data.name, 'model': self.config.model.to_dict(),
             'task': self.config.task}
    return member_files.export_members(self, Path(directory), about, groups)

  def export_adapters(self, directory: str | os.PathLike) -> list[Path]:
    """A LoRA ensemble on a Hugging Face model (init_from='hf:PATH', own='lora') as PEFT
    adapters, directory/member_{i}/ (adapter_config.json, adapter_model.safetensors):
    `peft.PeftModel.from_pretrained(transformers_model, directory / 'member_0')` gives
    member 0's outputs (dist_ens.io.peft_adapters; docs/pretrained.md). Only process 0
    writes."""
    member_groups.refuse(self.config, 'Ensemble.export_adapters')
    if getattr(self, 'workdir', None) is None:
      raise ValueError('export_adapters needs an Ensemble from Ensemble.load(workdir).')
    if jax.process_index() != 0:
      return [Path(directory) / f'member_{i}' for i in range(self.num_members)]
    from dist_ens.io import peft_adapters  # pylint: disable=import-outside-toplevel
    return peft_adapters.export_peft(self.workdir, directory)
