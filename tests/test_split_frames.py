"""run/split_frames.py and Task.reframe as pure functions: every member of a member-split
regression run scored in one frame is the member in its own split's units, converted.
(End to end: tests/test_member_split.py's test metrics against Ensemble.predict.)"""

import jax.numpy as jnp
import numpy as np
import pytest

from dist_ens.core import stacks as stacks_lib
from dist_ens.core.model import Model
from dist_ens.data import uci
from dist_ens.eval import evaluate
from dist_ens.run.split_frames import SplitFrames
from dist_ens.tasks.regression import reframe, split_outputs


@pytest.mark.parametrize('raw', [-3.0, 0.5, 30.0])
def test_reframe_moves_the_mean_and_scales_the_variance(raw):
  outputs = jnp.array([[1.5, -2.0, raw, raw + 1.0]])  # D = 2: means, raw variances
  scale, shift = jnp.array([3.0, 0.25]), jnp.array([-1.0, 4.0])
  mean, var = split_outputs(outputs, squeeze=False)
  new_mean, new_var = split_outputs(reframe(outputs, scale, shift),
                                               squeeze=False)
  np.testing.assert_allclose(new_mean, mean * scale + shift, rtol=1e-6)
  np.testing.assert_allclose(new_var, var * scale ** 2, rtol=1e-5)
  means_only = reframe(outputs[:, :2], scale, shift, means_only=True)
  np.testing.assert_allclose(means_only, outputs[:, :2] * scale + shift, rtol=1e-6)


def _linear():
  """A member: [mean, raw variance] = x @ w (a heteroscedastic regression model)."""
  return Model(init=None, apply=lambda p, s, x, **kw: (x @ p['w'], s))


def _scales(rng, count):
  fit = lambda shift: uci.Standardizer.fit(rng.normal(shift, 1 + shift, (40, 3)),
                                           rng.normal(2 * shift, 1 + 3 * shift, 40))
  splits = tuple(fit(s) for s in range(count))
  return SplitFrames(fit(0.5)._replace(y_std=np.min([s.y_std for s in splits])), splits)


def _by_hand(frames, w, x_frame, rows_per_split):
  """Each row's outputs in the frame: the raw inputs standardised with its split's
  statistics, its linear map, the mean and variance converted to the frame."""
  raw = x_frame * frames.frame.x_std + frames.frame.x_mean
  out = []
  for r in range(len(w)):
    own = frames.splits[r // rows_per_split]
    mean, var = split_outputs(own.apply_inputs(raw) @ w[r], squeeze=False)
    target_mean, target_var = mean * own.y_std + own.y_mean, var * own.y_std ** 2
    out.append(np.concatenate([(target_mean - frames.frame.y_mean) / frames.frame.y_std,
                               target_var / frames.frame.y_std ** 2], -1))
  return np.stack(out)


def test_each_member_predicts_in_the_frame_as_in_its_splits_units():
  rng = np.random.default_rng(0)
  frames = _scales(rng, 2)
  w = rng.normal(0, 0.5, (4, 3, 2)).astype(np.float32)  # 4 rows: 2 per split
  x = rng.normal(0, 1, (5, 3)).astype(np.float32)
  model = frames.model(_linear(), reframe, num_members=4)
  out = evaluate.member_logits(model, ({'w': jnp.asarray(w)}, {}), jnp.asarray(x))
  mean, var = split_outputs(out, squeeze=False)
  want = _by_hand(frames, w, x, 2)
  np.testing.assert_allclose(mean, want[..., :1], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(var, want[..., 1:], rtol=1e-4)
  # A direct apply is the member's own (unframed): only over_stacks sees the frame.
  np.testing.assert_array_equal(model.apply({'w': w[0]}, {}, x)[0], x @ w[0])


def test_a_collecting_methods_rows_follow_their_members_split():
  """K = 2 rows per member, member m's rows m*K..m*K+K-1: 8 rows of 4 members in 2 splits."""
  rng = np.random.default_rng(1)
  frames = _scales(rng, 2)
  w = rng.normal(0, 0.5, (8, 3, 2)).astype(np.float32)
  x = rng.normal(0, 1, (5, 3)).astype(np.float32)
  model = frames.model(_linear(), reframe, num_members=4)
  out = evaluate.member_logits(model, ({'w': jnp.asarray(w)}, {}), jnp.asarray(x))
  mean, _ = split_outputs(out, squeeze=False)
  np.testing.assert_allclose(mean, _by_hand(frames, w, x, 4)[..., :1], rtol=1e-4, atol=1e-5)


def test_joined_stacks_see_their_members_splits():
  """Member groups (two stacks of 2 members, ids 0-1 and 2-3) over 2 splits of 2 members."""
  rng = np.random.default_rng(2)
  frames = _scales(rng, 2)
  w = rng.normal(0, 0.5, (4, 3, 2)).astype(np.float32)
  x = rng.normal(0, 1, (5, 3)).astype(np.float32)
  places = stacks_lib.Places((stacks_lib.Place(0, 2), stacks_lib.Place(2, 2)), joined=True)
  joined = stacks_lib.members_model([_linear(), _linear()], places)
  model = frames.model(joined, reframe, num_members=4)
  params = ({'w': jnp.asarray(w[:2])}, {'w': jnp.asarray(w[2:])})
  out = evaluate.member_logits(model, (params, ({}, {})), jnp.asarray(x))
  mean, _ = split_outputs(out, squeeze=False)
  np.testing.assert_allclose(mean, _by_hand(frames, w, x, 2)[..., :1], rtol=1e-4, atol=1e-5)


def test_the_frames_target_std_keeps_every_variance_above_the_floor():
  """RunData's frame takes the smallest split's target std: no member's variance shrinks
  moving there, so the task's floor never clips one (a held-out outlier makes a split's
  std far smaller than the pool's)."""
  frames = _scales(np.random.default_rng(3), 3)
  _, _, y_scale, _ = frames.affines()
  assert np.all(y_scale >= 1.0) and np.any(y_scale > 1.0)
