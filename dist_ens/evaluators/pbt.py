"""Population-based training inside the compiled run: the loop's action and the exploit.

Every pbt.interval steps (never at the last step) the action evaluates every member on
the validation split, asks dist_ens.ensembles.pbt.decide who copies whom, then

  exploit   gathers the whole train state along the member axis on the device: one
            compiled gather whose outputs keep the state's shardings (XLA moves the
            copied members between devices with a collective over 'member'; the state
            never visits the host, only the [M] source indices do);
  explore   replaces the [M] per-member hyperparameters that the compiled step takes
            as data, so the step is not traced or compiled again.

What a copy takes: the source's parameters, model state (BatchNorm statistics),
optimizer state (Adam's moments and count) and frozen flag. What it keeps: its own data
position and randomness. A run has one data position, the step, and member i's batches
(with data.member_order 'shuffled' or 'bootstrap'), dropout masks and augmentation are
drawn from (seed, i, step): a member that copies another goes on with its own stream
rather than replaying its source's, so the two diverge from the next step on.

The hyperparameters and the lineage live in every checkpoint's meta (Session.meta_extras),
so a resume continues with them; together with decisions that depend only on (seed,
round, metric values), a resumed run equals an uninterrupted one.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from dist_ens.core import hparams as hparams_lib, stacks as stacks_lib
from dist_ens.core.axes import MEMBER
from dist_ens.ensembles import pbt as pbt_lib
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.training.loop import Call, PeriodicAction, Session
from dist_ens.evaluators.evaluator import EvalRun
from dist_ens.core.state import member_flags

_META_KEY = 'pbt'
_MAX_COPIES_LISTED = 8  # a round's log line names this many copies at most


def make_exploit(state_shardings: Any, mesh: jax.sharding.Mesh,
                 places: stacks_lib.Places | None = None) -> Callable[..., Any]:
  """exploit(state, sources) -> the state whose member i is member sources[i]'s, bit for bit.

  Every leaf stacked over members (its first dimension sharded over 'member') is gathered
  along that axis; scalars (the step) stay. Compiled once per run, the state donated,
  with out_shardings = the state's shardings. The gather all-gathers each stacked leaf
  over 'member' before slicing: for a moment a device holds every member of one leaf.
  Each stack (`places`, core/stacks.py; default one stack) is gathered by its own
  members' sources, which name members of the same stack.
  """
  def take(leaf: jax.Array, sharding: jax.sharding.NamedSharding, sources: jax.Array):
    stacked = leaf.ndim > 0 and len(sharding.spec) > 0 and sharding.spec[0] == MEMBER
    return leaf[sources] if stacked else leaf

  def one_stack(state: Any, shardings: Any, sources: jax.Array) -> Any:
    return jax.tree.map(lambda leaf, sharding: take(leaf, sharding, sources), state, shardings)

  def exploit(state: Any, sources: jax.Array) -> Any:
    stacks = places or stacks_lib.Places.one(sources.shape[0])
    return stacks.join([
        one_stack(s, shardings, sources[p.first:p.first + p.count] - p.first)
        for s, shardings, p in zip(stacks.split(state), stacks.split(state_shardings),
                                   stacks)])

  return jax.jit(exploit, in_shardings=(state_shardings, mesh_lib.replicated(mesh)),
                 out_shardings=state_shardings, donate_argnums=0)


def lineage(rounds: list[dict[str, Any]], num_members: int) -> list[str]:
  """Per member, the rounds in which it copied another: 'step<source' entries in order,
  e.g. '200<3 400<5' (members.csv's lineage column; '' for a member never replaced)."""
  out: list[list[str]] = [[] for _ in range(num_members)]
  for round_ in rounds:
    for member, source in enumerate(round_['sources']):
      if source != member:
        out[member].append(f'{round_["step"]}<{source}')
  return [' '.join(entries) for entries in out]


def round_line(round_index: int, step: int, metric: str, values: list[float],
               sources: list[int]) -> str:
  """One console line per round: who copied whom and the range of the metric ranked.

  Example:
    >>> round_line(2, 1000, 'nll', [0.41, 0.52, 0.47, 0.60], [0, 1, 2, 0])
    'pbt round 2 at step 1000: validation nll 0.4100 to 0.6000; member 3 copied member 0'
  """
  finite = [v for v in values if np.isfinite(v)]
  ranked = (f'validation {metric} {min(finite):.4f} to {max(finite):.4f}' if finite
            else f'no member has a finite validation {metric}')
  copies = [f'member {m} copied member {s}' for m, s in enumerate(sources) if s != m]
  if len(copies) > _MAX_COPIES_LISTED:  # Hundreds in a large population: count them.
    shown = ', '.join(copies[:_MAX_COPIES_LISTED // 2])
    return (f'pbt round {round_index} at step {step}: {ranked}; {len(copies):,} members copied '
            f'better ones ({shown}, ...; members.csv\'s lineage column lists each)')
  return f'pbt round {round_index} at step {step}: {ranked}; {", ".join(copies) or "no copies"}'


class PopulationBasedTraining(PeriodicAction):
  """Every spec.interval steps: validate, decide, exploit, explore; an event {'split': 'pbt'}.

  Runs after the other periodic actions of its step (the step's test evaluation sees the
  members before the round) and before the checkpoint (which saves them after it).
  """

  def __init__(self, call: Call, spec: pbt_lib.PbtSpec):
    session = call.session
    super().__init__(spec.interval)
    self.spec = spec
    self._places = session.parts.places  # PBT ranks and copies within each stack
    self._exploit = make_exploit(session.parts.state_shardings, session.parts.mesh,
                                 self._places)
    self._rounds: list[dict[str, Any]] = []
    saved = session.saved_meta.get(_META_KEY)
    if saved is not None:  # A resume: the hyperparameters as the last round left them.
      self._rounds = list(saved['rounds'])
      _set_hparams(session, {f: np.asarray(v, np.float32) for f, v in saved['hparams'].items()})
    self._record(session)

  def on_end(self, call: Call) -> None:
    pass  # No round at the last step: its copies would only duplicate members.

  def run(self, call: Call) -> Call:
    session = call.session
    spec, step = self.spec, call.step
    with session.off_clock():
      validation = session.evaluator.evaluate(call.state, session.run_data.validation)
    frozen = member_flags(session.fetch(call.state.frozen))
    values = [float('nan') if frozen[i] else float(v)
              for i, v in enumerate(validation['members'][spec.metric])]
    round_index = step // spec.interval
    decision = _decide(spec, round_index, values, session.parts.hparams, self._places)
    sources = jax.device_put(decision.sources.astype(np.int32),
                             mesh_lib.replicated(session.parts.mesh))
    state = self._exploit(call.state, sources)
    _set_hparams(session, decision.hparams)
    sources_list = decision.sources.tolist()
    self._rounds.append({'step': step, 'sources': sources_list})
    written = {f: hparams_lib.as_written(v) for f, v in decision.hparams.items()}
    session.write({'step': step, 'split': 'pbt',
                   'members': {'source': sources_list, **{f: written[f] for f in spec.rules}},
                   'pbt': {'round': round_index, 'metric': spec.metric, 'values': values,
                           'sources': sources_list, 'hparams': written}})
    logging.info('%s', round_line(round_index, step, spec.metric, values, sources_list))
    self._record(session)
    return dataclasses.replace(call, state=state)

  def _record(self, session: Session) -> None:
    """What checkpoints save (the hyperparameters now, the rounds so far) and what the
    run reports (final_metrics.json's 'pbt', members.csv's lineage column)."""
    session.meta_extras[_META_KEY] = {
        'hparams': {f: hparams_lib.as_written(v) for f, v in session.parts.hparams.items()},
        'rounds': self._rounds}
    session.results['pbt'] = {'interval': self.spec.interval, 'metric': self.spec.metric,
                              'rounds': self._rounds,
                              'lineage': lineage(self._rounds, session.spec.num_members)}


def _decide(spec: pbt_lib.PbtSpec, round_index: int, values: list[float],
            hparams: dict[str, np.ndarray], places: stacks_lib.Places) -> pbt_lib.Decision:
  """pbt_lib.decide within each stack's members; sources and hyperparameters in id
  order."""
  sources = np.arange(len(values))
  new = {f: np.array(v, np.float32) for f, v in hparams.items()}
  for g in places:
    one = pbt_lib.decide(spec, round_index, list(np.asarray(values)[g.ids]),
                         {f: v[g.ids] for f, v in hparams.items()}, first_member=g.first)
    sources[g.ids] = one.sources + g.first
    for f, v in one.hparams.items():
      new[f][g.ids] = v
  return pbt_lib.Decision(sources, new)


def _set_hparams(session: Session, values: dict[str, np.ndarray]) -> None:
  """The members' hyperparameters from now on: on the mesh for the step (same shapes and
  sharding, so no retrace), and in session.parts (each stack's too) for members.csv and
  final_metrics.json."""
  session.parts = session.parts.with_hparams(
      {f: np.asarray(v, np.float32) for f, v in values.items()})
  session.hparams = session.parts.device_hparams()


def evaluator(run: EvalRun) -> list[PeriodicAction]:
  """[PopulationBasedTraining] with pbt.enabled: after the step's evaluations, before its
  checkpoint."""
  return [] if run.spec.pbt is None else [PopulationBasedTraining(run.call, run.spec.pbt)]
