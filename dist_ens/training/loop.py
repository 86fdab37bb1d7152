"""The training loop, which only steps, and the interface of what it calls: actions.

After every call of the compiled step the loop hands a `Call` (the step reached, the
state, the call's metrics) to each action in turn; `call.session` is the run as this
process holds it (config, parts, data, evaluator, writers, results), the same object for
every call. An action decides itself whether it is due (every N steps, at the end) and
may read the state, evaluate, write events or put results in `call.session.results`.
Logging, evaluation, OOD scoring, checkpoints, top-k selection and profiling are all
actions (dist_ens.training.actions); a user adds their own from Python without editing
the package:

  def log_norm(call):
    norms = call.session.fetch(jax.vmap(optax.global_norm)(call.state.params))
    call.session.write({'step': call.step, 'split': 'train',
                        'members': {'param_norm': norms.tolist()}})

  dist_ens.train(config, workdir, actions=[dist_ens.every(100, log_norm)])
"""

import contextlib
import dataclasses
import json
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from dist_ens.core.state import TrainState
from dist_ens.eval.evaluate import Evaluator
from dist_ens.io import member_files
from dist_ens.io.writers import EventWriter
from dist_ens.core.step import StepMetrics, TrainStep

if TYPE_CHECKING:  # assemble builds the step, so it imports this package.
  from dist_ens.config.specs import RunSpec
  from dist_ens.run.assemble import Parts
  from dist_ens.run.run_data import RunData


@dataclasses.dataclass
class Session:
  """The run as this process holds it from its start (or resume) to its end: the same
  object for every call of the step, and what an action reads besides the call.

  Attributes:
    config: the run's config as given (saved in every checkpoint; for users' actions:
      dist_ens's own read `spec`).
    spec, parts, run_data, workdir: the run (see dist_ens.run.assemble): spec holds what
      the loop and its actions read of the config (dist_ens.config.specs.RunSpec).
    start_step, total_steps: where this session (re)started and where the run ends.
    steps_per_call: steps each call of the compiled step runs.
    hparams: the per-member hyperparameters on the mesh (population-based training
      replaces them between calls).
    evaluator: evaluates a state on a split (see Evaluator).
    writer: the run's event writers (`write` sends to them).
    results: what the run returns and writes to final_metrics.json; actions add to it.
    saved_meta: what the restored checkpoint carried beside the state ({} on a fresh run).
    meta_extras: what actions save beside the state in every checkpoint from now on
      (population-based training's hyperparameters and lineage), read back from saved_meta;
      a value that is a function is called at each save (the train metrics since the
      last log step).
    batches: the input pipeline (dist_ens.data.Batches): its .state is the data position
      a checkpoint must save, its .stats what it has read.
  """
  config: ml_collections.ConfigDict
  spec: 'RunSpec'
  parts: 'Parts'
  run_data: 'RunData'
  workdir: Path
  start_step: int
  total_steps: int
  steps_per_call: int
  hparams: dict[str, jax.Array]
  evaluator: Evaluator
  writer: EventWriter
  results: dict[str, Any] = dataclasses.field(default_factory=dict)
  saved_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
  meta_extras: dict[str, Any] = dataclasses.field(default_factory=dict)
  batches: Any = None  # the input pipeline (data.Batches): .state is the data position
  _off_clock: float = 0.0
  _clock_start: float = dataclasses.field(default_factory=time.perf_counter)

  @property
  def restored(self) -> bool:
    return bool(self.saved_meta)

  @property
  def writes_final_events(self) -> bool:
    """Whether after-the-last-step actions write their events: not on a rerun of a
    finished run, which steps nowhere and whose final events are already written (the
    checkpoint at the last step is saved only after them). Results are still computed
    again, for final_metrics.json, which a kill may have prevented."""
    return not self.restored or self.start_step < self.total_steps

  def write(self, event: dict[str, Any]) -> None:
    """Sends one event ({'step', 'split', 'members': {...}, 'ensemble': {...}}) to the writers."""
    self.writer.write(event)

  def fetch(self, tree: Any) -> Any:
    """Small device results as numpy on every process (gathered across hosts)."""
    if all(leaf.is_fully_addressable for leaf in jax.tree.leaves(tree)
           if isinstance(leaf, jax.Array)):
      # One process: read the arrays as they are. A program gathering them would run
      # after every call already queued, and the read would wait for those calls too.
      return jax.tree.map(np.asarray, tree)
    return jax.tree.map(np.asarray, _replicate(self.parts.mesh)(tree))

  def checkpoint_meta(self) -> dict[str, Any]:
    """What a checkpoint saves beside the state: enough to rebuild the model without
    the dataset or config.json (the config, input shape, classes), and the training
    time so far."""
    meta = {'train_seconds': self.train_seconds(), 'input_shape': list(self.parts.input_shape),
            'num_classes': self.parts.num_outputs,  # the model's outputs (format 2's name)
            'config': json.loads(self.config.to_json()),
            'mesh': dict(self.parts.mesh.shape),  # The layout Ensemble.load keeps.
            **{k: v() if callable(v) else v for k, v in self.meta_extras.items()}}
    scale = self.run_data.scale
    if scale is not None:  # What predict needs to take raw inputs and give target units.
      meta['standardizer'] = member_files.standardizer_dict(scale)
    if self.run_data.split_scales is not None:  # Member splits: each split's own, in order.
      meta['split_standardizers'] = [member_files.standardizer_dict(s)
                                     for s in self.run_data.split_scales]
    if self.parts.input_dtype != jnp.float32:  # Token ids: what Ensemble.load builds for.
      meta['input_dtype'] = np.dtype(self.parts.input_dtype).name
    return meta

  def train_seconds(self) -> float:
    """Training time of the whole run, resumes included (evaluation left out)."""
    return self.saved_meta.get('train_seconds', 0.0) + self.train_clock() - self._clock_start

  def train_clock(self) -> float:
    """Seconds of training so far in this process: wall time minus `off_clock` time."""
    return time.perf_counter() - self._off_clock

  @contextlib.contextmanager
  def off_clock(self) -> Iterator[None]:
    """Time spent inside (e.g. evaluation) does not count as training time."""
    start = time.perf_counter()
    try:
      yield
    finally:
      self._off_clock += time.perf_counter() - start

@dataclasses.dataclass(frozen=True)
class Call:
  """What one call of the compiled step gives the actions.

  Attributes:
    step: the last step run (a call runs session.steps_per_call steps).
    state: the train state after it (device arrays, sharded); do not keep a reference
      across calls: the next call donates it.
    metrics: the call's StepMetrics (device arrays; [M], or [K, M] for K steps a call);
      None before the first call.
    session: the run (Session), the same for every call.

  An action that replaces the state (population-based training copies members) returns
  `dataclasses.replace(call, state=new_state)` from on_step; the actions after it and
  the next call see that state.
  """
  step: int
  state: TrainState
  metrics: StepMetrics | None
  session: Session

  def __getattr__(self, name: str) -> Any:
    # The deprecated view of the 17-field Context of 0.x: call.config was ctx.config.
    if name in _SESSION_NAMES:
      warnings.warn(f'call.{name} is deprecated (dist_ens.Context became Call + Session): '
                    f'use call.session.{name}.', DeprecationWarning, stacklevel=2)
      return getattr(self.session, name)
    raise AttributeError(f'{type(self).__name__!r} object has no attribute {name!r}')


_SESSION_NAMES = frozenset(
    [f.name for f in dataclasses.fields(Session) if not f.name.startswith('_')] +
    ['restored', 'writes_final_events', 'write', 'fetch', 'checkpoint_meta', 'train_seconds',
     'train_clock', 'off_clock'])


def __getattr__(name: str) -> Any:
  if name == 'Context':  # The old name of what actions receive.
    warnings.warn('dist_ens.Context is deprecated: actions receive a dist_ens.Call '
                  '(step, state, metrics, session).', DeprecationWarning, stacklevel=2)
    return Call
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


_REPLICATORS: dict[Any, Callable[[Any], Any]] = {}


def _replicate(mesh: jax.sharding.Mesh) -> Callable[[Any], Any]:
  # One jitted identity per mesh, with replicated outputs. Called on one step's
  # metrics at a time: the same shapes every call, so it compiles once.
  if mesh not in _REPLICATORS:
    _REPLICATORS[mesh] = jax.jit(lambda tree: tree, out_shardings=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))
  return _REPLICATORS[mesh]


class Action(Protocol):
  """What the loop calls. Subclass PeriodicAction, or wrap a function with `every`.

  on_step and on_end may return a Call (the same call with a new state, see Call) that
  the actions after them and the loop go on with; None keeps the call.
  """

  def on_step(self, call: Call) -> Call | None:
    """After every call of the step (call.step advanced by steps_per_call)."""

  def on_end(self, call: Call) -> Call | None:
    """Once, after the last step (not when the run stops early)."""

  def close(self) -> None:
    """Always, last: release files and threads."""


class PeriodicAction:
  """An action that runs `run(call)` every `every` steps (0: never) and, if
  `at_end`, once after the last step. Override `run`."""

  def __init__(self, every: int = 0, at_end: bool = False):
    self.every, self.at_end = every, at_end

  def due(self, step: int) -> bool:
    return bool(self.every) and step % self.every == 0

  def on_step(self, call: Call) -> Call | None:
    # The last step belongs to on_end, so nothing runs twice there.
    if self.due(call.step) and call.step != call.session.total_steps:
      return self.run(call)
    return None

  def on_end(self, call: Call) -> Call | None:
    if self.at_end or self.due(call.session.total_steps):
      return self.run(call)
    return None

  def run(self, call: Call) -> Call | None:
    raise NotImplementedError

  def close(self) -> None:
    pass


class _Callback(PeriodicAction):

  def __init__(self, every: int, fn: Callable[[Call], None], at_end: bool):
    super().__init__(every, at_end)
    self._fn = fn

  def run(self, call: Call) -> None:
    self._fn(call)


def every(steps: int, fn: Callable[[Call], None], *, at_end: bool = True) -> Action:
  """An action that calls fn(call) every `steps` steps and after the last step.

  The loop sees only the steps between calls of the compiled step: with
  train.steps_per_call=0 (auto) the run picks a K that divides `steps` of every action
  passed to train; an explicit train.steps_per_call must divide `steps` itself.

  Example:
    >>> act = every(100, lambda call: print(call.step))
  """
  if not isinstance(steps, int) or steps < 0:
    raise ValueError(f'every(steps={steps!r}): steps must be an int >= 0.')
  return _Callback(steps, fn, at_end)


def run_loop(first: Call, train_step: TrainStep, batches: Iterator[tuple[jax.Array, ...]],
             actions: Sequence[Action], should_stop: Callable[[int], bool]
             ) -> tuple[bool, Call]:
  """Steps from first.step to the session's total_steps, calling the actions after each
  call of the step.

  Python stays at most one call ahead of the device: after queueing a call it waits
  for the call before it. Otherwise it would queue calls up to the next action that
  reads a result (a log step), and a stop request would wait for all of them. The
  device still always has the next call queued.

  Returns:
    (finished, last): finished is True if the run finished (every action's on_end ran),
    False if `should_stop` asked it to stop first (the caller saves last.state); last is
    the last call the actions saw.
  """
  session, call = first.session, first
  k = session.steps_per_call
  for step in range(call.step + k, session.total_steps + 1, k):
    if should_stop(call.step):
      return False, call
    previous = call.metrics
    state, metrics = train_step(call.state, session.hparams, *next(batches))
    call = Call(step, state, metrics, session)
    for action in actions:
      call = _kept(call, action.on_step(call))
    jax.block_until_ready(previous)  # (None before the first call: returns at once)
  for action in actions:
    call = _kept(call, action.on_end(call))
  return True, call


def _kept(call: Call, returned: Any) -> Call:
  # What an action returned replaces the call only if it is one (a user's run() may
  # return anything).
  return returned if isinstance(returned, Call) else call
