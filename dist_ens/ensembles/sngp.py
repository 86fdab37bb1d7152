"""SNGP (Liu et al. 2020, "Simple and principled uncertainty estimation with deterministic
deep learning via distance awareness"; config.ensemble.method='sngp'): each member is its
own SNGP, so M=1 is the paper's single model and M>1 an ensemble of SNGPs.

A member is the run's MLP, CNN or ResNet (config.model.name 'resnet', 'resnet18',
'wide_resnet') with
  - every hidden layer spectral-normalised (the MLP's dense layers before the output, the
    CNN's convolutions, every convolution of a ResNet: its stem, both of each block's and
    each shortcut's 1x1 projection, as uncertainty-baselines' wide_resnet_sngp.py): its
    kernel W, read as the matrix [window * in, out] (Miyato et al.'s reshape for a
    convolution), is used as W / max(1, sigma / c), sigma estimated by one power-iteration
    step per training step from a vector u [out] kept in the model state (v = Wu / |Wu|,
    u <- W'v / |W'v|, sigma = v'Wu with u, v constants for the gradient); c =
    ensemble.sngp.norm_bound. (edward2's SpectralNormalizationConv2D bounds the
    convolution operator's norm instead, from vectors of the layer's input shape; the
    reshaped matrix's norm bounds it up to the factor sqrt(window), Tsuzuku et al. 2018.)
    A ResNet's BatchNorms stay as they are, their running statistics the model state's
    `base` (updated in training, used at evaluation, as the plain ResNet's);
  - its output layer replaced by a random-feature GP on the last hidden features h (a
    ResNet's pooled features): phi(h) = a cos(g(h) W_r + b_r), W_r ~ N(0, 1) [F, D] and
    b_r ~ U(0, 2 pi) drawn at init and fixed (model state; D = ensemble.sngp.features), so
    phi(h).phi(h') approximates (a^2 D / 2) exp(-|g(h) - g(h')|^2 / 2), the RBF kernel of
    length scale l = ensemble.sngp.length_scale; logits = phi(h) beta, beta [D, C] the only
    output weights, trained with the ridge penalty ridge / (2N) |beta|^2 on the mean loss
    (the gradient ridge / N * beta added to beta's: the MAP of beta ~ N(0, I / ridge) and N
    examples; optim.weight_decay acts on beta too, as on every kernel). For the MLP and
    CNN, the paper's form: g(h) = h / l and a = sqrt(2/D). For a ResNet, the reference
    code's (wide_resnet_sngp.py's gp_input_normalization and scale_random_features=False):
    g(h) = LayerNorm(h) / (sqrt(F) l), a unit vector over l (the layer norm without its
    affine parameters), so the kernel reads the features' directions whatever BatchNorm
    made of their scale, and a = 1, which keeps beta's gradient from shrinking by
    sqrt(2/D) under SGD (with a = sqrt(2/D) the digits ResNet-20 hardly trains);
  - the Laplace covariance of beta: precision P = ridge I + N E[phi phi'] with E the mean
    over the examples of the last ensemble.sngp.cov_steps training steps (the paper's
    exact, reset-each-epoch form, cov_steps = one epoch: N / batch size; with the
    Gaussian likelihood's unit weight, one D x D matrix for all classes, as edward2's
    LaplaceRandomFeatureCovariance for C > 2), N = ensemble.sngp.data_size;
  - at prediction (train=False), the mean-field adjustment logits / sqrt(1 + lambda var),
    var = phi' P^-1 phi (a Cholesky solve of P, once per call), lambda =
    ensemble.sngp.mean_field_factor (pi / 8, the probit approximation's; 0: no adjustment).

Under dist_ens's step, each member's apply sees its whole batch: the batch mean of
phi phi' is over every 'data' shard (XLA's reduction in the global view; in reproducible
mode the step's canonical sum over micro-batches and shards), i.e. the psum over 'data'
the precision needs; a member's precision is its own (vmapped over 'member'). What the
model state holds is sum over the window's steps of the batch's mean phi phi' (micro-
batches average to the batch's, so train.micro_batches does not change it) and the count
of training steps seen, so resume is exact and P is a function of them.

Defaults: D = 1024 and ridge = 1 (the paper's and uncertainty-baselines'), lambda = pi/8
(the paper's derivation; uncertainty-baselines' scripts tune it, to 20 in some), l = 1
(on a ResNet's unit vectors: 0.5 and 1 measured on the digits ResNet-20, 1 better, in
docs/ensemble_methods.md). c = 0, the default, is the network's (DEFAULTS): 0.95 for the
MLP and CNN (below 1, the paper's condition: they have no normalisation, and their
He-normal kernels start with sigma 2.8 (the default MLP's 256 x 256) to 4.9 (its
40 x 256), so a bound of 6 would hardly act) and 6 for the ResNets (the paper's and
uncertainty-baselines' WRN value, where BatchNorm rescales each convolution). In the
post-activation 'resnet' and 'resnet18' every convolution feeds a BatchNorm, which undoes
the bound on the forward pass: there it changes only a kernel's effective learning rate,
and at 6 hardly acts on ResNet-20's He-normal kernels (sigma about 1.9 for a 3x3, 16 -> 16).
"""

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import custom_batching

from dist_ens.core.model import Model, leaf_at, with_leaf
from dist_ens.ensembles.method import Method, MethodSpec, int_field
from dist_ens.errors import ConfigError
from dist_ens.models import resnet

# The method's fields, config.ensemble.sngp: each one's meaning in the comment lines above
# it and its check in brackets at the comment's end (dist_ens/config/schema.py reads them).
FIELDS = dict(
    # D, the random features' count of the GP output layer
    features=1024,  # [int >= 1]
    # c, the bound on each hidden layer's spectral norm (0: the network's, 0.95 for the
    # MLP and CNN, 6 for the ResNets)
    norm_bound=0.0,  # [number >= 0]
    # l, the GP's RBF length scale on its input (an MLP's or CNN's features, a ResNet's
    # layer-normalised unit vector)
    length_scale=1.0,  # [number > 0]
    # s, the output weights' prior precision: the precision's s I and the training
    # penalty s / (2N) times beta's squared norm
    ridge=1.0,  # [number > 0]
    # lambda of logits / sqrt(1 + lambda var) at prediction (pi / 8; 0: no adjustment)
    mean_field_factor=0.39269908169872414,  # [number >= 0]
    # The last training steps whose batches make the precision (the paper: one epoch)
    cov_steps=32,  # [int >= 1]
    # N, the training set's size (an int >= 1): the precision is s I + N E[phi phi']
    data_size=0,
)

FIELD = 'config.ensemble.sngp'


class Network(NamedTuple):
  """What a network's SNGP takes (the module doc): c where norm_bound is 0, and
  whether the GP reads the layer-normalised unit vector (else h) with a = 1 (else
  sqrt(2/D))."""
  norm_bound: float
  unit_input: bool


_PAPERS = Network(norm_bound=0.95, unit_input=False)
_WRNS = Network(norm_bound=6.0, unit_input=True)
RESNETS = tuple(resnet.MAKERS)  # models/resnet.py's: BatchNorm, 'blocks'
MODELS = ('mlp', 'cnn', *RESNETS)  # config.model.name: the models whose layers it normalises
DEFAULTS = {'mlp': _PAPERS, 'cnn': _PAPERS, **{name: _WRNS for name in RESNETS}}
# Stream tags within a member's init key (rng.py's 1, 2, 3, 5; prior 7; epinet 11-23).
_FEATURES_STREAM, _VECTORS_STREAM = 29, 31


class SNGPParams(NamedTuple):
  """A member's trained params: the model's less its output layer, and beta [D, C]."""
  body: Any
  output: jax.Array


class SNGPState(NamedTuple):
  """A member's model state: the model's own ({} if none), a power-iteration vector [out]
  per hidden kernel, the fixed random features (W_r [F, D], b_r [D]), the sum over the
  window's steps of the batch's mean phi phi' [D, D], and the training steps seen."""
  base: Any
  vectors: list
  projection: jax.Array
  phase: jax.Array
  moment: jax.Array
  steps: jax.Array


class Options(NamedTuple):
  """config.ensemble.sngp, checked."""
  features: int
  norm_bound: float
  ridge: float
  mean_field_factor: float
  cov_steps: int
  data_size: int
  length_scale: float
  unit_input: bool  # the GP reads LayerNorm(h) / sqrt(F), its features unscaled (a = 1)


def _normalise(a: jax.Array) -> jax.Array:
  return a / jnp.maximum(jnp.linalg.norm(a), 1e-12)


def power_step(kernel: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sigma, u'): one power-iteration step on `kernel` read as [window * in, out] from
  u [out]; sigma = v'Wu' carries W's gradient, u and v are constants."""
  matrix = kernel.reshape(-1, kernel.shape[-1]).astype(jnp.float32)
  v = jax.lax.stop_gradient(_normalise(matrix @ u))
  u = jax.lax.stop_gradient(_normalise(matrix.T @ v))
  return v @ matrix @ u, u


def normalised(kernel: jax.Array, u: jax.Array, bound: float) -> tuple[jax.Array, jax.Array]:
  """(kernel / max(1, sigma / bound), u'): the kernel with its spectral norm bounded."""
  sigma, u = power_step(kernel, u)
  return kernel / jnp.maximum(1.0, sigma / bound).astype(kernel.dtype), u


def gp_input(h: jax.Array, options: Options) -> jax.Array:
  """g(h) [B, F] in float32: h / l, or (unit_input) LayerNorm(h) / (sqrt(F) l)."""
  h = h.reshape(h.shape[0], -1).astype(jnp.float32)
  if options.unit_input:
    centred = h - jnp.mean(h, axis=-1, keepdims=True)
    h = centred / jnp.sqrt(jnp.sum(centred * centred, axis=-1, keepdims=True) + 1e-6)
  return h / options.length_scale


def random_features(g: jax.Array, projection: jax.Array, phase: jax.Array,
                    scaled: bool = True) -> jax.Array:
  """phi = a cos(g W_r + b_r) [B, D], a = sqrt(2/D) if scaled else 1, in float32."""
  phi = jnp.cos(g @ projection + phase)
  return math.sqrt(2.0 / phase.shape[-1]) * phi if scaled else phi


def precision(moment: jax.Array, steps: jax.Array, options: Options, total_steps: int
              ) -> jax.Array:
  """P = ridge I + N x the window's mean phi phi' (ridge I before the window's first step)."""
  counted = jnp.clip(steps - (total_steps - options.cov_steps), 0, options.cov_steps)
  mean = moment / jnp.maximum(counted, 1).astype(moment.dtype)
  return options.ridge * jnp.eye(moment.shape[0], dtype=moment.dtype) + options.data_size * mean


def variance(phi: jax.Array, p: jax.Array) -> jax.Array:
  """phi' P^-1 phi per row of phi [B, D] (a Cholesky solve)."""
  factor = jnp.linalg.cholesky(p)
  z = jax.scipy.linalg.solve_triangular(factor, phi.T, lower=True)
  return jnp.sum(z * z, axis=0)


def adjusted(logits: jax.Array, var: jax.Array, factor: float) -> jax.Array:
  """The mean-field logits: logits / sqrt(1 + factor var)."""
  return logits / jnp.sqrt(1.0 + factor * var)[:, None].astype(logits.dtype)


@custom_batching.custom_vmap
def accumulate(moment: jax.Array, phi: jax.Array, in_window: jax.Array) -> jax.Array:
  """moment + phi'phi / B where in_window, else moment: computed only then (lax.cond), also
  over vmapped members (the rule below: once any member of the batch is in its window;
  every member counts the same steps), so the D x D product costs nothing before it."""
  return jax.lax.cond(in_window, lambda: moment + (phi.T @ phi) / phi.shape[0],
                      lambda: moment)


@accumulate.def_vmap
def _accumulate_vmap(axis_size, in_batched, moment, phi, in_window):
  stacked = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
             for a, batched in zip((moment, phi, in_window), in_batched)]
  moment, phi, in_window = stacked

  def add():
    return moment + jnp.where(in_window[:, None, None],
                              jnp.einsum('mbd,mbe->mde', phi, phi) / phi.shape[1], 0)

  return jax.lax.cond(jnp.any(in_window), add, lambda: moment), True


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def ridged(beta: jax.Array, weight: float) -> jax.Array:
  """beta itself, whose gradient gets weight * beta added: the ridge (weight/2)|beta|^2 of
  the mean loss, applied once per forward pass."""
  del weight
  return beta


def _ridged_fwd(beta, weight):
  del weight
  return beta, beta


def _ridged_bwd(weight, beta, g):
  return (g + weight * beta.astype(g.dtype),)


ridged.defvjp(_ridged_fwd, _ridged_bwd)


def _kernels(model: str, body: Any) -> list[tuple]:
  """Where the hidden kernels sit in the body: the MLP's layers, the CNN's convolutions, a
  ResNet's every convolution (its stem, each block's two and its shortcut's projection)."""
  if model == 'mlp':
    return [(i, 'w') for i in range(len(body))]
  if model in RESNETS:
    return [('stem',)] + [('blocks', i, name) for i, block in enumerate(body['blocks'])
                          for name in ('conv1', 'conv2', 'proj') if name in block]
  return [('convs', i, 'w') for i in range(len(body['convs']))]


def _with_head(model: str, body: Any, width: int) -> Any:
  """The model's params: the body and an output layer of no outputs, [F, 0] (the model's
  features() then gives its last hidden features h, which the GP layer reads)."""
  head = {'w': jnp.zeros((width, 0), jnp.float32), 'b': jnp.zeros((0,), jnp.float32)}
  if model == 'mlp':
    return [*body, head]
  return {**body, 'head': head}


def _without_head(model: str, params: Any) -> tuple[Any, int]:
  """(the body, F: the output layer's input width)."""
  if model == 'mlp':
    return list(params[:-1]), params[-1]['w'].shape[0]
  return {k: v for k, v in params.items() if k != 'head'}, params['head']['w'].shape[0]


def wrap(model: Model, model_name: str, options: Options, total_steps: int) -> Model:
  """`model` (the built-in MLP, CNN or a ResNet) as an SNGP member (the module doc)."""
  if model.features is None:
    raise ValueError('sngp reads the last hidden features (Model.features).')
  start = total_steps - options.cov_steps

  def init(rng, sample_x):
    params, state = model.init(rng, sample_x)
    body, width = _without_head(model_name, params)
    classes = params[-1]['w'].shape[1] if model_name == 'mlp' else params['head']['w'].shape[1]
    d = options.features
    k_w, k_b, k_out = jax.random.split(jax.random.fold_in(rng, _FEATURES_STREAM), 3)
    projection = jax.random.normal(k_w, (width, d), jnp.float32)
    phase = jax.random.uniform(k_b, (d,), jnp.float32, 0.0, 2 * math.pi)
    paths = _kernels(model_name, body)
    keys = jax.random.split(jax.random.fold_in(rng, _VECTORS_STREAM), len(paths))
    vectors = [_normalise(jax.random.normal(k, (leaf_at(body, p).shape[-1],), jnp.float32))
               for k, p in zip(keys, paths)]
    output = jax.random.normal(k_out, (d, classes), jnp.float32) / math.sqrt(d)
    return SNGPParams(body, output), SNGPState(
        state, vectors, projection, phase, jnp.zeros((d, d), jnp.float32),
        jnp.zeros((), jnp.int32))

  def apply(params, state, x, *, train, rng=None):
    body, vectors = params.body, []
    for path, u in zip(_kernels(model_name, body), state.vectors):
      kernel, u = normalised(leaf_at(body, path), u, options.norm_bound)
      body, vectors = with_leaf(body, path, kernel), vectors + [u]
    full = _with_head(model_name, body, state.projection.shape[0])
    _, h, base = model.features(full, state.base, x, train=train, rng=rng)
    phi = random_features(gp_input(h, options), state.projection, state.phase,
                          not options.unit_input)
    if train:
      beta = ridged(params.output, options.ridge / options.data_size)
      logits = phi.astype(beta.dtype) @ beta
      moment = accumulate(state.moment, jax.lax.stop_gradient(phi), state.steps >= start)
      return logits, state._replace(base=base, vectors=vectors, moment=moment,
                                    steps=state.steps + 1)
    logits = phi.astype(params.output.dtype) @ params.output
    if options.mean_field_factor:
      p = precision(state.moment, state.steps, options, total_steps)
      logits = adjusted(logits, variance(phi, p), options.mean_field_factor)
    return logits, state._replace(base=base)

  return Model(init, apply)


def _number(value: Any, field: str, low: float, strict: bool, example: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
      value) or value < low or (strict and value == low):
    raise ConfigError(f'{FIELD}.{field}={value!r} must be a finite number '
                      f'{">" if strict else ">="} {low:g}, e.g. {example}.')
  return float(value)


def options_from(fields: Any, total_steps: int, model: str) -> Options:
  """config.ensemble.sngp checked, each bad field refused in one line naming it; None
  norm_bound 0 from DEFAULTS[model] (config.model.name; the MLP's for a model SNGP refuses)."""
  data_size = fields['data_size']
  if isinstance(data_size, bool) or not isinstance(data_size, int) or data_size < 1:
    raise ConfigError(f"{FIELD}.data_size={data_size!r} must be the training set's size N (an "
                      'int >= 1: the precision is ridge I + N E[phi phi\'], the ridge penalty '
                      'ridge / (2N)), e.g. 4000 for MNIST-1D.')
  cov_steps = int_field(fields['cov_steps'], 'sngp.cov_steps', 1)
  if cov_steps > total_steps:
    raise ConfigError(f'{FIELD}.cov_steps={cov_steps} exceeds train.steps={total_steps}: the '
                      'precision is summed over the last cov_steps steps; lower it (the paper: '
                      'one epoch, N / batch size).')
  network = DEFAULTS.get(model, _PAPERS)
  bound = fields['norm_bound']
  return Options(features=int_field(fields['features'], 'sngp.features', 1),
                 norm_bound=_number(bound, 'norm_bound', 0, False,
                                    f"{network.norm_bound:g}, or 0 for the network's")
                 or network.norm_bound,
                 length_scale=_number(fields['length_scale'], 'length_scale', 0, True, '1.0'),
                 unit_input=network.unit_input,
                 ridge=_number(fields['ridge'], 'ridge', 0, True, '1.0'),
                 mean_field_factor=_number(fields['mean_field_factor'], 'mean_field_factor',
                                           0, False, 'pi / 8 = 0.3927'),
                 cov_steps=cov_steps, data_size=data_size)


def make(spec: MethodSpec) -> Method:
  """SNGP members from config.ensemble.sngp (the module doc)."""
  options = options_from(spec.options, spec.total_steps, spec.model)

  def wrap_model(model: Model, task: Any) -> Model:
    if task.name != 'classification':
      raise ConfigError(f"config.ensemble.method='sngp' is a softmax classifier's (its GP "
                        f"layer's logits and their mean-field adjustment), not config.task="
                        f"{task.name!r}'s; use method='deep'.")
    if spec.model not in MODELS:
      raise ConfigError(f"config.ensemble.method='sngp' spectral-normalises the hidden layers "
                        f"of config.model.name in {list(MODELS)}, not {spec.model!r}; use "
                        "one of them.")
    return wrap(model, spec.model, options, spec.total_steps)

  # The window is the last cov_steps of train.steps: a resumed run keeps train.steps.
  # Its GP layer has its own Laplace posterior: eval.laplace's is refused.
  return Method('sngp', wrap_model=wrap_model, copyable=True, scales_with_steps=True,
                last_layer_laplace=False)
