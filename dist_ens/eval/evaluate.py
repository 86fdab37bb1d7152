"""Evaluation of all members and the ensemble over a whole split, on device.

One jitted step computes, for a batch and every member at once (members sharded
over 'member', examples over 'data'), the additive metric sums and the few
per-example values that rank-based metrics need (see dist_ens.eval.metrics). The last
partial batch is padded and masked, so every example counts exactly once: padded
rows add nothing to the sums and are cut from the per-example values on the host.

Post-hoc methods (temperature scaling, greedy selection, MC dropout; see
dist_ens.evaluators.posthoc) work on every member's log-probabilities of a whole
split, gathered to the host by `split_log_probs` ([M, N, C] float32: small for
evaluation splits, 8 members x 10^4 examples x 10 classes is 3 MB), and score
them with `metrics_from_log_probs`, which runs the same `metrics.eval_batch`.

MC dropout (config.eval.mc_samples = K > 0) calls the model in evaluation mode WITH
an rng: apply(params, state, x, train=False, rng=key). By the model contract
(dist_ens.core.model) that samples the stochastic layers (dropout) while BatchNorm
keeps its running statistics. Each example gets its own key,
fold_in(fold_in(mc_key(seed, member), sample), global example index), and the model
is vmapped over single examples, so a draw never depends on the batch it sits in:
the samples are the same on any mesh and for any eval batch size. Member m's
prediction is the mean of its K sampled softmax distributions.
"""

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dist_ens.core import rng as rng_lib
from dist_ens.core.model import over_stacks, stacked_axes
from dist_ens.core.state import member_flags
from dist_ens.eval import metrics, ranks, registry as metric_registry
from dist_ens.data import Split, to_global
from dist_ens.parallel.mesh import (DATA, batch_sharding, gather_members, member_sharding,
                                    replicated)
from dist_ens.models import Model

EvalStep = Callable[..., metrics.BatchEval]
OutputsStep = Callable[..., jax.Array]
# Task.combine: (member outputs [M, B, ...], member_mask [M]) -> the ensemble's [B, ...].
Combine = Callable[[jax.Array, jax.Array], jax.Array]

# Stream tag of MC dropout draws: apart from init (member_keys) and training (tag 1,
# dist_ens.core.rng), so evaluation never reuses a training mask.
_MC_STREAM = 2


class SplitEval(NamedTuple):
  """A whole split's metric sums and its per-example stats (padding removed)."""
  sums: dict[str, np.ndarray]
  examples: metrics.ExampleStats


def member_logits(model: Model, variables: Any, x: jax.Array) -> jax.Array:
  """[M, B, C] logits of every member in evaluation mode (running statistics, no dropout).

  `variables` is (params, model_state), both stacked [M, ...] (params as model.member_axes
  says: leaves shared by every member are stored once and not copied M times).
  """
  def stack_logits(model, params, model_state, member_ids):
    del member_ids
    return jax.vmap(lambda p, s: model.apply(p, s, x, train=False)[0],
                    in_axes=(stacked_axes(model, params), 0))(params, model_state)

  return over_stacks(model, stack_logits, *variables)  # Member groups: each its own vmap.


def mc_key(seed: int, member: jax.Array) -> jax.Array:
  """The key of member `member`'s MC dropout samples; depends only on (seed, member)."""
  return jax.random.fold_in(rng_lib.member_keys(seed, jnp.asarray(member)[None])[0], _MC_STREAM)


def mc_sample_logits(model: Model, params: Any, model_state: Any, x: jax.Array, key: jax.Array,
                     offset: jax.Array, num_samples: int) -> jax.Array:
  """[K, B, C] logits of ONE member under K dropout samples (evaluation mode otherwise).

  Example x[i] is the split's example offset + i; its mask in sample k is drawn from
  fold_in(fold_in(key, k), offset + i), whatever the batch holds besides it.
  """
  index = jnp.asarray(offset, jnp.uint32) + jnp.arange(x.shape[0], dtype=jnp.uint32)

  def one_example(xi, example_key):
    return model.apply(params, model_state, xi[None], train=False, rng=example_key)[0][0]

  def one_sample(k):
    sample_key = jax.random.fold_in(key, k)
    keys = jax.vmap(lambda i: jax.random.fold_in(sample_key, i))(index)
    return jax.vmap(one_example)(x, keys)

  # One sample at a time: memory of one forward pass, not K.
  return jax.lax.map(one_sample, jnp.arange(num_samples, dtype=jnp.uint32))


def member_outputs(model: Model, variables: Any, x: jax.Array, *, mc_samples: int = 0,
                   combine: Combine | None = None, seed: int = 0,
                   offset: jax.Array | int = 0) -> jax.Array:
  """[M, B, ...] float32 outputs of every member: plain evaluation, or with mc_samples =
  K > 0 each member's K MC dropout samples combined by the task (`combine`, Task.combine:
  classification gives the log of their mean probabilities, regression their mixture)."""
  if not mc_samples:
    return member_logits(model, variables, x).astype(jnp.float32)
  if combine is None:
    raise ValueError('member_outputs(mc_samples > 0) needs the task\'s combine.')
  every_sample = jnp.ones((mc_samples,), bool)

  def stack_samples(model, params, model_state, member_ids):
    def one_member(p, s, member):  # Keyed by the member's id: the same in any stack.
      samples = mc_sample_logits(model, p, s, x, mc_key(seed, member), offset, mc_samples)
      return combine(samples.astype(jnp.float32), every_sample)

    return jax.vmap(one_member, in_axes=(stacked_axes(model, params), 0, 0))(
        params, model_state, member_ids)

  return over_stacks(model, stack_samples, *variables)


def make_eval_step(model: Model, mesh: Mesh,
                   eval_batch: Callable[..., Any] = metrics.eval_batch) -> EvalStep:
  """(variables, x, y, mask, member_mask) -> `eval_batch` of the batch, replicated.

  `variables` is (params, model_state) of all members, sharded over 'member';
  `eval_batch` is the task's (dist_ens.tasks.Task.eval_batch; classification's
  metrics.eval_batch by default) of every member's outputs.

  Example:
    step = make_eval_step(model, mesh)
    out = step((state.params, state.model_state), x, y, mask, member_mask)
    out.sums['ensemble_correct'], out.examples.entropy.shape
  """

  def eval_step(variables, x, y, mask, member_mask):
    outputs, member_mask = gather_members(member_logits(model, variables, x), member_mask,
                                          mesh)
    return eval_batch(outputs, y, mask, member_mask)

  data, members = batch_sharding(mesh), member_sharding(mesh)
  # The variables as they lie (None): split over 'model' too when the layout splits them.
  return jax.jit(eval_step, in_shardings=(None, data, data, data, members),
                 out_shardings=replicated(mesh))


def waits_each_batch(mesh: Mesh) -> bool:
  """Whether a loop over a split's batches waits for each before queuing the next: on a
  multi-device CPU mesh, where XLA:CPU's collectives deadlock when many programs over
  several devices are queued (training syncs every few calls for this:
  training/cadence.py)."""
  return mesh.devices.flat[0].platform == 'cpu' and mesh.size > 1


def evaluate_split(eval_step: EvalStep, variables: Any, split: Split, batch_size: int,
                   mesh: Mesh, member_mask: jax.Array) -> SplitEval:
  """Runs `eval_step` over `split` in batches; the last one is padded and masked.

  Example:
    out = evaluate_split(step, (state.params, state.model_state), dataset.test, 1000, mesh, mask)
    metric_registry.finalize(out.sums, out.examples)['ensemble']['nll']

  Args:
    eval_step: from make_eval_step.
    variables: (params, model_state) of all members, sharded over 'member'.
    split: the examples (any labels will do where only uncertainty is used).
    batch_size: rounded up to a multiple of the mesh's 'data' axis.
    mesh: the ('member', 'data') mesh `eval_step` was built for.
    member_mask: [M] bool, members in the ensemble, sharded like the state.

  Returns:
    SplitEval with the summed metrics (numpy, float32) and the per-example stats
    of the len(split.y) real examples (numpy).
  """
  if not len(split.y):
    raise ValueError('evaluate_split() got an empty split; it needs at least one example.')
  d = mesh.shape[DATA]
  batch_size = -(-batch_size // d) * d  # Round up so every data shard gets equal rows.
  sharding = batch_sharding(mesh)
  wait = waits_each_batch(mesh)
  total, examples = None, []
  for start, valid in padded_chunks(len(split.y), batch_size):
    # The last batch is padded; its masked rows count for nothing.
    x, y = (pad_rows(a[start:start + valid], batch_size) for a in (split.x, split.y))
    mask = np.arange(batch_size) < valid
    out = eval_step(variables, to_global(x, sharding), to_global(y, sharding),
                    to_global(mask, sharding), member_mask)
    total = out.sums if total is None else metrics.add_sums(total, out.sums)
    examples.append((out.examples, valid))
    if wait:
      jax.block_until_ready((total, out.examples))
  # Copied to the host after the loop, so the device never waits on a copy. Padding
  # sits at the end of each batch, on the last (example) axis.
  host = [[np.asarray(a)[..., :valid] for a in batch] for batch, valid in examples]
  # The task's own per-example type (classification's metrics.ExampleStats, ...).
  stacked = type(examples[0][0])(*(np.concatenate(parts, axis=-1) for parts in zip(*host)))
  return SplitEval(jax.tree.map(np.asarray, total), stacked)


def evaluate(eval_step: EvalStep, variables: Any, split: Split, batch_size: int, mesh: Mesh,
             member_mask: jax.Array,
             finalize: Callable[..., dict[str, Any]] = metric_registry.finalize) -> dict[str, Any]:
  """Final metrics (see metric_registry.finalize) of every member and the ensemble on `split`.

  Example:
    results = evaluate(step, (state.params, state.model_state), dataset.test, 1000, mesh, mask)
    results['ensemble']['adaptive_ece'], results['members']['accuracy'][0]
  """
  out = evaluate_split(eval_step, variables, split, batch_size, mesh, member_mask)
  return finalize(out.sums, out.examples)


def evaluate_ood(eval_step: EvalStep, variables: Any, in_split: Split, ood_split: Split,
                 batch_size: int, mesh: Mesh, member_mask: jax.Array,
                 ood_metrics: Callable[..., dict[str, Any]] = ranks.ood_metrics
                 ) -> dict[str, Any]:
  """How well the ensemble's uncertainty tells `ood_split` from `in_split`.

  OOD is the positive class and higher entropy / mutual information means "more
  likely OOD"; see ranks.ood_metrics for the keys.

  Example:
    ood = evaluate_ood(step, (state.params, state.model_state), dataset.test, noise, 1000, mesh, mask)
    ood['ensemble']['auroc_mi'], ood['members']['auroc_entropy'][0]

  Args:
    eval_step, variables, batch_size, mesh, member_mask: as for evaluate().
    in_split: in-distribution examples (the test split).
    ood_split: out-of-distribution examples of the same input shape; labels unused.

  Returns:
    {'members': {...: [M]}, 'ensemble': {...}} of plain floats (JSON-able).
  """
  if in_split.x.shape[1:] != ood_split.x.shape[1:]:
    raise ValueError(f'evaluate_ood(): OOD inputs have shape {ood_split.x.shape[1:]} but '
                     f'in-distribution inputs {in_split.x.shape[1:]}; they must match.')
  inside = evaluate_split(eval_step, variables, in_split, batch_size, mesh, member_mask)
  outside = evaluate_split(eval_step, variables, ood_split, batch_size, mesh, member_mask)
  return ood_metrics(inside.examples, outside.examples)


def member_mask_from_frozen(frozen: jax.Array) -> jax.Array:
  """Members in the ensemble: all that are not frozen (member groups' flags in id order)."""
  return jnp.logical_not(member_flags(frozen))


def make_outputs_step(model: Model, mesh: Mesh, *, mc_samples: int = 0,
                      combine: Combine | None = None, seed: int = 0) -> OutputsStep:
  """(variables, x, offset) -> [M, B, ...] member outputs (see member_outputs), replicated.

  `offset` is the split index of x[0] (MC dropout keys its draws by it).

  Example:
    step = make_outputs_step(model, mesh, mc_samples=8, combine=task.combine, seed=config.seed)
    outputs = split_outputs(step, (state.params, state.model_state), dataset.test, 1000, mesh)
  """

  def outputs_step(variables, x, offset):
    return member_outputs(model, variables, x, mc_samples=mc_samples, combine=combine,
                          seed=seed, offset=offset)

  return jax.jit(outputs_step, in_shardings=(None, batch_sharding(mesh), replicated(mesh)),
                 out_shardings=replicated(mesh))


def padded_chunks(n: int, batch_size: int) -> Iterator[tuple[int, int]]:
  """(start, valid) of each batch of `batch_size` rows over n examples: every batch has the
  same shape (the last one padded, `valid` its real rows), so one compiled program serves
  a whole split."""
  for start in range(0, n, batch_size):
    yield start, min(batch_size, n - start)


def pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
  """`a` with zero rows appended up to `rows` (padding that a mask or a cut removes)."""
  if len(a) == rows:
    return a
  return np.concatenate([a, np.zeros((rows - len(a), *a.shape[1:]), a.dtype)])


def split_outputs(step: OutputsStep, variables: Any, split: Split, batch_size: int,
                  mesh: Mesh) -> np.ndarray:
  """[M, N, ...] float32 numpy outputs of every member on the whole split.

  Batches as evaluate_split (the last one padded, its padding cut); every process
  gets the whole array.
  """
  if not len(split.y):
    raise ValueError('split_outputs() got an empty split; it needs at least one example.')
  d = mesh.shape[DATA]
  # The same batch shape for every split (a small one is padded): one compile.
  batch_size = -(-batch_size // d) * d
  sharding, outs = batch_sharding(mesh), []
  for start, valid in padded_chunks(len(split.y), batch_size):
    x = pad_rows(split.x[start:start + valid], batch_size)
    outs.append((step(variables, to_global(x, sharding), np.uint32(start)), valid))
  return np.concatenate([np.asarray(out)[:, :valid] for out, valid in outs], axis=1)


class Scorer(NamedTuple):
  """A task's metrics of member outputs held on the host (post-hoc evaluation): the
  same eval_batch and finalize as the sharded evaluation, on the default device.

  Example:
    scorer = Scorer.of(tasks.get_task('classification'))
    scorer.metrics(outputs, dataset.test.y, member_mask)['ensemble']['nll']
  """
  eval_batch: Callable[..., Any]
  finalize: Callable[..., dict[str, Any]]
  ood_metrics: Callable[..., dict[str, Any]]

  @classmethod
  def of(cls, task: Any) -> 'Scorer':
    """The plain scorer of a dist_ens.tasks.Task (no unscaling, no user metrics)."""
    return cls(task.eval_batch, task.finalize, task.ood_metrics)

  def split_eval(self, outputs: np.ndarray, targets: np.ndarray,
                 member_mask: np.ndarray | None = None, chunk: int = 1024) -> SplitEval:
    """The SplitEval (sums, per-example stats) of [M, N, ...] member outputs.

    Members are padded to a multiple of 8 and examples to a multiple of `chunk` (masked
    out, and cut from the result), so a run's many post-hoc evaluations share one
    compiled program. A member listed twice counts twice (greedy selection's weights).
    """
    num_members, n = outputs.shape[:2]
    mask = np.ones(num_members, bool) if member_mask is None else np.asarray(member_mask, bool)
    width = -(-num_members // _MEMBER_PAD) * _MEMBER_PAD
    padded = np.zeros((width, -(-n // chunk) * chunk, *outputs.shape[2:]), np.float32)
    padded[:num_members, :n] = outputs
    targets = pad_rows(np.asarray(targets), padded.shape[1])
    mask = np.pad(mask, (0, width - num_members))
    step = compiled_once(self.eval_batch)
    total, examples = None, []
    for start, valid in padded_chunks(n, chunk):
      rows = np.arange(start, start + chunk) < n
      out = step(padded[:, start:start + chunk], targets[start:start + chunk], rows, mask)
      total = out.sums if total is None else metrics.add_sums(total, out.sums)
      examples.append(out.examples._replace(**{
          f: np.asarray(a)[..., :valid] for f, a in out.examples._asdict().items()}))
    stats = type(examples[0])(*(np.concatenate(parts, axis=-1) for parts in zip(*examples)))
    # The padding members' rows go: per-member sums and stats hold the real M only.
    stats = stats._replace(**{f: getattr(stats, f)[:num_members] for f in stats._fields
                              if f.startswith('member_')})
    sums = {k: np.asarray(v)[:num_members] if k.startswith('member_') else np.asarray(v)
            for k, v in total.items()}
    return SplitEval(sums, stats)

  def metrics(self, outputs: np.ndarray, targets: np.ndarray,
              member_mask: np.ndarray | None = None, chunk: int = 1024) -> dict[str, Any]:
    """The task's final metrics ('members', 'ensemble') of [M, N, ...] member outputs."""
    out = self.split_eval(outputs, targets, member_mask, chunk)
    return self.finalize(out.sums, out.examples)

  def ood(self, in_outputs: np.ndarray, out_outputs: np.ndarray, targets: np.ndarray,
          member_mask: np.ndarray | None = None) -> dict[str, Any]:
    """The task's OOD scores of two splits' member outputs (as evaluate_ood). `targets`
    are the in-distribution split's; the scores use none, zeros of their kind stand in."""
    zeros = lambda o: np.zeros((o.shape[1], *targets.shape[1:]), targets.dtype)
    inside, outside = (self.split_eval(o, zeros(o), member_mask)
                       for o in (in_outputs, out_outputs))
    return self.ood_metrics(inside.examples, outside.examples)


_MEMBER_PAD = 8


@functools.lru_cache(maxsize=None)
def compiled_once(fn: Callable[..., Any]) -> Callable[..., Any]:
  """jax.jit(fn), one per function: host code that calls a task's function on arrays
  (an eval_batch, a predict) traces it once, and runs one program where, called eagerly,
  each of its array operations would compile its own."""
  return jax.jit(fn)


class Evaluator:
  """Evaluates a train state on whole splits (see evaluate / evaluate_ood).

  Example:
    evaluator = Evaluator(make_eval_step(model, mesh), mesh, batch_size=1000)
    evaluator.evaluate(state, dataset.test)['ensemble']['nll']
  """

  def __init__(self, eval_step: EvalStep, mesh: Mesh, batch_size: int,
               view: Callable[[Any], Any] = lambda state: state,
               scorer: Scorer = Scorer(metrics.eval_batch, metric_registry.finalize, ranks.ood_metrics)):
    """`view(state)` is the members as they predict (.params, .model_state, .frozen):
    the state itself by default (its params as stored: the eval step's model reads them).
    `scorer` is the task's (dist_ens.tasks.Task): its finalize and ood_metrics score the
    sharded evaluation too, and post-hoc steps score outputs held on the host with it."""
    self.eval_step, self.mesh, self.batch_size, self.view = eval_step, mesh, batch_size, view
    self.scorer = scorer
    self.finalize, self.ood_metrics = scorer.finalize, scorer.ood_metrics

  def evaluate(self, state: Any, split: Split, member_mask: jax.Array | None = None
               ) -> dict[str, Any]:
    """Metrics of every member and the ensemble of the non-frozen (or masked-in) members."""
    state = self.view(state)
    if member_mask is None:
      member_mask = member_mask_from_frozen(state.frozen)
    # A small split is evaluated in one batch, not padded up to the batch size.
    batch_size = min(self.batch_size, len(split.y))
    return evaluate(self.eval_step, (state.params, state.model_state), split, batch_size,
                    self.mesh, member_mask, self.finalize)

  def ood(self, state: Any, in_split: Split, ood_split: Split) -> dict[str, Any]:
    """AUROC/AUPR of telling `ood_split` from `in_split` by the ensemble's uncertainty."""
    state = self.view(state)
    return evaluate_ood(self.eval_step, (state.params, state.model_state), in_split, ood_split,
                        self.batch_size, self.mesh, member_mask_from_frozen(state.frozen),
                        self.ood_metrics)
