"""Users' code that tests name by import path (config.data.name, optim.name, train.loss)."""

import numpy as np
import optax

from dist_ens import data
from dist_ens.tasks.classification import cross_entropy


def blobs(data_config=None):
  """Two Gaussian blobs in 6 dimensions: (x_train, y_train, x_test, y_test)."""
  del data_config
  rng = np.random.default_rng(0)
  y = rng.integers(0, 2, 600)
  x = rng.standard_normal((600, 6)).astype(np.float32) + 1.5 * y[:, None]
  return x[:500], y[:500], x[500:], y[500:]


def bad_labels():
  x_train, y_train, x_test, y_test = blobs()
  return data.Dataset('bad', data.Split(x_train, y_train.astype(np.int32) + 1),
                      data.Split(x_test, y_test.astype(np.int32)), 2, (6,))


def plain_sgd(values):
  return optax.sgd(values['learning_rate'])


def doubled_cross_entropy(logits, labels, hparams):
  return 2.0 * cross_entropy(logits, labels, hparams.get('train.label_smoothing', 0.0))


def margin_task():
  """A user's task: classification with a spare output unit, a logged logit margin and
  an error rate in the final metrics (tests/test_extensions.py)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from dist_ens import tasks  # pylint: disable=g-import-not-at-top
  base = tasks.classification()

  def batch_metrics(logits, labels):
    top2 = jnp.sort(logits, axis=-1)[..., -2:]
    return {**base.batch_metrics(logits, labels), 'margin': jnp.mean(top2[..., 1] - top2[..., 0])}

  def finalize(sums, examples):
    out = base.finalize(sums, examples)
    out['ensemble']['error'] = 1.0 - out['ensemble']['accuracy']
    return out

  return base._replace(name='margin', output_units=lambda dataset: dataset.num_classes + 1,
                       batch_metrics=batch_metrics, finalize=finalize,
                       select_metrics={'nll': False})


def standardising_task_without_reframe():
  """A user's regression task that standardises (unscale) but cannot move its outputs
  between standardisations (no reframe): member splits refuse it
  (tests/test_member_split.py)."""
  from dist_ens import tasks  # pylint: disable=g-import-not-at-top
  return tasks.regression()._replace(name='own_regression', reframe=None)


def confident_share(run):
  """A user's evaluator (docs/how-it-works.md, "An evaluator of your own"): after the last
  step, the share of test examples the members' mean probability puts at >= 0.9 on one
  class, under 'confident' in the results and as a 'test_confident' event."""
  import jax  # pylint: disable=g-import-not-at-top
  from dist_ens.training.loop import PeriodicAction  # pylint: disable=g-import-not-at-top

  class ConfidentShare(PeriodicAction):

    def __init__(self):
      super().__init__(0, at_end=True)  # after the last step only

    def run(self, call):
      session = call.session
      test = session.run_data.dataset.test
      logits = run.predictions.predict(call, test).outputs  # [M, N, C], predicted once
      probs = np.asarray(jax.nn.softmax(logits, axis=-1)).mean(axis=0)
      share = float(np.mean(probs.max(axis=-1) >= 0.9))
      session.results['confident'] = share
      if session.writes_final_events:
        session.write({'step': call.step, 'split': 'test_confident', 'ensemble': {'share': share}})

  return [ConfidentShare()] if run.task.name == 'classification' else []


def annotated_linen_mlp(num_classes=10):
  """A Flax linen MLP whose hidden kernel carries its own partition annotation: split
  over 'model' on its INPUT dimension, where FSDP would pick the output one."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  class Annotated(nn.Module):

    @nn.compact
    def __call__(self, x, train=False):
      x = x.reshape(x.shape[0], -1)
      x = nn.relu(nn.Dense(64, kernel_init=nn.with_partitioning(
          nn.initializers.lecun_normal(), ('model', None)))(x))
      x = nn.relu(nn.Dense(96)(x))
      return nn.Dense(num_classes)(x)

  return Annotated()


def thirteen_logits(num_classes=10):
  """A plain model whose head gives 13 logits whatever the data set's classes."""
  from examples.plain_jax import make_model  # pylint: disable=g-import-not-at-top
  del num_classes
  return make_model(num_classes=13, widths=(8,))


def one_row_model(num_classes=10):
  """A plain model that averages its batch away: one row of logits per batch."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import dist_ens  # pylint: disable=g-import-not-at-top
  from examples.plain_jax import make_model  # pylint: disable=g-import-not-at-top
  inner = make_model(num_classes=num_classes, widths=(8,))

  def apply(params, state, x, *, train, rng=None):
    logits, state = inner.apply(params, state, x, train=train, rng=rng)
    return jnp.mean(logits, axis=0, keepdims=True), state

  return dist_ens.Model(inner.init, apply)
