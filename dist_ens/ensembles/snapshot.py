"""Snapshot ensembles (Huang et al. 2017; config.ensemble.method='snapshot'): each
member's training is ensemble.snapshot.cycles restarts of config.optim.schedule, and the
member's parameters and model state at the end of every cycle are kept; M x cycles
snapshots predict. With ensemble.snapshot.start > 0 the cycles begin late and short, at
snapshot.cycle_rate of the rate: fast geometric ensembling (Garipov et al. 2018)."""

import jax
import jax.numpy as jnp

from dist_ens.core.hooks import MethodHooks
from dist_ens.errors import ConfigError
from dist_ens.ensembles.method import Method, MethodSpec, fraction_field, int_field


# config.ensemble.snapshot: this method's fields, each one's meaning in the comments above
# or beside it (dist_ens/config/schema.py reads them; docs/config.md shows them).
FIELDS = dict(
    cycles=4,  # must divide the steps from snapshot.start on
    # > 0: fast geometric ensembling, short cycles over the last (1 - start) of training
    # (e.g. start=0.8, cycle_rate=0.05), after optim.schedule ran over the first part
    start=0.0,
    cycle_rate=1.0,  # the cycles' peak rate / optim.learning_rate
)


def snapshots(cycles: int, total_steps: int, start: int = 0, rate: float = 1.0) -> Method:
  """Snapshots at steps S + L, S + 2L, ..., S + cycles*L = total_steps, where the
  cycles begin at step S = `start` and L = (total_steps - S) / cycles."""
  length = (total_steps - start) // cycles

  def init(params, state):
    return jax.tree.map(lambda a: jnp.zeros((cycles, *a.shape), a.dtype), (params, state))

  def collect(collected, params, state, step):
    slot = (step - start) // length - 1

    def keep(buffers):
      return jax.tree.map(lambda buf, a: buf.at[slot].set(a), buffers, (params, state))

    # `step` is the same for every member (unbatched under vmap): a real branch.
    due = (step > start) & ((step - start) % length == 0)
    return jax.lax.cond(due, keep, lambda b: b, collected)

  def members(collected, params, state, step, key):
    del params, state, key
    filled = start + (jnp.arange(cycles) + 1) * length <= step
    return (*collected, filled)

  return Method('snapshot', hooks=MethodHooks(init_collected=init, collect=collect),
                members=members, per_member=cycles, cycles=cycles, cycles_from=start,
                cycle_rate=rate, scales_with_steps=True)


def make(spec: MethodSpec) -> Method:
  """Snapshot ensembles from config.ensemble.snapshot (cycles, start, cycle_rate)."""
  options, steps = spec.options, spec.total_steps
  cycles = int_field(options['cycles'], 'snapshot.cycles', 1)
  start = round(fraction_field(options['start'], 'snapshot.start', '0.8') * steps)
  rate = options['cycle_rate']
  if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0:
    raise ConfigError(f'config.ensemble.snapshot.cycle_rate={rate!r} must be a number > 0, the '
                      "cycles' peak learning rate over optim.learning_rate (e.g. 0.05).")
  if (steps - start) % cycles:
    raise ConfigError(f'config.ensemble.snapshot.cycles={cycles} must divide the '
                      f'{steps - start} steps from snapshot.start on (train.steps={steps}; '
                      'every cycle is as long); change train.steps, snapshot.start or cycles.')
  if not spec.restartable_schedule:
    raise ConfigError("config.ensemble.method='snapshot' restarts config.optim.schedule every "
                      "cycle, and 'constant' has nothing to restart: use schedule='cosine' "
                      '(as Huang et al. 2017).')
  return snapshots(cycles, steps, start, float(rate))
