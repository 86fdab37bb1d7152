"""The students an ensemble is distilled into (config.distill.student; trained by
dist_ens.ensembles.distill, after training by dist_ens.evaluators.distill).

A student is one network whose forward pass gives H heads' logits [H, B, C] and which
predicts with the mean of its heads' probabilities:

  'same'          one network of the members' model (H = 1), from a fresh init
  'hydra'         the built-in MLP's hidden layers shared (the body), one output layer
                  per ensemble member (H = the members distilled), head h matched to
                  member h (Hydra, Tran et al. 2020)
  'pkg.mod:make'  make(num_outputs) -> a dist_ens.Model, your own network (H = 1)

The student's init key is fold_in(key(seed), STUDENT_STREAM): apart from every
member's (members use fold_in(key(seed), i) for i < M).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dist_ens.core.model import Model
from dist_ens.errors import ConfigError
from dist_ens.importing import is_import_path, load_object
from dist_ens.models.base import dense_init

KINDS = ('same', 'hydra')
STUDENT_STREAM = 2**32 - 1
_FIELD = 'config.distill.student'


class StudentNet(NamedTuple):
  """A student's functions: init(rng, sample_x) -> (params, state) and
  heads(params, state, x, *, train, rng=None) -> (logits [H, B, C], new_state)."""
  kind: str
  num_heads: int
  init: Callable[[jax.Array, jax.Array], tuple[Any, Any]]
  heads: Callable[..., tuple[jax.Array, Any]]

  def log_probs(self, params: Any, state: Any, x: jax.Array) -> jax.Array:
    """[B, C] log of the mean of the heads' probabilities (evaluation mode)."""
    logits, _ = self.heads(params, state, x, train=False)
    member = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jax.nn.logsumexp(member, axis=0) - jnp.log(float(self.num_heads))

  def as_model(self) -> Model:
    """The student as a dist_ens Model whose logits are [H * B, C] (for cost analysis)."""
    def apply(params, state, x, *, train=False, rng=None):
      logits, state = self.heads(params, state, x, train=train, rng=rng)
      return logits.reshape(-1, logits.shape[-1]), state
    return Model(self.init, apply)


def student_key(seed: int) -> jax.Array:
  """The student's init key (see the module doc)."""
  return jax.random.fold_in(jax.random.key(seed), STUDENT_STREAM)


def check_kind(kind: str, builtin_mlp: bool) -> None:
  """Refuses, in one line, a student that cannot be built: an unknown name, or 'hydra'
  for a model that is not the built-in MLP (`builtin_mlp`: model.name='mlp', no factory)."""
  if kind not in KINDS and not is_import_path(kind):
    raise ConfigError(f"{_FIELD}={kind!r}; use '' (off), 'same', 'hydra' or an import path "
                      "'my_pkg.nets:make' (make(num_outputs) -> dist_ens.Model).")
  if is_import_path(kind):  # Fails now, not after training.
    load_object(kind, _FIELD)
  if kind == 'hydra' and not builtin_mlp:
    raise ConfigError(f"{_FIELD}='hydra' splits the built-in MLP into its hidden layers and "
                      "one output layer per member; config.model is not model.name='mlp' "
                      "with model.factory='': use distill.student='same'.")


def make_student(kind: str, member_model: Model, num_outputs: int, num_heads: int
                 ) -> StudentNet:
  """The student `kind` (see the module doc) of a run whose single member is
  `member_model` and whose ensemble distils `num_heads` members (hydra's heads)."""
  if kind == 'same':
    return _single(kind, member_model)
  if kind == 'hydra':
    return _hydra(member_model, num_heads)
  model = load_object(kind, _FIELD)(num_outputs)
  if not callable(getattr(model, 'init', None)) or not callable(getattr(model, 'apply', None)):
    raise ConfigError(f'{_FIELD}={kind!r} returned {type(model).__name__}, not a '
                      'dist_ens.Model (init(rng, x), apply(params, state, x, train, rng)).')
  return _single(kind, model)


def _single(kind: str, model: Model) -> StudentNet:
  def heads(params, state, x, *, train=False, rng=None):
    logits, state = model.apply(params, state, x, train=train, rng=rng)
    return logits[None], state
  return StudentNet(kind, 1, model.init, heads)


def _hydra(mlp: Model, num_heads: int) -> StudentNet:
  """The built-in MLP (a list of {'w', 'b'} layers, with `features`) as a body, its
  hidden layers, and `num_heads` output layers stacked in {'w': [H, F, C], 'b': [H, C]}."""
  def init(rng, sample_x):
    layers, state = mlp.init(rng, sample_x)
    fan_in, fan_out = layers[-1]['w'].shape
    keys = jax.random.split(jax.random.fold_in(rng, 1), num_heads)
    heads = jax.vmap(lambda k: dense_init(k, fan_in, fan_out))(keys)
    return {'body': layers[:-1], 'heads': heads}, state

  def heads(params, state, x, *, train=False, rng=None):
    # The body's inputs are not batched over the heads: vmap computes it once.
    one = lambda head: mlp.features([*params['body'], head], state, x, train=train,
                                    rng=rng)[0]
    return jax.vmap(one)(params['heads']), state

  return StudentNet('hydra', num_heads, init, heads)
