"""The ensemble-method extension point: a method is one value (a `Method`) built by a
factory from the run's facts (`MethodSpec`).

A method says what it changes in core as one value, `hooks` (a core.hooks.MethodHooks
the train step reads as it is: what each member collects while it trains, how members
are born and updated where they share leaves), and which members predict; the per-member
functions are vmapped like the update (so they work on any mesh, and their state is
checkpointed with the rest):

  hooks.init_collected(params, model_state) -> collected
  hooks.collect(collected, params, model_state, step) -> collected   # after `step` steps
  members(collected, params, model_state, step, key) -> (params [K, ...], model_state
                                                         [K, ...], valid [K] bool)

and, where it changes them, how it wraps the model and the loss (MIMO's heads), how many
outputs it asks the model for per task output, and how the optimizer's schedule restarts
(snapshot cycles). A factory
`make(spec: MethodSpec) -> Method` checks its own config fields (`spec.options`, the
method's group of config.ensemble, declared in its file as `FIELDS = dict(...)`, the
group named after the file: dist_ens/config/schema.py) and refuses, in one line, what it
cannot do with the run (`spec.reproducible`, the task in `wrap_model`, ...).

Built-ins live one per file (deep.py, batchensemble.py, mimo.py, snapshot.py, swag.py,
prior.py, epinet.py, masksembles.py, packed.py, sgmcmc.py)
and are registered by name in dist_ens.ensembles.methods; a user's is an import path,
`config.ensemble.method = 'my_pkg.methods:make'`, whose fields are
`config.ensemble.options` (docs/how-it-works.md shows one).
"""

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax

from dist_ens.core.hooks import MethodHooks
from dist_ens.errors import ConfigError

PyTree = Any


class MethodSpec(NamedTuple):
  """What a method's factory may read of the run (config.ensemble and the rest of the
  config it depends on; configs/default.py documents each field)."""
  name: str  # ensemble.method: a built-in's name or an import path
  total_steps: int  # train.steps
  restartable_schedule: bool  # optim.schedule != 'constant' or optim.warmup_steps > 0
  reproducible: bool  # config.reproducible
  options: Mapping[str, Any]  # the method's own fields (its config.ensemble group)
  own: Any = 'all'  # ensemble.own
  lora_rank: Any = 8  # ensemble.lora_rank, lora_alpha, lora_targets (own='lora')
  lora_alpha: Any = 0.0
  lora_targets: Any = ''
  train_shared: Any = False  # ensemble.train_shared
  # build_model(fields, asking) -> a second network of the run's model kind, with the
  # config.model `fields` set otherwise ({'widths': (32,)}; models.resized), for the
  # task's outputs per example; `asking` names the method's field for its refusal
  # ('config.ensemble.prior.widths=(32,)'). None where no model is built (a spec read
  # only to check the method's fields): call it in wrap_model, not in make.
  build_model: Callable[[Mapping[str, Any], str], Any] | None = None
  seed: int = 0  # config.seed
  # config.model.name ('' where config.model.factory or a Hugging Face checkpoint makes it)
  model: str = ''
  num_members: int = 1  # config.num_members (a member group's count: its own config's)
  # config.model as models.spec.ModelSpec (None where the spec is read only for its fields):
  # for a method that builds the model's network itself (packed's narrower ResNets)
  model_spec: Any = None


def _trained_member(collected, params, state, step, key):
  del collected, step, key
  return (*jax.tree.map(lambda a: a[None], (params, state)),
          jax.numpy.ones((1,), bool))


class Method(NamedTuple):
  """An ensemble method (see the module doc). The defaults are independent members."""
  name: str
  # What the method changes in core, read by the train step as it is: what each member
  # collects (init_collected, collect: snapshots, SWAG's moments), how members are born
  # and updated where they share leaves (BatchEnsemble's W; methods.with_owned sets the
  # hooks of the leaves ensemble.own does not give them), its own update (SG-MCMC's
  # Langevin noise). The default: independent members, nothing collected.
  hooks: MethodHooks = MethodHooks()
  members: Callable[..., tuple[PyTree, PyTree, jax.Array]] = _trained_member
  per_member: int = 1  # K: predicting members per trained member
  cycles: int = 1  # learning-rate restarts (snapshot)
  cycles_from: int = 0  # the step the restarts begin at (snapshot.start: fast geometric)
  cycle_rate: float = 1.0  # each cycle's peak rate over optim.learning_rate's
  # What the method makes of train.steps changes with it (cycles, SWAG's start), so a
  # resumed run may not change train.steps.
  scales_with_steps: bool = False
  outputs_per_output: int = 1  # the model gives this many outputs per task output (MIMO)
  # (model, task) -> the model members train and predict with (MIMO's slots and heads).
  wrap_model: Callable[[Any, Any], Any] | None = None
  wrap_loss: Callable[[Any], Any] | None = None  # loss -> the loss of wrapped outputs
  allows_own: bool = False  # ensemble.own other than 'all' (shared leaves) applies
  copyable: bool = False  # PBT may copy a member's whole state onto another
  own: str = 'all'  # config.ensemble.own, as configured (ensembles/own.py)
  # The params leaves each member owns by name, the rest shared (with_owned); None: all.
  owned: frozenset[str] | None = None
  lora: Any = None  # own='lora': the adapted kernels, rank and scale (ensembles/lora.py)
  # config.ensemble.train_shared: the shared leaves train (summed gradient), not frozen.
  train_shared: bool = False
  # (own, lora, params, num_outputs) -> (owned names or None, Lora or None): ensemble.own
  # (and own='lora''s factors) resolved on one member's params where they are more than
  # the model's (an epinet's: own names the base network's leaves); None: own.py's.
  resolve_own: Callable[[Any, Any, PyTree, int], tuple[Any, Any]] | None = None
  # Where the model's own leaves sit in the wrapped params and model state (an epinet's
  # 'base'): config.model.init_from's file is read as the model's, and the method's
  # leaves beside them start per member. '': the model's leaves are the params.
  wrapped_under: str = ''
  # (config.optim's OptimSpec, train.steps) -> optimizer(hp): the method's own update rule
  # in place of config.optim's (SG-MCMC's samplers); None: core.optim.make_optimizer's.
  optimizer: Callable[[Any, int], Any] | None = None
  # Whether the post-hoc last-layer Laplace (config.eval.laplace) applies to each member's
  # output layer; False where that layer has a posterior of its own (SNGP's GP layer).
  last_layer_laplace: bool = True

  @property
  def collects(self) -> bool:
    """Whether members collect while training (the step runs `hooks.collect`)."""
    return self.hooks.collect is not None

  @property
  def shares(self) -> bool:
    """Whether params have leaves shared by all members (BatchEnsemble, ensemble.own):
    stored once, which the `hooks.shared` of every method that shares says."""
    return self.hooks.shared is not None


def int_field(value: Any, field: str, low: int) -> int:
  """`value` checked as an int >= low; `field` names it (e.g. 'snapshot.cycles')."""
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ConfigError(f'config.ensemble.{field}={value!r} must be an int >= {low}.')
  return value


def fraction_field(value: Any, field: str, example: str) -> float:
  """`value` checked as a fraction of train.steps in [0, 1)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
    raise ConfigError(f'config.ensemble.{field}={value!r} must be a fraction of train.steps in '
                      f'[0, 1), e.g. {example}.')
  return value


def scale_field(value: Any, field: str, example: str) -> float:
  """`value` checked as a finite number >= 0 (a prior's weight, say)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      math.isfinite(value) and value >= 0):
    raise ConfigError(f'config.ensemble.{field}={value!r} must be a finite number >= 0, '
                      f'e.g. {example}.')
  return float(value)


def widths_field(value: Any, field: str, example: str) -> tuple[int, ...]:
  """`value` checked as hidden widths: a tuple or list of positive ints (maybe empty)."""
  if not isinstance(value, (tuple, list)) or not all(
      isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in value):
    raise ConfigError(f'config.ensemble.{field}={value!r} must be hidden widths, positive '
                      f'ints, e.g. {example}.')
  return tuple(value)


def refuse_reproducible(spec: MethodSpec, why: str) -> None:
  """One line for a method whose results depend on the mesh, under config.reproducible."""
  if spec.reproducible:
    raise ConfigError(f'config.reproducible=True with config.ensemble.method={spec.name!r}: '
                      f'{why}; use reproducible=False.')
