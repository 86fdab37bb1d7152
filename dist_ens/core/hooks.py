"""What an ensemble method changes in core, handed in as functions (optax-style).

core knows no ensemble method: dist_ens.ensembles.methods builds a MethodHooks for
the method a config names, and core calls whichever hooks are set. The defaults
(every hook None) are independent members: each member's params, optimizer state
and update its own, nothing collected.
"""

from collections.abc import Callable
from typing import Any, NamedTuple


class MethodHooks(NamedTuple):
  """An ensemble method's say in how members are born and trained (None: the default).

  Attributes:
    init_params: (params [M, ...], member keys [M]) -> the method's params (BatchEnsemble:
      one shared weight and rank-1 factors per member).
    init_opt_state: (optimizer, params, hparams) -> the optimizer state of those params.
    members_update: (results, apply, optimizer, parallelism, batch_axis, map_batch_size) ->
      update(members, hp, member_ids, step, batch) -> (members, metrics) over a device's
      block of members (a core.step.Member of [m, ...] leaves, a core.step.Batch), from one
      member's `results` and `apply` (core.step.member_results_fn / member_apply_fn).
    init_collected: (params, model_state) -> what ONE member collects while training.
    collect: (collected, params, model_state, step) -> collected, ONE member's, after
      every step (snapshots, SWAG moments).
    shared: (path of a leaf of the train state) -> whether the leaf is stored once for all
      members rather than stacked (the layout replicates it over 'member').
  """
  init_params: Callable[..., Any] | None = None
  init_opt_state: Callable[..., Any] | None = None
  members_update: Callable[..., Any] | None = None
  init_collected: Callable[..., Any] | None = None
  collect: Callable[..., Any] | None = None
  shared: Callable[[tuple[Any, ...]], bool] | None = None
