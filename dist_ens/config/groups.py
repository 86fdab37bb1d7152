"""config.ensemble.groups, declared here (FIELDS) and read into group specs: each group's
count, its model and optim overrides, its members' ids, its own config; and the one-line
refusals of what groups do not support yet (docs/groups.md).

  config.num_members = 12
  config.ensemble.groups = (
      {'count': 8, 'model': {'widths': (64,)}},
      {'count': 4, 'model': {'name': 'cnn'}, 'optim': {'learning_rate': 3e-3}},
  )

Members 0-7 are the first group's, 8-11 the second's; member i's init, data order,
dropout and hyperparameters depend on (seed, i) only, so a group's members are the
members of the same ids in a run without groups whose model is the group's.
"""

import contextlib
import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import ml_collections

from dist_ens import tasks
from dist_ens.config import loading, specs as specs_lib
from dist_ens.core.stacks import Place
from dist_ens.ensembles import methods
from dist_ens.errors import ConfigError

FIELD = 'config.ensemble.groups'
# This feature's field, with the code that reads it: defaults.py places it in
# config.ensemble (`_declared_in`), its meaning the comment above it (config/schema.py reads
# it, docs/config.md shows it), checked by stack_configs(config) below, the hook
# config.checks.validate runs for every feature that declares its fields so.
FIELDS = dict(
    # Members of different architectures in one program (docs/groups.md): a list of
    # groups, each a dict {'count': n, 'model': {...}, 'optim': {...}, 'ensemble': {...}[,
    # 'name': str]} of config.model / config.optim / config.ensemble overrides (a group's
    # own method: 'method', 'own', ...); the counts sum to num_members, member ids run
    # across groups in order. In a config file, or on the command line as one Python
    # literal. () = one group of config.model.
    groups=(),
)
# What a group may set, besides its count (and a name for the tables).
OVERRIDABLE = ('model', 'optim', 'ensemble')
_EXAMPLE = "({'count': 4, 'model': {'widths': (32,)}}, {'count': 4, 'model': {'name': 'cnn'}})"


class GroupSpec(NamedTuple):
  """One group: its members' ids (first .. first + count - 1) and its overrides
  (`ensemble`: its own method, e.g. {'method': 'batchensemble'} or {'own': 'head'})."""
  name: str
  group: Place  # where its members sit among the ensemble's
  model: dict[str, Any]
  optim: dict[str, Any]
  ensemble: dict[str, Any]


def _plain(value: Any) -> Any:
  return value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value


def _one(raw: Any, index: int, first: int) -> GroupSpec:
  """Group `index` of the config, checked; its members start at id `first`."""
  raw = _plain(raw)
  where = f'{FIELD}[{index}]'
  if not isinstance(raw, Mapping):
    raise ConfigError(f'{where}={raw!r} must be a dict with a count and model/optim '
                      f'overrides, e.g. {_EXAMPLE}.')
  unknown = sorted(set(raw) - {'count', 'name', *OVERRIDABLE})
  if unknown:
    raise ConfigError(f'{where} has the unknown keys {unknown}; a group takes count, name '
                      f'and overrides of {list(OVERRIDABLE)}, e.g. {_EXAMPLE}.')
  count = raw.get('count')
  if not isinstance(count, int) or isinstance(count, bool) or count < 1:
    raise ConfigError(f'{where}.count={count!r} must be an int >= 1 (the members of this '
                      'group).')
  overrides = {}
  for key in OVERRIDABLE:
    value = _plain(raw.get(key, {}))
    if not isinstance(value, Mapping):
      raise ConfigError(f'{where}.{key}={value!r} must be a dict of config.{key} fields, '
                        f'e.g. {_EXAMPLE}.')
    overrides[key] = dict(value)
  name = raw.get('name', f'group{index}')
  if not isinstance(name, str) or not name:
    raise ConfigError(f'{where}.name={name!r} must be a non-empty string.')
  return GroupSpec(name, Place(first, count), overrides['model'], overrides['optim'],
                   overrides['ensemble'])


def group_specs(config: ml_collections.ConfigDict) -> tuple[GroupSpec, ...]:
  """The config's groups in id order; () for an ensemble without groups."""
  raw = config.ensemble.get('groups', ())
  if isinstance(raw, str):
    raise ConfigError(f'{FIELD}={raw!r} is a string; give the groups in a config file as a '
                      f'list of dicts, e.g. {_EXAMPLE}.')
  if not isinstance(raw, Sequence):
    raise ConfigError(f'{FIELD}={raw!r} must be a list of dicts, e.g. {_EXAMPLE}.')
  specs, first = [], 0
  for index, one in enumerate(raw):
    specs.append(_one(one, index, first))
    first += specs[-1].group.count
  return tuple(specs)


def group_config(config: ml_collections.ConfigDict,
                 spec: GroupSpec) -> ml_collections.ConfigDict:
  """The config a group's members are built from: the ensemble's with the group's model,
  optim and ensemble overrides (a dict for a sub-config, e.g. 'prior', updates its
  fields), no groups, and num_members still M (per-member lists and sweeps are resolved
  over all M members, and the group takes its ids' values)."""
  out = copy.deepcopy(config)
  with out.unlocked():
    out.ensemble.groups = ()
    for key in OVERRIDABLE:
      overrides = getattr(spec, key)
      for field, value in overrides.items():
        # A field only some models read (model.depth, model.patch_size, ...) may be absent
        # from the ensemble's config, as it may from any config: the group adds it.
        if ((field not in out[key] and f'{key}.{field}' not in loading.OPTIONAL_FIELDS)
            or (key, field) == ('ensemble', 'groups')):
          known = sorted({*out[key], *_optional(key)} - {'groups'})
          raise ConfigError(f'{FIELD} group {spec.name!r} sets {key}.{field}, which is no '
                            f'config.{key} field a group sets; use one of {known}.')
        if isinstance(value, Mapping) and isinstance(out[key].get(field),
                                                     ml_collections.ConfigDict):
          out[key][field].update(dict(value))  # a sub-config: the fields given
          continue
        if isinstance(value, (list, tuple)) and field in _PER_MEMBER.get(key, ()):
          raise ConfigError(
              f'{FIELD} group {spec.name!r} sets {key}.{field}={value!r}: a group takes one '
              f'value or a sweep spec per field; give per-member lists in config.{key}.'
              f'{field} (all {config.num_members} members).')
        if isinstance(value, list) and isinstance(out[key][field], tuple):
          value = tuple(value)  # A config.json read back holds lists.
        with out[key].ignore_type():  # a config.json read back types a spec field as str
          out[key][field] = value
  return out


def _optional(key: str) -> tuple[str, ...]:
  """The fields of config.<key> a config may leave out (loading.OPTIONAL_FIELDS)."""
  return tuple(f.split('.', 1)[1] for f in loading.OPTIONAL_FIELDS if f.startswith(f'{key}.'))


# (field, test of its value, what it is): pairings groups do not support yet, each refused
# in one line naming both fields (docs/groups.md says how to go on).
_REFUSED = (
    # 'same' and 'hydra' are students of the members' one architecture; groups have several.
    ('distill.student', lambda v: v in ('same', 'hydra'),
     "give the student as an import path, distill.student='pkg.mod:make' "
     '(make(num_outputs) -> a dist_ens.Model)'),
)


def _get(config: ml_collections.ConfigDict, dotted: str) -> Any:
  node = config
  for part in dotted.split('.'):
    node = node[part]
  return node


def check(config: ml_collections.ConfigDict) -> tuple[GroupSpec, ...]:
  """The config's groups, checked: counts that sum to num_members, overrides of real
  fields, none of the pairings groups do not support yet (one line naming both), and
  each group's per-member fields (config.checks.validate runs this, by stack_configs)."""
  specs = group_specs(config)
  if not specs:
    return specs
  total = sum(s.group.count for s in specs)
  if total != config.num_members:
    counts = ' + '.join(str(s.group.count) for s in specs)
    raise ConfigError(f'config.num_members={config.num_members} but {FIELD} counts {total} '
                      f'members ({counts}); set num_members={total}.')
  if not tasks.get_task(config.task).any_members:  # each group's ensemble scores a subset
    raise ConfigError(f"{FIELD} scores each group's members as that group's ensemble, and "
                      f'config.task={config.task!r} holds one constant per trained member '
                      '(Task.any_members); train without groups, or use a task without one '
                      "(task='regression' for Gaussian targets).")
  for spec in specs:
    one = group_config(config, spec)
    with in_group(spec):
      _check_method(one, spec)
    for field, refused, fix in _REFUSED:
      if refused(_get(one, field)):
        raise ConfigError(f'{FIELD} does not support config.{field}={_get(one, field)!r} '
                          f'yet (docs/groups.md); {fix}, or train without groups.')
  for spec in specs:  # Each group's per-member values, over all M as the run's are.
    with in_group(spec):
      specs_lib.resolve_hparams(group_config(config, spec))
  return specs


@contextlib.contextmanager
def in_group(spec: GroupSpec) -> Iterator[None]:
  """A ConfigError about a group's own config (its model.name, say) names the group: the
  same field may hold another value in the run's config or in another group."""
  try:
    yield
  except ConfigError as e:
    if FIELD in str(e):  # Already the group's own refusal.
      raise
    raise ConfigError(f'{FIELD} group {spec.name!r} (members {spec.group.first}-'
                      f'{spec.group.first + spec.group.count - 1}): {e}') from None


def _check_method(one: ml_collections.ConfigDict, spec: GroupSpec) -> None:
  """A group's method must give one predicting member per trained member, each trained
  on its own outputs: deep members, shared leaves (BatchEnsemble, ensemble.own) or a
  frozen prior network are the group's own business; a method that collects, cycles,
  adds outputs or wraps the loss (snapshots, SWAG, MIMO, epinets) is refused, by what
  it declares, not by its name. What the group's method refuses without groups (PBT,
  Laplace, distillation with shared leaves) it refuses with them: the run checks each
  group's config as its own (config.checks.validate, training.trainer)."""
  method = methods.from_spec(specs_lib.method_spec(one))
  if (method.collects or method.wrap_loss is not None or method.per_member != 1
      or method.outputs_per_output != 1 or method.cycles != 1):
    raise ConfigError(f'{FIELD} group {spec.name!r} does not support config.ensemble.method='
                      f"{one.ensemble.method!r} yet (docs/groups.md): a group's members "
                      "predict one-to-one from their own outputs; use 'deep', "
                      "'batchensemble', 'prior' or ensemble.own, or train without groups.")


def stack_configs(config: ml_collections.ConfigDict) -> list[ml_collections.ConfigDict]:
  """The groups checked (check), and the configs the run's stacks are built from: each
  group's (group_config) in group order; [] without groups. config.checks.validate calls
  this, first, as it does every declared feature's."""
  return [group_config(config, s) for s in check(config)]


def check_divides(specs: Sequence[GroupSpec], member_devices: int) -> None:
  """Every group is sharded over all of the mesh's 'member' devices: each count must
  divide evenly."""
  for spec in specs:
    if spec.group.count % member_devices:
      raise ConfigError(
          f'{FIELD} group {spec.name!r} has count={spec.group.count}, which the mesh\'s '
          f'{member_devices} member devices (config.mesh.member) do not divide: every group '
          f'is split over all of them; use counts that are multiples of {member_devices}, '
          'or a smaller mesh.member.')


def describe(config: ml_collections.ConfigDict) -> str:
  """'8 x mlp', or with groups '16 members in 2 groups (8 x mlp, 8 x resnet (deep))':
  each group's count, model and name where it is not the model's."""
  def model(c: ml_collections.ConfigDict) -> str:
    return c.model.factory or c.model.name

  groups = group_specs(config)
  if not groups:
    return f'{config.num_members} x {model(config)}'
  text = []
  for spec in groups:
    name = model(group_config(config, spec))
    text.append(f'{spec.group.count} x {name}' + (f' ({spec.name})' if spec.name != name else ''))
  return f'{config.num_members} members in {len(groups)} groups ({", ".join(text)})'


_PER_MEMBER = {'optim': ('learning_rate', 'weight_decay', 'b1', 'momentum'),
               'model': ('init_scale',)}
