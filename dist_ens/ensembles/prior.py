"""Randomized prior functions (Osband, Aslanides and Cassirer 2018; config.ensemble.method
= 'prior'): each member predicts with its trained network plus a fixed random one,

  f_m(x) = g_m(x) + scale * p_m(x)

where p_m, the member's prior network, is initialised from a stream of its own and never
trained. Where the data say little, members keep their priors' disagreement; where they
say much, the trained networks learn to cancel their priors.

The prior lives in the member's model state, not in its params: the optimizer never sees
it (no gradient, no optimizer state, no weight decay), yet it is stacked over 'member',
checkpointed, restored by Ensemble.load, exported and predicted with like BatchNorm's
statistics. Its network is config.model's (prior.widths=()) or a smaller one of the same
kind (the MLP's hidden widths), applied in evaluation mode (no dropout; BatchNorm with its
initial statistics), so its output is a fixed function of the input. Member m's prior is
initialised from fold_in(member m's init key, _PRIOR_STREAM): from (seed, m) only, the
same on any mesh and M, and apart from the key the trained network starts from, so with
scale=0 the members train exactly as a deep ensemble's.
"""

from typing import Any, NamedTuple

import jax

from dist_ens.core.model import Model
from dist_ens.ensembles.method import Method, MethodSpec, scale_field, widths_field


# config.ensemble.prior: this method's fields, each one's meaning in the comments above
# or beside it (dist_ens/config/schema.py reads them; docs/config.md shows them).
FIELDS = dict(
    scale=3.0,  # >= 0; 3 as in Osband et al.'s own BootDQN+prior code
    # The prior's hidden widths, for models that take config.model.widths (the MLP); () =
    # the member's own architecture.
    widths=(),
)

PyTree = Any
# Stream tag of the prior's init within a member's init key (rng.py's tags are 1, 2, 3, 5).
_PRIOR_STREAM = 7


class PriorState(NamedTuple):
  """A member's model state with its prior: what the trained network keeps (BatchNorm
  statistics, {} if none) and the frozen prior network."""
  base: PyTree
  prior_params: PyTree
  prior_state: PyTree


def wrap(model: Model, prior: Model, scale: float) -> Model:
  """`model`'s output plus `scale` times that of `prior`, a network initialised beside
  it from a stream of its own and kept, untrained, in the model state."""

  def init(rng, sample_x):
    params, state = model.init(rng, sample_x)
    prior_params, prior_state = prior.init(jax.random.fold_in(rng, _PRIOR_STREAM), sample_x)
    return params, PriorState(state, prior_params, prior_state)

  def apply(params, state, x, *, train, rng=None):
    outputs, base = model.apply(params, state.base, x, train=train, rng=rng)
    prior_outputs, _ = prior.apply(state.prior_params, state.prior_state, x, train=False)
    return outputs + scale * jax.lax.stop_gradient(prior_outputs), state._replace(base=base)

  return Model(init, apply)


def make(spec: MethodSpec) -> Method:
  """Randomized priors from config.ensemble.prior (scale, widths): independent members,
  each with a frozen random network added to its output."""
  scale = scale_field(spec.options['scale'], 'prior.scale', '3.0 (0: no prior, a deep ensemble)')
  widths = widths_field(spec.options['widths'], 'prior.widths',
                        "(64, 64) (() = the members' own network)")

  def wrap_model(model: Model, task: Any) -> Model:
    del task  # Any output shape: the prior's has the model's.
    if not widths:
      return wrap(model, model, scale)
    if spec.build_model is None:
      raise ValueError('prior.widths needs MethodSpec.build_model (specs.method_spec with '
                       'num_outputs).')
    prior = spec.build_model({'widths': widths},
                             f'config.ensemble.prior.widths={widths!r}')
    return wrap(model, prior, scale)

  # PBT copies a whole member, its prior with it: the copy is its source's function.
  return Method('prior', wrap_model=wrap_model, copyable=True)
