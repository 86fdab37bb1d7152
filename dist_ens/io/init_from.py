"""config.model.init_from: every member starts from pretrained leaves, matched by name.

  spec = specs.init_from_spec(config)            # InitFrom(source, init_map, owned_from_file)
  pretrained = pretrained_leaves(spec, model, sample_x, num_outputs, mesh, layout)
  init_state(..., pretrained=pretrained)         # initial_state.init_sharded does both
  check_pretrained(spec, model, ...)             # its refusals from headers, before training

Names. The model's leaves are named by their '/'-joined paths within one member's
params or model_state ('head/w', 'batch_stats/BatchNorm_0/mean'); the file's by
io/pretrained.py. Each file name goes through config.model.init_map, (regex,
replacement) pairs applied in order with re.sub (a name mapped to '' is dropped), and
then names the model leaf of that path: a name starting 'params/' or 'model_state/'
only in that part (a dist_ens workdir's, a Flax variables dict's 'params/...'), any
other first in params, then in model_state.

What starts where: every params leaf from the file, except the leaves each member owns
(config.ensemble.own's; with own='all' the output head, models/heads.py), which start
per member from (seed, member) as without init_from, unless
config.model.init_owned_from_file; model_state
leaves (BatchNorm statistics) from the file where it has them. The optimizer state is
always fresh. A method that wraps the model (an epinet: Method.wrapped_under='base') reads
the file as the wrapped model's: a name the model lacks is tried under 'base/', and the
method's leaves beside it start per member whatever the file holds. Values are cast to
the model's dtypes and placed on the mesh as one member's leaves are (the layout's rule),
then broadcast over the member axis inside the jitted init (core.state.init_state), so
the state is born sharded as without a file.
"""

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dist_ens.core.model import Model
from dist_ens.core.state import Pretrained
from dist_ens.errors import ConfigError
from dist_ens.io.pretrained import FIELD, leaf_shapes, load_pretrained
from dist_ens.models.heads import head_paths
from dist_ens.parallel.layout import Layout
from dist_ens.parallel.sharding_rules import path_str

PyTree = Any
PARTS = ('params', 'model_state')
# config.model's fields read here: where the weights start, not how fast a step runs (a
# run's measured member form, member_forms.form_key, leaves them out).
FIELDS = ('init_from', 'init_map', 'init_owned_from_file')


@dataclasses.dataclass(frozen=True)
class InitFrom:
  """config.model's init_from, init_map and init_owned_from_file (see configs/default.py)."""
  source: str  # '' = off
  init_map: tuple[tuple[str, str], ...] = ()
  owned_from_file: bool = False


class Matched(NamedTuple):
  """The file's values for the model's leaves, by part ('params', 'model_state') and name
  (arrays, or lazy leaves that read what is indexed), cast where placed."""
  params: dict[str, np.ndarray]
  model_state: dict[str, np.ndarray]


def rename(flat: Mapping[str, np.ndarray],
           init_map: tuple[tuple[str, str], ...]) -> dict[str, tuple[str, np.ndarray]]:
  """{name after init_map: (the file's name, value)}; names mapped to '' are dropped.

  Raises:
    ConfigError: a regex that does not compile, or two file leaves given one name.
  """
  try:
    pairs = [(re.compile(regex), replacement) for regex, replacement in init_map]
  except (re.error, TypeError, ValueError) as e:
    raise ConfigError(f'config.model.init_map={init_map!r} must be (regex, replacement) '
                      f"pairs, e.g. (('^encoder/', ''),): {e}") from None
  out: dict[str, tuple[str, np.ndarray]] = {}
  for name, value in flat.items():
    new = name
    for regex, replacement in pairs:
      new = regex.sub(replacement, new)
    if not new:
      continue
    if new in out:
      raise ConfigError(f'config.model.init_map gives the file leaves {out[new][0]!r} and '
                        f'{name!r} the same name {new!r}; make the map tell them apart.')
    out[new] = (name, value)
  return out


def _target(name: str, model: Mapping[tuple[str, str], Any],
            under: str = '') -> tuple[str, str] | None:
  """The model leaf (part, name) a file name (after init_map) names, or None; with
  `under`, a name the model lacks is tried again under it ('0/w' -> 'base/0/w')."""
  for part in PARTS:
    if name.startswith(part + '/'):
      rest = name[len(part) + 1:]
      tries = (rest, f'{under}/{rest}') if under else (rest,)
      return next(((part, n) for n in tries if (part, n) in model), None)
  tries = (name, f'{under}/{name}') if under else (name,)
  return next(((part, n) for n in tries for part in PARTS if (part, n) in model), None)


def _beside(name: str, under: str) -> bool:
  """Whether a model leaf is the method's, beside the wrapped model under `under`."""
  return bool(under) and not name.startswith(under + '/')


def _shapes(params: PyTree, model_state: PyTree) -> dict[tuple[str, str], Any]:
  """{(part, name): ShapeDtypeStruct} of one member's leaves."""
  return {(part, path_str(path)): leaf for part, tree in zip(PARTS, (params, model_state))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _few(names: list[str]) -> str:
  shown = ', '.join(repr(n) for n in names[:3])
  return shown + (f' and {len(names) - 3} more' if len(names) > 3 else '')


def match(flat: Mapping[str, np.ndarray], params: PyTree, model_state: PyTree,
          spec: InitFrom, owned: frozenset[str], under: str = '', log: bool = True) -> Matched:
  """The file's values (cast to the model's dtypes) for every leaf they start.

  Args:
    flat: the file's leaves (io.pretrained.load_pretrained).
    params, model_state: one member's (ShapeDtypeStructs, no member axis).
    spec: the config's init_from fields.
    owned: names of the params leaves each member owns (its head).
    under: where a method keeps the model's leaves (Method.wrapped_under, an epinet's
      'base'): the file's names reach them with or without it, and the leaves beside
      them (the method's) start per member, whatever the file holds.
    log: say which leaves start from the file and which per member.

  Raises:
    ConfigError, one line naming the leaf: a file leaf that names no model leaf, a
      params leaf (not owned) the file lacks, or a leaf whose shapes differ.
  """
  model = _shapes(params, model_state)
  found, unexpected = {}, []
  for name, (file_name, value) in rename(flat, spec.init_map).items():
    key = _target(name, model, under)
    if key is None:
      unexpected.append(name if name == file_name else f'{file_name} (as {name})')
    elif not _beside(key[1], under):
      found[key] = (file_name, value)
  if unexpected:
    some = sorted(f'{part}/{name}' for part, name in model)[:4]
    raise ConfigError(f'{FIELD}={spec.source!r}: the file\'s leaf {_few(unexpected)} names no '
                      f'leaf of the model (its leaves: {", ".join(some)}, ...); rename with '
                      "config.model.init_map, or drop with (regex, '').")
  out, missing, fresh_owned, fresh_state = Matched({}, {}), [], [], []
  for (part, name), leaf in model.items():
    is_owned = part == 'params' and (name in owned or _beside(name, under))
    if (part, name) not in found or (is_owned and not spec.owned_from_file):
      if is_owned:
        fresh_owned.append(name)
      elif part == 'model_state':
        fresh_state.append(name)
      else:
        missing.append(name)
      continue
    file_name, value = found[(part, name)]
    if tuple(value.shape) != tuple(leaf.shape):
      raise ConfigError(f'{FIELD}={spec.source!r}: leaf {part}/{name} has shape '
                        f'{tuple(leaf.shape)} in the model but {tuple(value.shape)} in the file '
                        f'(as {file_name!r}).')
    # Kept as given: a lazy leaf (models/hf) is read slice by slice where placed.
    getattr(out, part)[name] = value
  if missing:
    raise ConfigError(f'{FIELD}={spec.source!r} has no leaf for the model\'s params '
                      f'{_few(missing)}; name them with config.model.init_map (the file\'s '
                      f'leaves: {_few(sorted(flat))}).')
  if log:
    _log_fresh(spec, sorted(fresh_owned), sorted(fresh_state), len(out.params))
  return out


def _log_fresh(spec: InitFrom, owned: list[str], state: list[str], loaded: int) -> None:
  logging.info('%s=%r: %d params leaves start every member from the file.', FIELD,
               spec.source, loaded)
  if owned:
    why = ('the file lacks them' if spec.owned_from_file else
           'config.model.init_owned_from_file=True loads them too')
    logging.info("%s: the members' own leaves (%s) start per member from (seed, member); "
                 '%s.', FIELD, _few(owned), why)
  if state:
    logging.info('%s: the file has no model state for %s: it starts as the model inits it.',
                 FIELD, _few(state))


def _put(value: np.ndarray, sharding: NamedSharding, dtype: Any) -> jax.Array:
  """`value` as one array of `dtype` over the mesh, each device's slice read (and cast)
  and put on its device before the next is read: a lazy leaf (models/hf) is never read
  whole, and the host holds one device's slice at a time."""
  shards = [jax.device_put(np.asarray(value[index]).astype(dtype, copy=False), device)
            for device, index in sharding.addressable_devices_indices_map(value.shape).items()]
  return jax.make_array_from_single_device_arrays(value.shape, sharding, shards)


def place(matched: Matched, params: PyTree, model_state: PyTree, mesh: Mesh,
          layout: Layout) -> Pretrained:
  """The matched values on the mesh, each laid out as one member's leaf of the state
  (layout.rule; replicated over 'member' and 'data'), None where a leaf starts fresh."""

  def tree(part: str, abstract: PyTree, values: dict[str, np.ndarray]) -> PyTree:
    def one(path, leaf):
      name = path_str(path)
      if name not in values:
        return None
      state_path = (jax.tree_util.GetAttrKey(part), *path)
      spec = P() if leaf.ndim == 0 else P(*layout.rule(state_path, leaf))
      return _put(values[name], NamedSharding(mesh, spec), leaf.dtype)
    return jax.tree_util.tree_map_with_path(one, abstract)

  return Pretrained(tree('params', params, matched.params),
                    tree('model_state', model_state, matched.model_state))


def _one_member(model: Model, input_shape: tuple[int, ...], num_outputs: int,
                owned: frozenset[str] | None, under: str) -> tuple[PyTree, PyTree, frozenset[str]]:
  """One member's params and model state (ShapeDtypeStructs), and the params leaves it
  owns (pretrained_leaves' `owned`, resolved)."""
  sample_x = jax.ShapeDtypeStruct((1, *input_shape), np.float32)
  params, model_state = jax.eval_shape(model.init, jax.random.key(0), sample_x)
  if owned is None and under:
    wrapped = params[under] if isinstance(params, Mapping) else getattr(params, under)
    owned = frozenset(f'{under}/{n}' for n in head_paths(wrapped, num_outputs))
  elif owned is None:
    owned = head_paths(params, num_outputs)
  return params, model_state, owned


def pretrained_leaves(spec: InitFrom, model: Model, input_shape: tuple[int, ...],
                      num_outputs: int, mesh: Mesh, layout: Layout,
                      owned: frozenset[str] | None = None,
                      under: str = '') -> Pretrained | None:
  """The file's leaves on the mesh for init_state (None when spec.source is '').

  Args:
    num_outputs: the model's outputs per example (finds its head: models/heads.py).
    owned: the params leaves each member owns (config.ensemble.own, resolved); None:
      every leaf, of which the head starts fresh.
    under: where a method keeps the model's leaves (match); the head is looked for there.
  """
  if not spec.source:
    return None
  params, model_state, owned = _one_member(model, input_shape, num_outputs, owned, under)
  matched = match(load_pretrained(spec.source), params, model_state, spec, owned, under)
  return place(matched, params, model_state, mesh, layout)


def check_pretrained(spec: InitFrom, model: Model, input_shape: tuple[int, ...],
                     num_outputs: int, owned: frozenset[str] | None = None,
                     under: str = '') -> None:
  """Refuses, reading no tensor, what pretrained_leaves (the same arguments, less the
  mesh) would: a path that does not exist or of no known format, and, for the formats
  with a header (a Hugging Face checkpoint, a .safetensors file; io/pretrained.leaf_shapes),
  a file cut short, a dtype not read, and a leaf missing, unexpected or misshapen. The
  other formats are read only whole, when the state is made.

  Training calls it before it claims the workdir: pretrained_leaves runs only once the
  state is made, after the workdir holds its lock, config.json and checkpoints/.
  """
  if not spec.source:
    return
  shapes = leaf_shapes(spec.source)
  if shapes is None:
    return
  params, model_state, owned = _one_member(model, input_shape, num_outputs, owned, under)
  match(shapes, params, model_state, spec, owned, under, log=False)
