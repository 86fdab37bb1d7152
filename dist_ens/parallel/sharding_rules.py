"""Leaf rules for dist_ens.parallel.layout.Layout: how one member's leaves split over
mesh axes other than 'member' (a 'model' axis, for members larger than one device).

Every constructor here returns a LeafRule, rule(path, leaf) -> PartitionSpec, where
`path` is the leaf's key path in the WHOLE train state (params, model_state,
opt_state, ...) and `leaf` is ONE member's leaf (its shape without the member axis);
the Layout prepends 'member' itself. The rules:

  fsdp(axis_size=...)        by size: a large leaf's largest dimension that the axis
                             divides is split, small leaves are replicated; XLA then
                             gathers each layer's weights where it uses them.
  by_regex(rules)            by parameter path, for models without annotations
                             (Equinox, Haiku, plain JAX, the built-ins).
  from_flax_metadata(tree)   by the model's own annotations: linen
                             with_partitioning / with_logical_partitioning boxes, NNX
                             Variables' sharding metadata.

Paths are matched as strings written by `path_str`: the key path's entries joined by
'/', e.g. 'params/Dense_0/kernel' or 'opt_state/0/mu/Dense_0/kernel' (Adam's first
moment of that kernel). Optimizer moments mirror the params' paths under an optimizer
prefix, so a rule that should also place the moments matches the param's path as a
suffix (by_regex: no '^' anchor; from_flax_metadata: suffix matching built in).

What each device then holds, for `dist-ens plan`: dist_ens.parallel.placement.
"""

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from dist_ens.core.axes import MODEL
from dist_ens.errors import ConfigError
from dist_ens.importing import load_object
from dist_ens.parallel.layout import LeafRule, Path, whole

PyTree = Any


def _entry_name(entry: Any) -> str | None:
  """One key-path entry as a name; None for the `.value` hop of a box or Variable."""
  if isinstance(entry, jax.tree_util.GetAttrKey):
    # Flax boxes and NNX Variables hold their array under `.value`: dropping the hop
    # makes a boxed tree's paths those of the unboxed one.
    return None if entry.name == 'value' else entry.name
  for attr in ('key', 'idx'):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def path_names(path: Path) -> tuple[str, ...]:
  """The names along a key path, without `.value` hops: ('params', 'Dense_0', 'kernel')."""
  return tuple(name for name in map(_entry_name, path) if name is not None)


def path_str(path: Path) -> str:
  """A key path as the string the rules match: names joined by '/'.

  Dict keys, attribute names (a NamedTuple's fields, e.g. TrainState.params) and
  sequence indices each give one component; `.value` hops of Flax boxes and NNX
  Variables are left out. Example: the train state's kernel of a linen Dense is
  'params/Dense_0/kernel', Adam's first moment of it 'opt_state/0/mu/Dense_0/kernel'.
  """
  return '/'.join(path_names(path))


def entry_size(entry: Any, axis_sizes: Mapping[str, int], where: str) -> int:
  """How many shards a spec entry (None, an axis, or a tuple of axes) makes."""
  if entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  unknown = [a for a in names if a not in axis_sizes]
  if unknown:
    raise ValueError(f'{where}: axis {unknown[0]!r} is not a mesh axis; the mesh has '
                     f'{dict(axis_sizes)}.')
  return math.prod(axis_sizes[a] for a in names)


def check_spec(path: Path, leaf: jax.ShapeDtypeStruct, spec: P,
               axis_sizes: Mapping[str, int] | None = None) -> P:
  """`spec` if it fits one member's `leaf`, else a ValueError naming the path.

  Args:
    path: the leaf's key path (for the message).
    leaf: one member's leaf.
    spec: its PartitionSpec, one entry per leading dimension at most.
    axis_sizes: mesh axis name -> size; when given, every named axis must exist and
      its size divide the dimension it splits.

  Returns:
    spec, unchanged.
  """
  where = f'leaf {path_str(path)!r} of shape {tuple(leaf.shape)}'
  if len(spec) > leaf.ndim:
    raise ValueError(f'{where}: spec {spec} has {len(spec)} entries, more than the '
                     f'leaf\'s {leaf.ndim} dimensions.')
  if axis_sizes is not None:
    for dim, entry in enumerate(spec):
      size = entry_size(entry, axis_sizes, where)
      if leaf.shape[dim] % size:
        raise ValueError(f'{where}: spec {spec} splits dimension {dim} ({leaf.shape[dim]}) '
                         f'over {entry!r} of size {size}, which does not divide it.')
  return spec


def fsdp(axis: str | tuple[str, ...] = MODEL, *, axis_size: int,
         min_size: int = 4096) -> LeafRule:
  """FSDP by size: split each large leaf's largest dimension that `axis_size` divides.

  Args:
    axis: the mesh axis to split over, or a tuple of axes split over jointly (ZeRO-3
      over ('data', 'model'): config.mesh.fsdp_over_data).
    axis_size: its size, the product of the axes' sizes (the rule sees leaves, not
      the mesh).
    min_size: leaves of fewer elements stay replicated (biases, norms: gathering them
      costs a collective each for little memory). In elements, not bytes, so the
      choice does not move with the precision.

  Returns:
    rule(path, leaf) -> P: P() for small leaves and leaves no dimension of which
    `axis_size` divides; else `axis` on the largest divisible dimension (of equal
    ones the last: a kernel [fan_in, fan_out] splits its outputs) and None elsewhere.
  """
  if not isinstance(axis_size, int) or axis_size < 1:
    raise ValueError(f'fsdp: axis_size={axis_size!r} must be an int >= 1.')

  def rule(path: Path, leaf: jax.ShapeDtypeStruct) -> P:
    del path
    if axis_size == 1 or math.prod(leaf.shape) < min_size:
      return P()
    divisible = [i for i, d in enumerate(leaf.shape) if d % axis_size == 0]
    if not divisible:
      return P()
    dim = max(divisible, key=lambda i: (leaf.shape[i], i))
    return P(*(axis if i == dim else None for i in range(leaf.ndim)))

  return rule


def by_regex(rules: Sequence[tuple[str, P | LeafRule]], default: LeafRule = whole, *,
             axis_sizes: Mapping[str, int] | None = None, field: str | None = None) -> LeafRule:
  """User rules by parameter path: the first regex that matches decides.

  Args:
    rules: (regex, spec or rule) pairs, tried in order with re.search on the leaf's
      path_str (e.g. 'params/blocks/0/attn/qkv/w'). Leave the regex unanchored at the
      start (r'attn/qkv/w$') so the optimizer's moments of that param match too.
      A PartitionSpec is used as given; a LeafRule (e.g. fsdp(...)) is called.
    default: the rule of leaves no regex matches.
    axis_sizes: mesh axis name -> size; when given, the specs decided are checked to
      name mesh axes whose sizes divide the dimensions they split.
    field: the config field the rules come from (config.mesh.rules): a spec that does
      not fit its leaf is then a one-line ConfigError naming the field and the regex.

  Returns:
    rule(path, leaf) -> P. Raises ValueError naming the path when a spec has more
    entries than the leaf has dimensions, or (with axis_sizes) does not divide it.
  """
  compiled = []
  for pattern, target in rules:
    try:
      compiled.append((re.compile(pattern), target))
    except re.error as e:
      raise ValueError(f'by_regex: {pattern!r} is not a regular expression: {e}') from None
    if not isinstance(target, P) and not callable(target):
      raise ValueError(f'by_regex: the target of {pattern!r} is a {type(target).__name__}; '
                       'give a PartitionSpec or a rule(path, leaf) -> PartitionSpec.')

  def rule(path: Path, leaf: jax.ShapeDtypeStruct) -> P:
    name = path_str(path)
    for regex, target in compiled:
      if regex.search(name):
        spec = target if isinstance(target, P) else target(path, leaf)
        if field is None:
          return check_spec(path, leaf, spec, axis_sizes)
        try:
          return check_spec(path, leaf, spec, axis_sizes)
        except ValueError as e:
          raise ConfigError(f'{field}: the rule {regex.pattern!r} -> {spec} does not fit: '
                            f'{e} Give that leaf a spec its dimensions allow (None leaves '
                            'one whole), or a mesh axis size that divides it.') from None
    return check_spec(path, leaf, default(path, leaf), axis_sizes)

  return rule


def config_rules(rules: Any, field: str = 'config.mesh.rules') -> list[tuple[str, Any]]:
  """config.mesh.rules as by_regex's (regex, spec or rule) pairs.

  Args:
    rules: () or '' (none), pairs of (regex, spec), where a spec is a PartitionSpec, a
      tuple or list of axis names (P(*spec): what a config file or config.json holds) or
      a LeafRule; or an import path 'pkg.module:NAME' to such pairs
      ('dist_ens.models.vit:VIT_RULES').
    field: the config field, for the messages.

  Raises:
    ConfigError: one line naming `field`: a path that does not import, or anything but
      (regex, spec) pairs whose regexes compile.
  """
  given = rules
  if isinstance(rules, str):
    rules = load_object(rules, field) if rules else ()
  example = "e.g. (('attn/q/w$', (None, 'model')),) or 'dist_ens.models.vit:VIT_RULES'"
  if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Sequence):
    raise ConfigError(f'{field}={given!r} must be (regex, spec) pairs or an import path to '
                      f'them, {example}.')
  pairs = []
  for pair in rules:
    if (isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2
        or not isinstance(pair[0], str)):
      raise ConfigError(f'{field}={given!r} must be (regex, spec) pairs, {example}; got the '
                        f'entry {pair!r}.')
    regex, spec = pair
    try:
      re.compile(regex)
    except re.error as e:
      raise ConfigError(f'{field}: {regex!r} is not a regular expression: {e}.') from None
    if isinstance(spec, (tuple, list)) and not isinstance(spec, P):
      spec = P(*(tuple(s) if isinstance(s, list) else s for s in spec))
    elif not isinstance(spec, P) and not callable(spec):
      raise ConfigError(f'{field}: the spec of {regex!r} is {spec!r}; give a tuple of axis '
                        "names (None: not split), e.g. (None, 'model').")
    pairs.append((regex, spec))
  return pairs


def check_rules_match(rules: Sequence[tuple[str, Any]], paths: Sequence[str],
                      field: str = 'config.mesh.rules') -> None:
  """Refuses a regex of `rules` that matches none of `paths` (the train state's leaf
  paths, as the rules see them): it would be ignored without a word.

  Raises:
    ConfigError: one line naming the regex and a few of the leaf paths.
  """
  for regex, _ in rules:
    if not any(re.search(regex, p) for p in paths):
      params = [p for p in paths if p.startswith('params/')] or list(paths)
      example = params[0].split('/', 1)[-1] + '$'
      raise ConfigError(
          f'{field}: {regex!r} matches no leaf of the train state, whose paths are '
          f'{", ".join(params[:6])}{", ..." if len(params) > 6 else ""} (and the optimizer\'s '
          f'moments of them); leave the start unanchored, e.g. {example!r}.')


# --- the model's own annotations: Flax linen boxes and NNX Variables -------------------


def _is_box(x: Any) -> bool:
  """A linen AxisMetadata box or an NNX Variable (checked without importing flax when
  the user does not have it)."""
  module = type(x).__module__
  if not module.startswith('flax'):
    return False
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from flax.core import meta  # pylint: disable=import-outside-toplevel
  return isinstance(x, (meta.AxisMetadata, nnx.Variable))


def _box_spec(box: Any, logical_rules: Sequence[tuple[str, Any]] | None) -> P | None:
  """The mesh PartitionSpec a box or Variable carries; None when it carries none."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  if isinstance(box, nn.LogicallyPartitioned):
    rules = logical_rules if logical_rules is not None else box.rules
    return P(*nn.logical_to_mesh_axes(box.names, rules))
  if isinstance(box, nn.Partitioned):
    return P(*box.names)
  if isinstance(box, nnx.Variable):
    meta = box.get_metadata()
    # Names of the key across NNX versions: out_sharding (0.12), sharding_names, sharding.
    names = next((meta[k] for k in ('out_sharding', 'sharding_names', 'sharding')
                  if meta.get(k) is not None), None)
    if names is None:
      return None
    if logical_rules is not None:
      return P(*nn.logical_to_mesh_axes(tuple(names), logical_rules))
    return P(*names)
  return None


def _unboxed_shape(x: Any) -> tuple[int, ...]:
  if not _is_box(x):
    return tuple(x.shape)
  # NNX Variables deprecate `.value` for get_value(); linen boxes have only `.value`.
  value = x.get_value() if hasattr(x, 'get_value') else x.value
  return tuple(value.shape)


def _annotations(tree: PyTree, logical_rules: Sequence[tuple[str, Any]] | None
                 ) -> dict[tuple[str, ...], tuple[tuple[int, ...], P | None]]:
  """Param path (names) -> (shape, spec or None) for every leaf of a boxed tree."""
  if isinstance(tree, Mapping) and 'params' in tree:
    # A linen variables dict: its collections ('params', 'batch_stats') are not part of
    # the paths the params and optimizer moments carry in the train state.
    strip = 1
  else:
    strip = 0
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_box)[0]
  table = {}
  for path, leaf in leaves:
    spec = _box_spec(leaf, logical_rules) if _is_box(leaf) else None
    table[path_names(path)[strip:]] = (_unboxed_shape(leaf), spec)
  return table


def from_flax_metadata(abstract_params_with_metadata: PyTree,
                       logical_rules: Sequence[tuple[str, Any]] | None = None,
                       default: LeafRule = whole) -> LeafRule:
  """The partition annotations a Flax model carries, as a rule.

  Args:
    abstract_params_with_metadata: the model's variables before unboxing, e.g.
      jax.eval_shape(module.init, key, x) for linen (a variables dict or its
      'params' collection), whose kernels are nn.Partitioned / nn.LogicallyPartitioned
      boxes (flax.linen.with_partitioning / with_logical_partitioning); or
      nnx.state(abstract_module, nnx.Param) for NNX, whose Variables carry sharding
      metadata (out_sharding in flax 0.12; an NNX model built under nnx.eval_shape
      needs a mesh context to carry it).
    logical_rules: logical name -> mesh axis pairs, [('embed', 'model'), ('mlp',
      None)], mapped as flax.linen.logical_to_mesh_axes does (a name without a rule
      is replicated); None: a LogicallyPartitioned box's own rules, else Flax's
      context rules (nn.logical_axis_rules). For NNX names, None means they already
      are mesh axes.
    default: the rule of leaves without an annotation.

  Returns:
    rule(path, leaf) -> P. Matching is by path SUFFIX: a train-state path
    ('params/Dense_0/kernel', 'opt_state/0/mu/Dense_0/kernel') takes the annotation
    of the longest param path it ends with (whole components), so the optimizer's
    moments of a param, which mirror its path under an optimizer prefix, get the
    param's spec. Every param, annotated or not, takes part in the matching (an
    unannotated 'Block_0/Dense_0/kernel' is not mistaken for an annotated
    'Dense_0/kernel'), and a leaf whose shape is not the param's (a factored
    optimizer statistic) falls to `default`.
  """
  table = _annotations(abstract_params_with_metadata, logical_rules)

  def rule(path: Path, leaf: jax.ShapeDtypeStruct) -> P:
    names = path_names(path)
    for start in range(len(names)):
      hit = table.get(names[start:])
      if hit is not None:
        shape, spec = hit
        if spec is not None and shape == tuple(leaf.shape):
          return check_spec(path, leaf, spec)
        break
    return default(path, leaf)

  return rule
