"""Evaluation under distribution shift: the test split corrupted on device, one program.

`make_predict_step` builds ONE jitted step for every corruption and severity: both are
traced int arguments (dist_ens.data.corruptions dispatches with lax.switch), so a run
with eval.shift='all' compiles one program, not one per (corruption, severity). The
step corrupts the batch, runs every member in evaluation mode, and returns the task's
`eval_batch` (sums and per-example stats, as the clean evaluation) and the members'
outputs (what conformal sets need). Severity 0 is the clean split, bitwise.

Which examples. Example i of the test split is corrupted with the key of (seed,
corruption, severity, i) (corruptions.corruption_keys), inside the step and per
example, so every member, every mesh and every M sees the same corrupted inputs.

Units. Corruptions act on RAW inputs in [0, 1] (CIFAR-10-C's definition), but the
model sees standardised ones. `InputFrame` undoes the standardisation (x_raw =
x * scale + offset: config.data.std / mean, or a regression task's Standardizer),
corrupts with value range (0, 1) when the raw test inputs lie in it (images) or else
their (min, max) (e.g. MNIST-1D), and standardises back.

Example:
  frame = InputFrame.fit(test.x, scale=std, offset=mean)
  step = make_predict_step(model, mesh, task.eval_batch, seed=0, frame=frame)
  evaluator = PredictionEvaluator(step, mesh, 1000, view, task.finalize)
  out = evaluator.predict(state, test, corruptions.corruption_id('contrast'), 3)
  out.metrics['ensemble']['accuracy'], out.outputs.shape  # [M, N, C]
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dist_ens.data import Split, corruptions, to_global
from dist_ens.eval import metrics, registry as metric_registry
from dist_ens.eval.evaluate import (member_logits, member_mask_from_frozen, pad_rows,
                                    padded_chunks, waits_each_batch)
from dist_ens.models import Model
from dist_ens.parallel.mesh import (DATA, batch_sharding, gather_members, member_sharding,
                                    replicated)

PredictStep = Callable[..., tuple[Any, jax.Array]]


class InputFrame(NamedTuple):
  """Model inputs x <-> raw inputs x * scale + offset, and the raw value range."""
  scale: np.ndarray  # broadcasts against one example (per channel, or per feature)
  offset: np.ndarray
  value_range: tuple[float, float]
  families: tuple[int, ...] | None = None  # the corruption ids corrupt() takes (None: all)

  @classmethod
  def fit(cls, x: np.ndarray, scale: Any = 1.0, offset: Any = 0.0,
          families: Sequence[int] | None = None) -> 'InputFrame':
    """The frame of model inputs x (a split): (0, 1) if its raw values lie in [0, 1]
    (images), else their (min, max). `families`: the corruption ids it will be asked
    for (a run's eval.shift), compiled alone (corruptions.corrupt_batch)."""
    scale, offset = np.asarray(scale, np.float32), np.asarray(offset, np.float32)
    raw = np.asarray(x, np.float32) * scale + offset
    lo, hi = float(raw.min()), float(raw.max())
    if lo >= 0.0 and hi <= 1.0:
      lo, hi = 0.0, 1.0
    return cls(scale, offset, (lo, hi if hi > lo else lo + 1.0),
               None if families is None else tuple(families))

  def corrupt(self, x: jax.Array, index: jax.Array, corruption: jax.Array,
              severity: jax.Array, seed: int) -> jax.Array:
    """x corrupted in raw units and brought back; x itself (bitwise) at severity 0."""
    scale, offset = jnp.asarray(self.scale), jnp.asarray(self.offset)
    raw = corruptions.corrupt_batch(x * scale + offset, index, corruption, severity, seed,
                                    self.value_range, self.families)
    return jnp.where(severity == 0, x, (raw - offset) / scale)


class SplitPrediction(NamedTuple):
  """A whole split's task metrics, per-example stats and member outputs (no padding)."""
  metrics: dict[str, Any]  # the task's finalize: {'members': ..., 'ensemble': ...}
  examples: Any  # the task's per-example stats (classification: metrics.ExampleStats)
  outputs: np.ndarray  # [M, N, ...] every member's outputs (classification: logits)


def make_predict_step(model: Model, mesh: Mesh,
                      eval_batch: Callable[..., Any] = metrics.eval_batch, *, seed: int = 0,
                      frame: InputFrame | None = None) -> PredictStep:
  """(variables, x, y, mask, member_mask, index, corruption, severity) ->
  (eval_batch of the corrupted batch, member outputs [M, B, ...] float32), replicated.

  `index` [B] holds the examples' positions in the split (their corruption keys);
  corruption and severity are int32 scalars, traced: one compile serves them all.
  frame=None: no corruption at all (a run without eval.shift compiles no switch).
  """

  def step(variables, x, y, mask, member_mask, index, corruption, severity):
    if frame is not None:
      x = frame.corrupt(x, index, corruption, severity, seed)
    outputs, member_mask = gather_members(member_logits(model, variables, x), member_mask,
                                          mesh)
    return eval_batch(outputs, y, mask, member_mask), outputs.astype(jnp.float32)

  data, members, every = batch_sharding(mesh), member_sharding(mesh), replicated(mesh)
  return jax.jit(step, in_shardings=(None, data, data, data, members, data, every, every),
                 out_shardings=every)


class PredictionEvaluator:
  """Runs a predict step over whole splits, clean or corrupted.

  Every split is cut into batches of one size (the last padded and masked), so the
  validation, test and every corrupted test split share one compiled program.
  """

  def __init__(self, step: PredictStep, mesh: Mesh, batch_size: int,
               view: Callable[[Any], Any],
               finalize: Callable[..., dict[str, Any]] = metric_registry.finalize):
    """view(state) is the members as they predict; finalize is the task's (with its
    units: see assemble.Run.evaluator)."""
    d = mesh.shape[DATA]
    self.step, self.mesh, self.view, self.finalize = step, mesh, view, finalize
    self.batch_size = -(-batch_size // d) * d

  def predict(self, state: Any, split: Split, corruption: int = 0, severity: int = 0,
              member_mask: np.ndarray | None = None) -> SplitPrediction:
    """The split (corrupted by `corruption` at `severity`; 0 = clean) through every member;
    the ensemble of the non-frozen members, or of `member_mask`'s ([M] bool) where given."""
    if not len(split.y):
      raise ValueError('predict() got an empty split; it needs at least one example.')
    members = self.view(state)
    variables = (members.params, members.model_state)
    member_mask = (member_mask_from_frozen(members.frozen) if member_mask is None else
                   jax.device_put(np.asarray(member_mask, bool), member_sharding(self.mesh)))
    sharding, size, n = batch_sharding(self.mesh), self.batch_size, len(split.y)
    wait = waits_each_batch(self.mesh)
    ids = (np.int32(corruption), np.int32(severity))  # host scalars: no eager program
    total, parts = None, []
    for start, valid in padded_chunks(n, size):
      x, y = (pad_rows(a[start:start + valid], size) for a in (split.x, split.y))
      mask = np.arange(size) < valid
      index = np.arange(start, start + size, dtype=np.int32)
      batch = [to_global(a, sharding) for a in (x, y, mask, index)]
      out, outputs = self.step(variables, *batch[:3], member_mask, batch[3], *ids)
      total = out.sums if total is None else metrics.add_sums(total, out.sums)
      parts.append((out.examples, outputs, valid))
      if wait:
        jax.block_until_ready((total, out.examples, outputs))
    # Copied to the host after the loop, so the device never waits on a copy.
    host = [[np.asarray(a)[..., :valid] for a in e] for e, _, valid in parts]
    examples = type(parts[0][0])(*(np.concatenate(field, axis=-1) for field in zip(*host)))
    outputs = np.concatenate([np.asarray(o)[:, :valid] for _, o, valid in parts], axis=1)
    sums = jax.tree.map(np.asarray, total)
    return SplitPrediction(self.finalize(sums, examples), examples, outputs)
