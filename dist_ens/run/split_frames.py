"""Member splits of a standardising task, scored in one frame.

With config.data.member_split and a task that trains on standardised data (regression),
split s's members train on its rows standardised with its own statistics
(RunData.split_scales), while the run's evaluation standardises what it scores (test,
validation, OOD, each split's held-out rows) with one frame's (RunData.scale: the pool's
means and input stds, the smallest split's target std) and brings its sums back to the
targets' units with them. SplitFrames.model wraps the predicting model so that, in
evaluation, every member reads inputs in the frame's units and predicts in them: its inputs
go to its split's units before its network, its outputs (Task.reframe) from its split's
target units to the frame's after. The mixture evaluation forms is then the mixture of the
members' predictive distributions in one frame: in the targets' units, what
Ensemble.predict forms (which standardises each split's members with their own statistics
and mixes in the targets' units). The frame's target std is the splits' smallest so that
moving a variance there never shrinks it under the task's floor (a split whose held-out
part holds an outlier has a far smaller std than the pool).

Predicting row r of P belongs to split r // (P / S): splits hold contiguous blocks of
members (data/member_split.py), and a collecting method's K rows per member follow their
member. The frame goes through evaluation's vmap over members beside each member's model
state, so one program scores every member in one pass; only core.model.over_stacks' callers
(evaluate.member_logits and member_outputs: every evaluation and MC dropout) see it; a
direct call of the wrapped model's apply is the member's own, unframed.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from dist_ens.core.model import Model, num_stacked, stacked_axes
from dist_ens.data import uci
from dist_ens.errors import ConfigError


class SplitFrames(NamedTuple):
  """Evaluation's statistics and each split's (RunData.scale, RunData.split_scales)."""
  frame: uci.Standardizer
  splits: tuple[uci.Standardizer, ...]

  @classmethod
  def of_run(cls, run_data: Any, task: Any, member_split: str, task_name: str) -> 'SplitFrames':
    """The frames of a run whose RunData has split_scales, for `task`.

    Raises:
      ConfigError: the task standardises (Task.unscale) but has no Task.reframe (a user's).
    """
    if task.reframe is None:
      raise ConfigError(f'config.data.member_split={member_split!r} with config.task='
                        f'{task_name!r}: the task standardises its targets (Task.unscale) but '
                        'cannot move its outputs between standardisations (Task.reframe), '
                        "which scoring each split's members needs; give the task a reframe "
                        "or set data.member_split=''.")
    return cls(run_data.scale, run_data.split_scales)

  def affines(self) -> tuple[np.ndarray, ...]:
    """Per split, [S, ...] each: x_scale, x_shift (the frame's units -> the split's) and
    y_scale, y_shift [S, D] (the split's target units -> the frame's)."""
    frame, own = self.frame, self.splits
    x_scale = np.stack([frame.x_std / s.x_std for s in own])
    x_shift = np.stack([(frame.x_mean - s.x_mean) / s.x_std for s in own])
    y_std, y_mean = np.reshape(frame.y_std, -1), np.reshape(frame.y_mean, -1)
    y_scale = np.stack([np.reshape(s.y_std, -1) / y_std for s in own])
    y_shift = np.stack([(np.reshape(s.y_mean, -1) - y_mean) / y_std for s in own])
    return tuple(a.astype(np.float32) for a in (x_scale, x_shift, y_scale, y_shift))

  def model(self, base: Model, reframe: Callable[..., Any], num_members: int) -> Model:
    """`base` (the predicting model, of one stack or joined stacks of `num_members`
    members) whose members predict in the frame's units wherever over_stacks runs them
    (see the module doc); `reframe` is the task's (Task.reframe)."""
    affines = self.affines()
    count = len(self.splits)

    def frames(ids, total):  # each row's split's affine maps, [rows, ...]
      split = jnp.asarray(ids) // (total // count)
      return tuple(jnp.asarray(a)[split] for a in affines)

    def framed(model: Model) -> Model:
      def apply(params, framed_state, x, **kwargs):
        state, (x_scale, x_shift, y_scale, y_shift) = framed_state
        out, state = model.apply(params, state, x * x_scale + x_shift, **kwargs)
        return reframe(out, y_scale, y_shift), (state, framed_state[1])

      def features(params, framed_state, x, **kwargs):
        state, (x_scale, x_shift, y_scale, y_shift) = framed_state
        out, feats, state = model.features(params, state, x * x_scale + x_shift, **kwargs)
        return reframe(out, y_scale, y_shift), feats, (state, framed_state[1])

      return model._replace(apply=apply, members_map=None,
                            features=None if model.features is None else features)

    def members_map(fn, params, state):
      if base.members_map is None:  # one stack: ids are its rows
        rows = num_stacked(params, stacked_axes(base, params))
        ids = jnp.arange(rows)
        return fn(framed(base), params, (state, frames(ids, rows)), ids)
      # Joined stacks (member groups): each stack's ids are its members'.
      return base.members_map(
          lambda model, p, s, ids: fn(framed(model), p, (s, frames(ids, num_members)), ids),
          params, state)

    return base._replace(members_map=members_map)
