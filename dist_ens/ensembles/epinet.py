"""Epinets (Osband et al. 2023, "Epistemic neural networks"; config.ensemble.method =
'epinet'): each member is its base network plus a small network, the epinet, that takes an
epistemic index z ~ N(0, I_k) beside the base network's last hidden features,

  f(x, z) = base(x) + epinet(x~, z) + prior_scale * prior(x~, z),
  x~ = [stop_gradient(features(x)), flatten(x)],
  epinet(x~, z) = mlp([x~, z]) reshaped [C, k] @ z        (the paper's form)

and `prior` an epinet of the same shape never trained. The index is the member's source of
disagreement with itself: for a fixed z, f(., z) is one network; over z, the spread of
f(x, z) is the epinet's epistemic uncertainty at x.

Training draws `samples` indices per example per step (from the step's key, a stream
apart from dropout's) and averages the loss over them; the base network gets the
gradient of its logits only (the features are stop_gradient'ed). Evaluation combines the
member's outputs over `eval_samples` fixed indices as the task combines members
(classification: the mean of the softmaxes), so `Ensemble.predict`'s member
probabilities are each member's mean over its indices.

Each member owns its epinet: its params are EpinetParams(base, epinet), all trained; its
model state is EpinetState(base, prior, indices), the frozen prior epinet and the
evaluation's indices, drawn at init from streams of the member's init key (from (seed,
member) only), stacked over 'member', checkpointed and exported like BatchNorm's
statistics. The base network starts from the member's init key itself, as a deep
ensemble's member does. The model must expose its features (Model.features: the built-in
MLP, CNN, ResNets and ViT do).

config.ensemble.own names the base network's leaves, as it would without the epinet
(resolve_own), and every member owns its epinet beside them: 'epinet' owns the epinet
alone, so the base network is ONE shared, frozen copy (ensembles/own.py: stored once, no
optimizer state; the paper's epinet on a trained base), 'head' or 'lora' or a regex share
part of it, 'all' shares nothing (the form above, unchanged). config.model.init_from reads
its file as the base network's (Method.wrapped_under, io/init_from.py): a deep run's
'params/0/w' starts 'base/0/w', and the epinet, its prior and the indices start per member
whatever the file holds.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dist_ens.core.model import Model
from dist_ens.ensembles import own as own_lib
from dist_ens.ensembles.method import Method, MethodSpec, int_field, scale_field, widths_field
from dist_ens.errors import ConfigError
from dist_ens.models.base import dense_init
from dist_ens.parallel.sharding_rules import path_str
from dist_ens.tasks.task import Loss


# config.ensemble.epinet: this method's fields, each one's meaning in the comments above
# or beside it (dist_ens/config/schema.py reads them; docs/config.md shows them).
FIELDS = dict(
    index_dim=8,  # k, the index's dimension
    widths=(50,),  # the epinet's (and its prior's) hidden widths
    samples=8,  # index draws per example per training step
    # Fixed indices per member (drawn at init) whose mean softmax a member predicts with.
    eval_samples=32,
    prior_scale=1.0,  # >= 0; 0: no prior epinet
)

PyTree = Any
# Stream tags within a member's init key (rng.py's are 1, 2, 3, 5; prior.py's 7) and, for
# the training indices, within a step's key (dropout uses the key itself; MIMO's 17).
_EPINET_STREAM, _PRIOR_STREAM, _EVAL_INDEX_STREAM, _INDEX_STREAM = 11, 13, 19, 23
# EpinetParams' fields: the names its leaves go by ('base/0/w', 'epinet/1/b').
BASE, EPINET = 'base', 'epinet'


class EpinetParams(NamedTuple):
  """A member's trained params: its base network's and its epinet's (dense layers)."""
  base: PyTree
  epinet: list[dict[str, jax.Array]]


class EpinetState(NamedTuple):
  """A member's model state: the base network's ({} if none), the frozen prior epinet,
  and the indices [eval_samples, index_dim] evaluation combines over."""
  base: PyTree
  prior: list[dict[str, jax.Array]]
  indices: jax.Array


class Options(NamedTuple):
  """config.ensemble.epinet, checked."""
  index_dim: int
  widths: tuple[int, ...]
  samples: int
  eval_samples: int
  prior_scale: float


def mlp_init(key: jax.Array, fan_in: int, widths: tuple[int, ...], classes: int,
             index_dim: int) -> list:
  """Dense layers fan_in -> widths -> classes * index_dim, He-normal
  (models.base.dense_init); the last scaled by 1 / sqrt(index_dim), so that its
  contraction with z ~ N(0, I) has the spread of one He-normal output, whatever k."""
  sizes = (fan_in, *widths, classes * index_dim)
  keys = jax.random.split(key, len(sizes) - 1)
  scales = [1.0] * (len(sizes) - 2) + [1 / math.sqrt(index_dim)]
  return [dense_init(k, a, b, s) for k, a, b, s in zip(keys, sizes[:-1], sizes[1:], scales)]


def epinet_outputs(layers: list, inputs: jax.Array, z: jax.Array) -> jax.Array:
  """mlp([inputs, z]) as [..., C, k], contracted with z: [..., C]. inputs [..., F] and
  z [..., k] share their leading axes."""
  h = jnp.concatenate([inputs, z.astype(inputs.dtype)], axis=-1)
  for layer in layers[:-1]:
    h = jax.nn.relu(h @ layer['w'] + layer['b'])
  out = h @ layers[-1]['w'] + layers[-1]['b']
  out = out.reshape(*out.shape[:-1], -1, z.shape[-1])
  return jnp.einsum('...ck,...k->...c', out, z.astype(out.dtype))


def _inputs(features: jax.Array, x: jax.Array) -> jax.Array:
  """x~ [B, F + D]: the base network's features, which no gradient leaves the epinet
  through, and the input flattened."""
  flat = lambda a: a.reshape(a.shape[0], -1)
  features = flat(jax.lax.stop_gradient(features))
  return jnp.concatenate([features, flat(x).astype(features.dtype)], axis=-1)


def wrap(model: Model, options: Options, combine: Any) -> Model:
  """`model` (one exposing Model.features) with an epinet and its prior beside it;
  `combine` is the task's way to combine members (Task.combine), here the indices."""
  k = options.index_dim

  def init(rng, sample_x):
    params, state = model.init(rng, sample_x)
    logits, features, _ = jax.eval_shape(
        lambda p, s, x: model.features(p, s, x, train=False), params, state, sample_x)
    fan_in = math.prod(features.shape[1:]) + math.prod(sample_x.shape[1:]) + k
    epinet, prior = (mlp_init(jax.random.fold_in(rng, stream), fan_in, options.widths,
                              logits.shape[-1], k)
                     for stream in (_EPINET_STREAM, _PRIOR_STREAM))
    indices = jax.random.normal(jax.random.fold_in(rng, _EVAL_INDEX_STREAM),
                                (options.eval_samples, k), jnp.float32)
    return EpinetParams(params, epinet), EpinetState(state, prior, indices)

  def apply(params, state, x, *, train, rng=None):
    logits, features, base = model.features(params.base, state.base, x, train=train, rng=rng)
    if train:  # Fresh indices per example and step, from the step's key.
      if rng is None:
        raise ValueError('an epinet in training draws its indices from `rng`; got None.')
      z = jax.random.normal(jax.random.fold_in(rng, _INDEX_STREAM),
                            (x.shape[0], options.samples, k), jnp.float32)
    else:  # The member's fixed evaluation indices, the same for every example.
      z = jnp.broadcast_to(state.indices, (x.shape[0], *state.indices.shape))
    inputs = _inputs(features, x)
    inputs = jnp.broadcast_to(inputs[:, None], (*z.shape[:2], inputs.shape[-1]))
    prior = jax.lax.stop_gradient(epinet_outputs(state.prior, inputs, z))
    outputs = (logits[:, None] + epinet_outputs(params.epinet, inputs, z)
               + options.prior_scale * prior)  # [B, S, C]
    state = state._replace(base=base)
    if train:
      return outputs, state
    return combine(jnp.moveaxis(outputs, 1, 0), jnp.ones((z.shape[1],), bool)), state

  return Model(init, apply)


def index_mean_loss(loss: Loss) -> Loss:
  """The mean over index samples of `loss` on each sample's outputs ([B, S, C])."""

  def mean(outputs, labels, hparams):
    return jnp.mean(jax.vmap(lambda o: loss(o, labels, hparams), in_axes=1)(outputs))

  return mean


def options_from(fields: Any) -> Options:
  """config.ensemble.epinet checked, each bad field refused in one line naming it."""
  return Options(index_dim=int_field(fields['index_dim'], 'epinet.index_dim', 1),
                 widths=widths_field(fields['widths'], 'epinet.widths',
                                     '(50,) (() = a linear epinet)'),
                 samples=int_field(fields['samples'], 'epinet.samples', 1),
                 eval_samples=int_field(fields['eval_samples'], 'epinet.eval_samples', 1),
                 prior_scale=scale_field(fields['prior_scale'], 'epinet.prior_scale',
                                         '1.0 (0: no prior epinet)'))


def make(spec: MethodSpec) -> Method:
  """Epinets from config.ensemble.epinet (index_dim, widths, samples, eval_samples,
  prior_scale): each member its base network with an epinet and a frozen prior epinet."""
  options = options_from(spec.options)

  def wrap_model(model: Model, task: Any) -> Model:
    # The task first: a token task's model (no features) is refused for its outputs.
    if task.combine is None or task.output_shape is not None:
      raise ConfigError(f"config.ensemble.method='epinet' adds [batch, units] outputs over "
                        f'index samples and combines them as the task combines members, '
                        f'which config.task={task.name!r} does not; use another method.')
    if model.features is None:
      raise ConfigError("config.ensemble.method='epinet' reads the base network's last hidden "
                        'features (Model.features), which config.model does not expose; use '
                        "model.name='mlp', 'cnn', 'resnet', 'resnet18', 'wide_resnet' or "
                        "'vit', or a model whose Model sets features.")
    return wrap(model, options, task.combine)

  lora = (spec.lora_rank, spec.lora_alpha, spec.lora_targets) if spec.own == 'lora' else None
  # PBT copies a whole member, its epinets with it: the copy is its source's function.
  return Method('epinet', wrap_model=wrap_model, wrap_loss=index_mean_loss, copyable=True,
                allows_own=True, own=spec.own, lora=lora, train_shared=spec.train_shared,
                resolve_own=resolve_own, wrapped_under=BASE)


def resolve_own(own: Any, lora: Any, params: EpinetParams,
                num_outputs: int) -> tuple[frozenset[str] | None, Any]:
  """config.ensemble.own on an epinet member's params (Method.resolve_own): 'epinet'
  owns the epinet's leaves alone (one frozen base network); 'head', 'lora' or a regex
  name the base network's leaves as they would without the epinet, and every member
  owns its epinet beside them; 'all' (None) owns everything, as before."""
  names = lambda tree, prefix: frozenset(
      f'{prefix}/{path_str(path)}' for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
  epinet = names(params.epinet, EPINET)
  if own == 'epinet':
    return epinet, None
  owned, lora = own_lib.resolve(own, lora, params.base, num_outputs)
  if owned is None:
    return None, None
  prefixed = lambda base_names: frozenset(f'{BASE}/{n}' for n in base_names)
  return epinet | prefixed(owned), (None if lora is None else
                                    lora._replace(targets=prefixed(lora.targets)))
