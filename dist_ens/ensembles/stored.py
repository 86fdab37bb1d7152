"""How the members' params are stored, and how evaluation and Ensemble read them.

Every leaf stacked [M, ...] over 'member' (the deep ensemble), or, for a method whose
members share leaves (batchensemble, config.ensemble.own), BatchEnsemble's entries: a
shared leaf stored ONCE, the rest stacked (ensembles/batchensemble.py). Evaluation never
copies a shared leaf M times: `predicting_model` forms one member's params inside the
members' vmap, where a shared leaf is unbatched, so a frozen backbone's forward pass runs
once per device. Only `form_all` (Ensemble.params) and `take_member` (member(i), export)
form members' own params, when asked.
"""

from typing import Any

import jax
from jax.sharding import Mesh

from dist_ens.core.model import Model, stacked_axes
from dist_ens.ensembles import batchensemble
from dist_ens.parallel import mesh as mesh_lib

PyTree = Any


def predicting_model(method: Any, model: Model) -> Model:
  """`model`, reading the members' params as `method` (ensembles.methods.Method) stores
  them: entries are formed into one member's params inside apply, and member_axes marks
  the shared leaves unstacked. A method without shared leaves: `model` itself."""
  if method is None or not method.shares:
    return model

  def apply(params, state, x, **kwargs):
    return model.apply(batchensemble.member_params(params), state, x, **kwargs)

  return Model(model.init, apply, member_axes=stored_axes,
               member_params=batchensemble.member_params)


def stored_axes(params: PyTree) -> PyTree:
  """0 for a stacked leaf of sharing params, None for one stored once (a shared W, a scale)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: None if batchensemble.is_shared(path) else 0, params)


def take_member(model: Model, params: PyTree, i: jax.Array) -> PyTree:
  """Member i's own plain params from the stacked params as `model` reads them."""
  axes = stacked_axes(model, params)
  if axes == 0:
    return jax.tree.map(lambda a: a[i], params)
  view = jax.tree.map(lambda a, axis: a if axis is None else a[i], params, axes,
                      is_leaf=lambda a: a is None)
  return model.member_params(view)


def form_all(model: Model, params: PyTree, mesh: Mesh) -> PyTree:
  """Every member's own params, stacked [M, ...] over 'member': a shared leaf copied M
  times (what Ensemble.params gives when asked; never evaluation)."""
  if model.member_axes is None:
    return params
  form = lambda p: jax.vmap(model.member_params, in_axes=(model.member_axes(p),))(p)
  return jax.jit(form, out_shardings=mesh_lib.member_sharding(mesh))(params)
