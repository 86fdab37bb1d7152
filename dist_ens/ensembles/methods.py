"""Ensemble methods by name (config.ensemble.method), and what every method shares:
resolving config.ensemble.own, and the members a method predicts with.

  'deep'       independent members (the default; ensembles/deep.py)
  'batchensemble'  BatchEnsemble (Wen et al. 2020; ensembles/batchensemble.py)
  'mimo'       MIMO (Havasi et al. 2021; ensembles/mimo.py)
  'snapshot'   snapshot ensembles and fast geometric ensembling (ensembles/snapshot.py)
  'multiswag'  SWAG per member (ensembles/swag.py)
  'prior'      randomized prior functions (Osband et al. 2018; ensembles/prior.py)
  'epinet'     epistemic neural networks (Osband et al. 2023; ensembles/epinet.py)
  'masksembles'  fixed masks per member on shared weights (Durasov et al. 2021;
               ensembles/masksembles.py)
  'packed'     Packed-Ensembles: members of width alpha*C/M in gamma groups (Laurent et
               al. 2023; ensembles/packed.py)

A method is a value (ensembles/method.py: Method, built by `make(spec: MethodSpec)`);
yours is an import path, `config.ensemble.method = 'my_pkg.methods:make'`, and reads its
fields from config.ensemble.options. Nothing outside a method's own file tests its name.
`predictive_members` turns the stacked train state into the K*M members that predict.
"""

from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dist_ens import importing
from dist_ens.core import rng
from dist_ens.ensembles import batchensemble, deep, mimo, own as own_lib
from dist_ens.ensembles import epinet, masksembles, packed, prior, sgmcmc, snapshot, swag
from dist_ens.ensembles import rank1
from dist_ens.ensembles import sngp
from dist_ens.ensembles.method import Method, MethodSpec
from dist_ens.errors import ConfigError
from dist_ens.parallel import mesh as mesh_lib

PyTree = Any
# Built-in methods: name -> its module (its `make`, and its fields, config.ensemble.<the
# module's name>, where it declares FIELDS).
METHODS: dict[str, ModuleType] = {
    'deep': deep,
    'batchensemble': batchensemble,
    'mimo': mimo,
    'snapshot': snapshot,
    'multiswag': swag,
    'prior': prior,
    'epinet': epinet,
    'masksembles': masksembles,
    'packed': packed,
    'sgmcmc': sgmcmc,
    'rank1': rank1,
    'sngp': sngp,
}
# config.ensemble.own values that one method resolves itself (Method.resolve_own):
# own -> that method. 'epinet': members own their epinets, the base network is shared.
METHOD_OWN = {'epinet': 'epinet'}
# A user's method (an import path) reads its fields from this group.
USER_OPTIONS = 'options'
# Stream tag of SWAG's weight samples (training is 1, MC dropout 2).
_SWAG_STREAM = 3


def options_group(name: str) -> str | None:
  """The config.ensemble group holding method `name`'s fields."""
  if importing.is_import_path(name):
    return USER_OPTIONS
  module = METHODS.get(name)
  if module is None or not hasattr(module, 'FIELDS'):
    return None
  return module.__name__.rsplit('.', 1)[1]


def from_spec(spec: MethodSpec) -> Method:
  """The method spec.name names (a built-in or an import path), its fields checked.

  Raises:
    ConfigError: naming the field and what would work.
  """
  own_as_method = spec.own == 'batchensemble'
  if own_as_method:  # One implementation, the same run.
    if spec.name != 'deep':
      raise ConfigError(f"config.ensemble.own='batchensemble' is method='batchensemble'; it "
                        f"works with ensemble.method='deep' (not {spec.name!r}).")
    spec = spec._replace(name='batchensemble', own='all')
  method = _factory(spec.name)(spec)
  if not isinstance(method, Method):
    raise ConfigError(f'config.ensemble.method={spec.name!r} gave a {type(method).__name__}, '
                      'not a dist_ens.ensembles.method.Method.')
  _check_own(spec, method, own_as_method)
  return method


def check_name(name: str) -> None:
  """Raises ConfigError unless `name` is a built-in method or an import path that loads."""
  _factory(name)


def _factory(name: str) -> Callable[[MethodSpec], Method]:
  if importing.is_import_path(name):
    return importing.load_object(name, 'config.ensemble.method')
  if name not in METHODS:
    raise ConfigError(f'config.ensemble.method={name!r}; use one of {tuple(METHODS)}, or your '
                      "own by import path, 'my_pkg.methods:make'.")
  return METHODS[name].make


def _check_own(spec: MethodSpec, method: Method, own_as_method: bool) -> None:
  """ensemble.own and ensemble.train_shared checked against the method.

  Raises:
    ConfigError: a combination that means nothing, naming the field.
  """
  own, train_shared = ('batchensemble' if own_as_method else spec.own), spec.train_shared
  if not isinstance(train_shared, bool):
    raise ConfigError(f'config.ensemble.train_shared={train_shared!r} must be True or False.')
  if train_shared and own in ('all', 'batchensemble'):
    why = ('every leaf is each member\'s own, none is shared' if own == 'all' else
           "BatchEnsemble's shared W always trains, by the members' mean gradient")
    raise ConfigError(f'config.ensemble.train_shared=True with ensemble.own={own!r}: {why}; '
                      "set train_shared=False, or own='head', 'lora' or a regex.")
  if train_shared and spec.reproducible:
    raise ConfigError('config.ensemble.train_shared=True with config.reproducible=True: the '
                      "shared leaves' gradient is a sum over devices, whose order depends on "
                      'the mesh; use reproducible=False or train_shared=False.')
  if own in METHOD_OWN and spec.name != METHOD_OWN[own]:
    raise ConfigError(f'config.ensemble.own={own!r} makes each member own its '
                      f'{METHOD_OWN[own]} only; it works with '
                      f'ensemble.method={METHOD_OWN[own]!r} (not {spec.name!r}).')
  if own not in ('all', 'batchensemble') and not method.allows_own:
    raise ConfigError(f"config.ensemble.own={own!r} shares every other leaf between "
                      f"members; it works with ensemble.method='deep' or 'epinet' (not "
                      f"{spec.name!r}), or set own='all'.")


def with_owned(method: Method, params: PyTree, num_outputs: int) -> Method:
  """`method` with the leaves its members own resolved on the model's `params` (one
  member's shapes): config.ensemble.own other than 'all' shares the rest.

  Raises:
    ConfigError: an `own` that names no leaf or every leaf (ensembles/own.py).
  """
  resolve = method.resolve_own or own_lib.resolve  # An epinet's: own names its base's.
  owned, lora = resolve(method.own, method.lora, params, num_outputs)
  if owned is None:
    return method
  return method._replace(owned=owned, lora=lora,
                         hooks=own_lib.hooks(owned, lora, method.train_shared))


class Members(NamedTuple):
  """The members that predict, stacked [M * K, ...] over 'member' (evaluation reads
  .params, .model_state and .frozen, as of a TrainState)."""
  params: PyTree
  model_state: PyTree
  frozen: jax.Array  # [M * K] bool: a frozen member's, or not collected yet


def predictive_members(method: Method, state: Any, seed: int, mesh: Mesh) -> Members:
  """The K predicting members of every trained member, member m's at rows m*K..m*K+K-1.

  Random draws (SWAG's weight samples) come from (seed, member, k): the same on any mesh.
  """
  if method.per_member == 1 and not method.collects:
    # The trained members, their params as stored (a shared leaf once): read them with
    # ensembles.stored.predicting_model(method, model).
    return Members(state.params, state.model_state, state.frozen)
  num_members = state.frozen.shape[0]

  def expand(collected, params, model_state, frozen, step):
    keys = jax.vmap(lambda k: jax.random.fold_in(k, _SWAG_STREAM))(
        rng.member_keys(seed, jnp.arange(num_members, dtype=jnp.uint32)))
    p, s, valid = jax.vmap(method.members, in_axes=(0, 0, 0, None, 0))(
        collected, params, model_state, step, keys)
    flat = lambda tree: jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), tree)
    return Members(flat(p), flat(s), jnp.repeat(frozen, method.per_member) | ~flat(valid))

  sharding = mesh_lib.member_sharding(mesh)
  return jax.jit(expand, out_shardings=sharding)(
      state.method_state, state.params, state.model_state, state.frozen, state.step)
