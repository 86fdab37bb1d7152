"""Weight tables: each architecture lists, for config.json's sizes, every weight its
transformers class stores (the file's name and shape) and the params leaf it becomes.

One table serves three things: the model's init (every leaf drawn in the file's shape,
then converted, so the params tree cannot drift from what loading gives), loading
(each name looked up, its shape checked, then converted), and the one-line refusals
that name the weight and both shapes.

A name is the state dict's of the architecture class ('bert.encoder.layer.0...',
'classifier.weight'); a file saved from the base model alone ('encoder.layer.0...',
as some hub checkpoints are) is read too: the family's base prefix is dropped where
the full name is absent.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dist_ens.core.model import Model
from dist_ens.errors import ConfigError
from dist_ens.models.hf.checkpoint import Tensors

Array = Any  # a numpy or jax array: converters use only .T, indexing and reshape
INIT_STD = 0.02  # transformers' initializer_range default


def _same(a: Array) -> Array:
  return a


def _transpose(a: Array) -> Array:
  return a.T


class Weight(NamedTuple):
  """One stored tensor and the params leaf it becomes."""
  name: str  # in the file (the architecture class's state dict)
  shape: tuple[int, ...]  # in the file
  path: str  # the params leaf, '/'-joined ('blocks/0/attn/q/w')
  convert: Callable[[Array], Array] = _same  # file layout -> params layout
  init: str = 'normal'  # 'normal' (std INIT_STD), 'ones' or 'zeros', in the file's layout


def linear(name: str, path: str, fan_in: int, fan_out: int, bias: bool = True) -> list[Weight]:
  """A torch Linear: weight [out, in], transposed to w [in, out]; bias [out]."""
  out = [Weight(f'{name}.weight', (fan_out, fan_in), f'{path}/w', _transpose)]
  if bias:
    out.append(Weight(f'{name}.bias', (fan_out,), f'{path}/b', init='zeros'))
  return out


def conv1d(name: str, path: str, fan_in: int, fan_out: int) -> list[Weight]:
  """GPT-2's Conv1D: weight stored [in, out] already; bias [out]."""
  return [Weight(f'{name}.weight', (fan_in, fan_out), f'{path}/w'),
          Weight(f'{name}.bias', (fan_out,), f'{path}/b', init='zeros')]


def norm(name: str, path: str, features: int, bias: bool = True) -> list[Weight]:
  """A LayerNorm (weight, bias) or RMSNorm (weight) as {'scale'[, 'bias']}."""
  out = [Weight(f'{name}.weight', (features,), f'{path}/scale', init='ones')]
  if bias:
    out.append(Weight(f'{name}.bias', (features,), f'{path}/bias', init='zeros'))
  return out


@dataclasses.dataclass(frozen=True)
class Family:
  """An architecture (a transformers class) as dist_ens builds it.

  read(config_json, where) -> arch: the sizes (a frozen dataclass), checked.
  weights(arch) -> the weight table.
  make_apply(arch, dropout) -> apply(params, state, x, *, train, rng) of the contract.
  with_classes(arch, n) -> arch with an n-way classifier (None: outputs are not classes).
  for_text(arch, pool, where) -> arch as training builds an encoder of token ids (its
    config.model.pool, padding masked); None: the family takes no pool.
  """
  prefix: str  # the base model's name in the state dict ('bert.'), dropped where absent
  read: Callable[[Mapping[str, Any], str], Any]
  weights: Callable[[Any], list[Weight]]
  make_apply: Callable[[Any, float], Callable[..., Any]]
  with_classes: Callable[[Any, int], Any] | None = None
  for_text: Callable[[Any, str | None, str], Any] | None = None


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
  """{'blocks/0/attn/q/w': a} -> {'blocks': [{'attn': {'q': {'w': a}}}]}: a level whose
  keys are all digits becomes a list."""
  tree: dict[str, Any] = {}
  for path, value in flat.items():
    *parents, leaf = path.split('/')
    node = tree
    for key in parents:
      node = node.setdefault(key, {})
    node[leaf] = value

  def lists(node):
    if not isinstance(node, dict):
      return node
    if node and all(k.isdigit() for k in node):
      return [lists(node[k]) for k in sorted(node, key=int)]
    return {k: lists(v) for k, v in node.items()}

  return lists(tree)


def init_params(weights: Sequence[Weight], rng: jax.Array) -> dict[str, Any]:
  """The params of a table, normal weights from ONE draw cut into pieces (one random
  kernel to compile, as models/layers.he_normal_init says why)."""
  sizes = [math.prod(w.shape) for w in weights if w.init == 'normal']
  # Behind a barrier, as there: else XLA:GPU fuses the draw into every piece's slice.
  z = jax.lax.optimization_barrier(INIT_STD * jax.random.normal(rng, (sum(sizes),), jnp.float32))
  flat, start = {}, 0
  for w in weights:
    if w.init == 'normal':
      size = math.prod(w.shape)
      value, start = z[start:start + size].reshape(w.shape), start + size
    else:
      value = (jnp.ones if w.init == 'ones' else jnp.zeros)(w.shape, jnp.float32)
    flat[w.path] = w.convert(value)
  return nest(flat)


def make_model(family: Family, arch: Any, dropout: float) -> Model:
  """The Model of an architecture: init from its weight table, apply from its family."""
  weights = family.weights(arch)
  return Model(lambda rng, sample_x: (init_params(weights, rng), {}),
               family.make_apply(arch, dropout))


def file_name(name: str, tensors: Tensors, prefix: str) -> str | None:
  """The name `name` has in the file: itself, without the base prefix, or with an old
  LayerNorm's gamma/beta; None when absent."""
  candidates = [name]
  if prefix and name.startswith(prefix):
    candidates.append(name[len(prefix):])
  for candidate in list(candidates):
    if 'LayerNorm.' in candidate:
      candidates.append(candidate.replace('.weight', '.gamma').replace('.bias', '.beta'))
  return next((c for c in candidates if c in tensors), None)


class Lazy:
  """A params leaf as the file holds it, read only where indexed: lazy[index] reads
  that slice (of the converted tensor) alone, np.asarray(lazy) all of it; float32."""

  def __init__(self, tensors: Tensors, name: str, convert: Callable[[Array], Array]):
    self._tensors, self._name, self._convert = tensors, name, convert
    self.shape = tuple(convert(tensors.view(name)).shape)  # a view: nothing is read
    self.ndim, self.dtype = len(self.shape), np.dtype(np.float32)

  def __getitem__(self, index: Any) -> np.ndarray:
    return self._tensors.read(self._name, index, self._convert).astype(np.float32, copy=False)

  def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
    return self[()].astype(dtype or np.float32, copy=False)


def load(tensors: Tensors, weights: Sequence[Weight], prefix: str, where: str,
         what: str, log: bool = True) -> dict[str, Lazy]:
  """{params path: Lazy leaf} of every weight in the table, found in `tensors` (only
  the headers are read here); `log`: say which of the file's tensors are unused.

  Raises:
    ConfigError: (one line) a weight the file lacks, or has in another shape; `what`
      says which model wanted it ("config.json's LlamaForCausalLM").
  """
  out, used = {}, set()
  for w in weights:
    name = file_name(w.name, tensors, prefix)
    if name is None:
      raise ConfigError(f'{where}: the file lacks weight {w.name!r} of shape {w.shape}, '
                        f'which {what} needs.')
    if tensors.shape(name) != w.shape:
      raise ConfigError(f'{where}: weight {name!r} has shape {tensors.shape(name)} in the '
                        f'file, but {what} needs {w.shape}.')
    used.add(name)
    out[w.path] = Lazy(tensors, name, w.convert)
  unused = sorted(set(tensors) - used)
  if unused and log:
    logging.info('%s: %d tensors of the file are not used by %s: %s%s', where, len(unused),
                 what, ', '.join(unused[:4]), ' ...' if len(unused) > 4 else '')
  return out


def number(config: Mapping[str, Any], where: str, *names: str, default: Any = None) -> Any:
  """config.json's first present key of `names` (a field's old and new spellings), else
  `default`; a ConfigError when absent and no default."""
  for name in names:
    if config.get(name) is not None:
      return config[name]
  if default is None:
    raise ConfigError(f"{where}: config.json lacks {names[0]!r}, which its architecture "
                      'needs.')
  return default


def num_labels(config: Mapping[str, Any]) -> int:
  """A classifier's outputs: config.json's id2label count (transformers' num_labels)."""
  if config.get('id2label'):
    return len(config['id2label'])
  return int(config.get('num_labels', 2))
