"""Optimizers from an OptimSpec: the same updates as optax's own, built from each member's
values."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dist_ens.config import specs
from dist_ens.config.loading import load_config
from dist_ens.core import optim
from dist_ens.errors import ConfigError


def _cfg(**kw):
  base = dict(name='adam', learning_rate=1e-2, weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8,
              momentum=0.9, nesterov=False, grad_clip_norm=0.0, schedule='constant',
              warmup_steps=0, decay_mask='all', decay_boundaries=(), decay_factor=0.1)
  base.update(kw)
  return optim.OptimSpec(**base)


def _run(tx, steps=5):
  params = {'w': jnp.array([1.0, -2.0, 3.0])}
  state = tx.init(params)
  for i in range(steps):
    grads = {'w': jnp.array([0.5, 0.1, -0.3]) * (i + 1)}
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params['w']


@pytest.mark.parametrize('cfg,reference', [
    (_cfg(), optax.adam(1e-2)),
    (_cfg(weight_decay=0.1), optax.adamw(1e-2, weight_decay=0.1)),
    (_cfg(name='sgd', momentum=0.0, weight_decay=0.01),
     optax.chain(optax.add_decayed_weights(0.01), optax.sgd(1e-2))),
    (_cfg(name='sgd', momentum=0.9), optax.sgd(1e-2, momentum=0.9)),
])
def test_matches_optax(cfg, reference):
  np.testing.assert_allclose(_run(optim.make_optimizer(cfg, 10)()), _run(reference), rtol=1e-6)


def test_weight_decay_is_decoupled_from_momentum_and_masked_to_kernels():
  cfg = _cfg(name='sgd', momentum=0.9, weight_decay=0.1, decay_mask='kernels')
  tx = optim.make_optimizer(cfg, 10)()
  params = {'w': jnp.ones((2, 2)), 'b': jnp.ones(2)}
  grads = {'w': jnp.full((2, 2), 0.5), 'b': jnp.full(2, 0.5)}
  state = tx.init(params)
  for _ in range(3):
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  # SGDW by hand: the momentum trace sees only gradients; decay acts on w directly.
  w, b, trace = 1.0, 1.0, 0.0
  for _ in range(3):
    trace = 0.9 * trace + 0.5
    w, b = w - 1e-2 * (trace + 0.1 * w), b - 1e-2 * trace
  np.testing.assert_allclose(params['w'], np.full((2, 2), w), rtol=1e-6)
  np.testing.assert_allclose(params['b'], np.full(2, b), rtol=1e-6)  # Biases: no decay.
  with pytest.raises(optim.SpecError, match=r"^decay_mask='biases'; use one of \['all', "):
    optim.make_optimizer(_cfg(decay_mask='biases'), 10)


def test_schedule_matches_optax_schedule():
  cfg = _cfg(schedule='cosine', warmup_steps=2)
  sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
  np.testing.assert_allclose(_run(optim.make_optimizer(cfg, 10)(), 6),
                             _run(optax.adam(sched), 6), rtol=1e-5)


def test_step_decay_multiplies_at_each_boundary_fraction():
  cfg = _cfg(schedule='step', decay_boundaries=(0.3, 0.6, 0.8), decay_factor=0.2)
  multiplier = optim.schedule(cfg, 200)  # Epochs 60/120/160 of 200, one step an epoch.
  got = [float(multiplier(s)) for s in (0, 59, 60, 119, 120, 159, 160, 199)]
  np.testing.assert_allclose(got, [1, 1, 0.2, 0.2, 0.04, 0.04, 0.008, 0.008], rtol=1e-6)
  # Warm-up ramps to the peak, and the boundaries stay steps of the whole run.
  warm = optim.schedule(_cfg(schedule='step', decay_boundaries=(0.5,), decay_factor=0.1,
                             warmup_steps=4), 20)
  np.testing.assert_allclose([float(warm(s)) for s in (0, 2, 4, 9, 10, 19)],
                             [0, 0.5, 1, 1, 0.1, 0.1], rtol=1e-6)


def test_step_decay_trains_like_optax_sgd_nesterov():
  cfg = _cfg(name='sgd', momentum=0.9, nesterov=True, schedule='step', decay_boundaries=(0.5,),
             decay_factor=0.2, learning_rate=0.1)
  reference = optax.sgd(optax.piecewise_constant_schedule(0.1, {3: 0.2}), momentum=0.9,
                        nesterov=True)
  np.testing.assert_allclose(_run(optim.make_optimizer(cfg, 6)(), 6), _run(reference, 6),
                             rtol=1e-6)


@pytest.mark.parametrize('field,value', [('decay_boundaries', (0.6, 0.3)),
                                         ('decay_boundaries', (0.3, 1.0)),
                                         ('decay_boundaries', (60, 120)),
                                         ('decay_factor', 0.0), ('decay_factor', 2.0)])
def test_step_decay_bad_fields_name_the_field(field, value):
  cfg = _cfg(schedule='step', decay_boundaries=(0.5,), decay_factor=0.2)._replace(
      **{field: value})
  with pytest.raises(optim.SpecError, match=f'^{field}=') as raised:
    optim.make_optimizer(cfg, 10)
  assert raised.value.field == field and raised.value.value == value


def test_each_member_gets_its_own_values_under_vmap():
  optimizer = optim.make_optimizer(_cfg(learning_rate=[0.1, 0.2, 0.3]), 10)
  hp = {'optim.learning_rate': jnp.array([0.1, 0.2, 0.3])}
  params, grads = {'w': jnp.zeros((3, 2))}, {'w': jnp.ones((3, 2))}

  def update(p, g, member_hp):
    tx = optimizer(member_hp)
    return tx.update(g, tx.init(p), p)[0]

  updates = jax.vmap(update)(params, grads, hp)
  # Adam's first step moves every weight by -lr (sign of the gradient times lr).
  np.testing.assert_allclose(updates['w'][:, 0], [-0.1, -0.2, -0.3], rtol=1e-5)
  with pytest.raises(ValueError, match='per-member values'):
    optimizer(None)  # The config holds a list: the member's value must be passed.


def test_bad_names():
  # Core names its spec's fields (a plain ValueError); the edge that read the config says
  # them as config fields, in one line, before anything compiles.
  with pytest.raises(optim.SpecError, match=r"^name='lion'; use one of \['adam', 'sgd'\]"):
    optim.make_optimizer(_cfg(name='lion'), 10)
  with pytest.raises(optim.SpecError, match=r"^schedule='steps'; use one of"):
    optim.make_optimizer(_cfg(schedule='steps'), 10)
  with pytest.raises(optim.SpecError,
                     match=r'^warmup_steps=20; use a number of steps in \[0, 10\]'):
    optim.make_optimizer(_cfg(warmup_steps=20), 10)
  assert issubclass(optim.SpecError, ValueError) and not issubclass(optim.SpecError, ConfigError)
  from dist_ens.run import assemble  # pylint: disable=g-import-not-at-top
  config = load_config(Path(__file__).parents[1] / 'configs' / 'default.py')
  config.num_members, config.optim.name = 2, 'lion'
  with pytest.raises(ConfigError, match=r"^config.optim.name='lion'; use one of \['adam', "
                                        r"'sgd'\], or your own by import path"):
    assemble.build_run(config, shapes=((40,), 10))
  # An import path that does not load: core says its own field, the edge the config's.
  with pytest.raises(optim.SpecError, match=r"^schedule='no_such_pkg.s:decay'; cannot be "
                                            r'imported: ModuleNotFoundError'):
    optim.make_optimizer(_cfg(schedule='no_such_pkg.s:decay'), 10)
  config.optim.name = 'optax:no_such_optimizer'
  with pytest.raises(ConfigError, match=r"^config.optim.name='optax:no_such_optimizer'; cannot "
                                        r"be loaded: module 'optax' has no attribute"):
    assemble.build_run(config, shapes=((40,), 10))


def test_optim_spec_reads_every_field_of_config_optim_and_names_a_missing_one():
  config = load_config(Path(__file__).parents[1] / 'configs' / 'default.py')
  spec = specs.optim_spec(config)
  assert spec == optim.OptimSpec(**{f: config.optim[f] for f in optim.OptimSpec._fields})
  del config.optim['decay_factor']
  with pytest.raises(ConfigError, match=r'^config.optim.decay_factor is missing; start from '
                                        r'configs/default.py'):
    specs.optim_spec(config)
