"""Optimizers from config: the same updates as optax's own, hyperparameters in state."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from dist_ens.core import optim
from dist_ens.errors import ConfigError


def _cfg(**kw):
  base = dict(name='adam', learning_rate=1e-2, weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8,
              momentum=0.9, nesterov=False, grad_clip_norm=0.0, schedule='constant',
              warmup_steps=0)
  base.update(kw)
  return ml_collections.ConfigDict(base)


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
  np.testing.assert_allclose(_run(optim.make_optimizer(cfg, 10)), _run(reference), rtol=1e-6)


def test_schedule_matches_optax_schedule():
  cfg = _cfg(schedule='cosine', warmup_steps=2)
  sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
  np.testing.assert_allclose(_run(optim.make_optimizer(cfg, 10), 6),
                             _run(optax.adam(sched), 6), rtol=1e-5)


def test_learning_rate_is_state_not_constant():
  tx = optim.make_optimizer(_cfg(learning_rate=0.5), 10)
  state = jax.vmap(tx.init)({'w': jnp.zeros((3, 2))})
  np.testing.assert_array_equal(state.hyperparams['learning_rate'], [0.5, 0.5, 0.5])


def test_bad_names():
  with pytest.raises(ConfigError, match=r"config.optim.name='lion'.*\['adam', 'sgd'\]"):
    optim.make_optimizer(_cfg(name='lion'), 10)
  with pytest.raises(ConfigError, match='config.optim.schedule'):
    optim.make_optimizer(_cfg(schedule='step'), 10)
  with pytest.raises(ConfigError, match='warmup_steps'):
    optim.make_optimizer(_cfg(warmup_steps=20), 10)
