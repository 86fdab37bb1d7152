"""The per-position task (config.task='token_classification'): next-token prediction with
the causal token_transformer, padding masked exactly, per-token metrics and predict."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dist_ens
from dist_ens import data, tasks
from dist_ens.errors import ConfigError
from dist_ens.eval.evaluate import Scorer
from dist_ens.tasks.token_classification import PAD_ID

VOCAB, LENGTH = 8, 12


def _corpus(n, seed):
  """Next-token pairs from a repeating pattern 0..5 with 10% noise tokens; a third of the
  rows end early, their tail padded (input token 7, target -1)."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, 6, n)
  seq = (start[:, None] + np.arange(LENGTH + 1)[None]) % 6
  noise = rng.random(seq.shape) < 0.1
  seq = np.where(noise, rng.integers(0, VOCAB, seq.shape), seq)
  x, y = seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)
  ends = np.where(np.arange(n) % 3 == 0, rng.integers(4, LENGTH, n), LENGTH)
  pad = np.arange(LENGTH)[None] >= ends[:, None]
  return np.where(pad, 7, x), np.where(pad, PAD_ID, y)


def _dataset():
  return data.from_arrays(*_corpus(256, 0), *_corpus(64, 1), name='pattern',
                          num_classes=VOCAB, pad_id=PAD_ID)


def _config(steps=20):
  """A causal token_transformer of one block (hidden 32) on the pattern, 4 members on a
  4 x 2 mesh: `steps` steps logged every 10, saved every 10. One block, not two: the
  train program compiles in about 25% less CPU time (measured), and every property here
  (causality, padding, per-token metrics, learning, exact resume) is one block's as well;
  20 steps, not 40, learn the pattern past this file's bounds (ensemble NLL 0.74,
  accuracy 0.84, last logged loss 0.58 x the first; measured)."""
  config = dist_ens.load_config(Path(__file__).parent.parent / 'configs' / 'default.py')
  config.task = 'token_classification'
  config.model.name, config.model.causal, config.model.pool = 'token_transformer', True, 'tokens'
  config.model.vocab_size, config.model.hidden, config.model.depth = VOCAB, 32, 1
  config.model.heads, config.model.mlp_dim, config.model.dropout = 4, 64, 0.0
  config.num_members, config.data.batch_size = 4, 32
  config.mesh.member, config.mesh.data = 4, 2
  config.optim.learning_rate = 3e-3
  config.train.steps, config.train.log_every, config.train.eval_every = steps, 10, 0
  config.checkpoint.every, config.writers = 10, ('jsonl',)
  return config


def _logits(seed, shape=(3, 5, LENGTH, VOCAB)):
  # Drawn by numpy: jax.random would compile a threefry program for the shape.
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def test_padding_is_masked_exactly():
  """Changing the outputs at padding positions (and padded rows) changes no metric, no
  loss, no likelihood; the counts are the non-padding tokens."""
  task = tasks.get_task('token_classification')
  _, y = _corpus(5, 2)
  logits = _logits(0)
  pad = jnp.asarray(y == PAD_ID)
  changed = jnp.where(pad[None, ..., None], _logits(1) * 50, logits)
  assert pad.any()
  scorer = Scorer.of(task)
  first, second = (scorer.metrics(np.asarray(o), y) for o in (logits, changed))
  assert first == second
  assert scorer.split_eval(np.asarray(logits), y).sums['count'] == (y != PAD_ID).sum()
  # Loss and gradient in one jitted program (eager, each runs op by op).
  loss_and_grad = jax.jit(jax.value_and_grad(lambda o: task.loss(o[0], jnp.asarray(y), {})))
  loss, grads = loss_and_grad(logits)
  assert float(loss) == float(loss_and_grad(changed)[0])
  assert not np.asarray(grads[0])[np.asarray(pad)].any()
  np.testing.assert_array_equal(task.log_likelihood(np.asarray(logits), y),
                                task.log_likelihood(np.asarray(changed), y))
  # A padded row of the batch (mask False) counts for nothing either.
  rows = jnp.array([True, True, True, True, False])
  eval_batch = jax.jit(task.eval_batch)
  kept = eval_batch(logits, jnp.asarray(y), rows).sums
  wild = eval_batch(logits.at[:, 4].set(jnp.nan), jnp.asarray(y).at[4].set(99), rows).sums
  for k in kept:
    np.testing.assert_array_equal(kept[k], wild[k], err_msg=k)


def test_per_token_metrics_equal_classification_over_the_tokens():
  task, plain = tasks.get_task('token_classification'), tasks.get_task('classification')
  _, y = _corpus(5, 3)
  logits = np.asarray(_logits(2))
  keep = y != PAD_ID
  flat = logits.reshape(3, -1, VOCAB)[:, keep.reshape(-1)]
  got = Scorer.of(task).metrics(logits, y)
  want = Scorer.of(plain).metrics(flat, y[keep])
  for scope in ('members', 'ensemble'):
    for name, value in want[scope].items():
      np.testing.assert_allclose(got[scope][name], value, rtol=1e-5, atol=1e-6,
                                 err_msg=f'{scope} {name}')
  ll = task.log_likelihood(logits, y)
  per_token = plain.log_likelihood(flat, y[keep])
  np.testing.assert_allclose(ll.sum(axis=1), per_token.sum(axis=1), rtol=1e-10)


def test_targets_and_outputs_are_checked_in_one_line():
  task = tasks.get_task('token_classification')
  dataset = _dataset()
  with pytest.raises(ConfigError, match=r'integer targets \[N, T\]'):
    task.check_targets(np.zeros(4, np.int32), dataset, 'here')
  with pytest.raises(ConfigError, match='not the padding id -1'):
    task.check_targets(np.full((2, 3), -2), dataset, 'here')
  config = _config()
  config.model.pool = 'last'  # one output per sequence: the task needs one per position
  with pytest.raises(ConfigError, match=r"pool.*\(2, 12, 8\)|\(2, 12, 8\)"):
    dist_ens.train(config, '/tmp/unused_token_workdir', dataset=dataset)


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
  """A next-token run to its end: (workdir, final metrics)."""
  workdir = tmp_path_factory.mktemp('token') / 'a'
  return workdir, dist_ens.train(_config(), str(workdir), dataset=_dataset())


def test_next_token_prediction_trains_and_predicts(straight):
  workdir, straight = straight
  dataset = _dataset()
  for scope in ('members', 'ensemble'):
    for name in ('nll', 'accuracy', 'ece'):
      assert name in straight[scope], (scope, name)
  assert 'mutual_information' in straight['ensemble']
  assert len(straight['members']['nll']) == 4
  # Uniform over 8 tokens is log 8 = 2.08 nats; the pattern is learnt well beyond it.
  assert straight['ensemble']['nll'] < 1.2 and straight['ensemble']['accuracy'] > 0.6
  events = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  losses = [np.mean(e['members']['loss']) for e in events if 'loss' in e.get('members', {})]
  assert len(losses) >= 2 and losses[-1] < 0.7 * losses[0], losses
  ens = dist_ens.Ensemble.load(str(workdir))
  x, y = dataset.test.x, dataset.test.y
  out = ens.predict(x[:13])
  assert out.probs.shape == (13, LENGTH, VOCAB) and out.member_probs.shape == (4, 13, LENGTH,
                                                                                VOCAB)
  assert out.mutual_information.shape == (13, LENGTH) and out.entropy.shape == (13, LENGTH)
  np.testing.assert_allclose(out.probs.sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(out.probs, out.member_probs.mean(0), rtol=1e-5, atol=1e-6)
  assert (out.mutual_information > -1e-5).all()
  # The causal model: what comes after a position does not change its prediction.
  later = x[:13].copy()
  later[:, 6:] = 0
  np.testing.assert_allclose(ens.predict(later).probs[:, :6], out.probs[:, :6], rtol=1e-5,
                             atol=1e-6)
  keep = y[:13] != PAD_ID
  assert (out.probs.argmax(-1)[keep] == y[:13][keep]).mean() > 0.6


def test_next_token_prediction_resumes_exactly(straight, tmp_path):
  """Killed after step 10's checkpoint and rerun, it ends where the straight run ends."""
  from test_methods import _Stop  # pylint: disable=import-outside-toplevel
  _, straight = straight
  dataset = _dataset()
  with pytest.raises(RuntimeError, match='injected fault'):
    dist_ens.train(_config(), str(tmp_path / 'b'), dataset=dataset, actions=[_Stop(10)])
  resumed = dist_ens.train(_config(), str(tmp_path / 'b'), dataset=dataset)
  assert resumed['members'] == straight['members']
  assert resumed['ensemble'] == straight['ensemble']


def test_post_hoc_steps_run_per_token_and_mimo_is_refused(tmp_path):
  """Greedy selection sums each sequence's token likelihoods; temperature scaling fits
  on the validation split's tokens; no conformal sets (Task.conformal=False); MIMO, whose
  heads split [B, units] outputs, is refused in one line naming both fields."""
  config = _config(steps=4)
  config.data.validation_size, config.eval.temperature_scaling = 32, True
  config.select.method, config.select.top_k = 'greedy', 2
  out = dist_ens.train(config, str(tmp_path / 'posthoc'), dataset=_dataset())
  assert 'greedy' in out and 'conformal' not in out
  assert len(out['temperature_scaling']['member_temperatures']) == 4
  config = _config(steps=4)
  config.ensemble.method = 'mimo'
  with pytest.raises(ConfigError, match=r"ensemble.method='mimo'.*config.task="
                                        r"'token_classification'"):
    dist_ens.train(config, str(tmp_path / 'mimo'), dataset=_dataset())
