"""Built-in models that load Hugging Face checkpoints exactly.

  model, params = dist_ens.models.from_hf('/ckpt/tiny-llama')   # or 'hf:org/name'
  logits, _ = model.apply(params, {}, ids, train=False)         # = transformers' logits

config.model.init_from='hf:PATH' builds the same model for training (its config.json
decides the architecture, whatever config.model.name says) and starts every member
from the file's weights (io/init_from.py): a classifier's head, sized for the task's
classes, starts per member as any head does.

ARCHITECTURES maps config.json's `architectures` names to the families here; each
family's module holds its weight table (the file's names and shapes -> params leaves)
and its forward pass. The checkpoint is a folder with config.json and model.safetensors
(or a sharded model.safetensors.index.json), or a hub id (checkpoint.locate).
"""

from typing import Any

import numpy as np

from dist_ens.core.model import Model
from dist_ens.errors import ConfigError
from dist_ens.models.hf import bert, gpt2, llama, vit
from dist_ens.models.hf.checkpoint import Tensors, is_hf, locate, read_config
from dist_ens.models.hf.weights import Family, Lazy, load, make_model, nest

ARCHITECTURES: dict[str, Family] = {
    'GPT2LMHeadModel': gpt2.FAMILY,  # logits per position [B, L, vocab]
    'LlamaForCausalLM': llama.FAMILY,  # logits per position [B, L, vocab]
    'BertForSequenceClassification': bert.BERT,  # logits per example [B, num_labels]
    'RobertaForSequenceClassification': bert.ROBERTA,
    'ViTForImageClassification': vit.FAMILY,  # NHWC images -> [B, num_labels]
}


def _architecture(config: dict[str, Any], where: str) -> tuple[str, Family]:
  names = config.get('architectures') or []
  known = [n for n in names if n in ARCHITECTURES]
  if not known:
    raise ConfigError(f"{where}: config.json's architectures {names} name none that "
                      f'dist_ens builds ({", ".join(ARCHITECTURES)}).')
  return known[0], ARCHITECTURES[known[0]]


def describe(source: str, where: str) -> tuple[Any, str, Family, Any]:
  """(folder, architecture name, family, arch sizes) of a checkpoint."""
  folder = locate(source, where)
  config = read_config(folder, where)
  name, family = _architecture(config, where)
  return folder, name, family, family.read(config, where)


def build(source: str, num_classes: int | None = None, dropout: float = 0.0,
          where: str = 'hf', *, training: bool = False, pool: str | None = None) -> Model:
  """The model config.json of `source` describes (no weights read); a classifier with
  `num_classes` outputs where given (None: config.json's num_labels). `training`: as
  config.model.init_from builds it, an encoder's padding masked and config.model.pool
  read (`pool`; None: the family's own; set for a family without one, refused)."""
  _, name, family, arch = describe(source, where)
  if num_classes is not None and family.with_classes is not None:
    arch = family.with_classes(arch, num_classes)
  if training and family.for_text is not None:
    arch = family.for_text(arch, pool, where)
  elif training and pool is not None:
    takers = [n for n, f in ARCHITECTURES.items() if f.for_text is not None]
    raise ConfigError(f'config.model.pool={pool!r}: {where} is a {name}, which has no '
                      f'pooling to choose (only {", ".join(takers)}); leave it unset.')
  return make_model(family, arch, dropout)


def load_leaves(source: str, where: str = 'hf', log: bool = True) -> dict[str, Lazy]:
  """Every weight of the checkpoint as {params leaf name: Lazy leaf} (read where
  indexed, np.asarray for all of it), each checked against the architecture's table
  and its file (one line naming the first that is missing, misshapen or cut short);
  only headers are read. `log`: say which of the file's tensors are unused."""
  folder, name, family, arch = describe(source, where)
  tensors = Tensors.open(folder, where)
  return load(tensors, family.weights(arch), family.prefix, where,
              f"config.json's {name}", log=log)


def from_hf(path: str) -> tuple[Model, Any]:
  """The built-in model of a Hugging Face checkpoint and one member's params.

  Args:
    path: a folder with config.json and model.safetensors (or a sharded index), or a
      hub id ('org/name'); 'hf:' in front is allowed.

  Returns:
    (model, params): model.apply(params, {}, x, train=False) gives transformers'
    outputs for config.json's architecture (see ARCHITECTURES).

  Raises:
    ConfigError: (one line) an architecture dist_ens does not build, a weight the
      file lacks or has in another shape, or a file cut short (naming it and the tensor).

  Example:
    >>> model, params = from_hf('tests/data/hf/gpt2')
    >>> model.apply(params, {}, np.zeros((1, 5), np.int32), train=False)[0].shape
    (1, 5, 96)
  """
  where = f'from_hf({str(path)!r})'
  model = build(path, where=where)
  return model, nest({name: np.asarray(leaf) for name, leaf in load_leaves(path, where).items()})


__all__ = ['ARCHITECTURES', 'build', 'from_hf', 'is_hf', 'load_leaves']
