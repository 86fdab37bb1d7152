"""The sharded eval step over a whole split, OOD evaluation and OOD sources."""

import re

import jax
import ml_collections
import numpy as np
import pytest

from dist_ens import data, models, tasks
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.eval import metrics, registry as metric_registry
from dist_ens.eval import ood, shift
from dist_ens.errors import ConfigError
from dist_ens.eval import evaluate as evaluate_lib
from dist_ens.eval.evaluate import evaluate, evaluate_ood, evaluate_split, make_eval_step
from model_specs import model_spec

M, N, SHAPE, C = 8, 37, (40, 1), 10


def _setup(member=4, data_axis=2):
  model = models.get_model(model_spec(name='mlp', widths=(16,)), num_classes=C)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshSpec(member=member, data=data_axis))
  params = jax.jit(jax.vmap(lambda k: model.init(k, np.zeros((1, *SHAPE), np.float32))[0]),
                   out_shardings=mesh_lib.member_sharding(mesh))(
                       jax.random.split(jax.random.key(0), M))
  return model, mesh, (params, {})  # (params, model_state): what the eval step takes.


def _split(seed, n=N, scale=1.0):
  rng = np.random.default_rng(seed)
  return data.Split((scale * rng.standard_normal((n, *SHAPE))).astype(np.float32),
                    rng.integers(0, C, n).astype(np.int32))


def _logits(model, params, x):
  """Each member on its own, on one device: the reference forward pass."""
  host = jax.tree.map(np.asarray, params[0])
  apply = jax.jit(lambda p, x: model.apply(p, {}, x, train=False)[0])
  return np.stack([np.asarray(apply(jax.tree.map(lambda a, i=i: a[i], host), x))
                   for i in range(M)])


@pytest.fixture(scope='module')
def setup():
  return _setup()


def test_padded_sharded_batches_equal_one_whole_batch(setup):
  model, mesh, params = setup
  split = _split(0)
  member_mask = jax.device_put(np.arange(M) != 5, mesh_lib.member_sharding(mesh))
  step = make_eval_step(model, mesh)
  # 37 examples in batches of 16: 16 + 16 + a last batch of 5 real and 11 padded rows.
  got = evaluate(step, params, split, 16, mesh, member_mask)
  assert step._cache_size() == 1  # Padding keeps one shape: one compile for the split.

  logits = _logits(model, params, split.x)
  whole = jax.jit(metrics.eval_batch)(logits, split.y, np.ones(N, bool), np.arange(M) != 5)
  expected = metric_registry.finalize(whole.sums, jax.tree.map(np.asarray, whole.examples))
  assert got.keys() == expected.keys()
  for group in expected:
    assert got[group].keys() == expected[group].keys()
    for key in expected[group]:
      np.testing.assert_allclose(got[group][key], expected[group][key], rtol=1e-5, atol=1e-6,
                                 err_msg=f'{group}/{key}')
  # Every example counted once: per-member accuracy is a multiple of 1/37.
  correct = np.asarray(got['members']['accuracy']) * N
  np.testing.assert_allclose(correct, np.round(correct), atol=1e-4)


def test_split_examples_drop_padding_in_order(setup):
  model, mesh, params = setup
  split = _split(1, n=21)
  out = evaluate_split(make_eval_step(model, mesh), params, split, 8, mesh,
                       jax.device_put(np.ones(M, bool), mesh_lib.member_sharding(mesh)))
  probs = np.asarray(jax.nn.softmax(_logits(model, params, split.x)))
  assert out.examples.member_confidence.shape == (M, 21)
  np.testing.assert_allclose(out.examples.member_confidence, probs.max(-1), rtol=1e-5)
  np.testing.assert_allclose(out.examples.ensemble_confidence, probs.mean(0).max(-1), rtol=1e-5)
  np.testing.assert_array_equal(out.examples.ensemble_correct,
                                probs.mean(0).argmax(-1) == split.y)
  assert float(out.sums['count']) == 21


def test_evaluate_ood_matches_sklearn(setup):
  sk = pytest.importorskip('sklearn.metrics')
  model, mesh, params = setup
  inside, outside = _split(2), _split(3, n=29, scale=4.0)
  member_mask = jax.device_put(np.ones(M, bool), mesh_lib.member_sharding(mesh))
  got = evaluate_ood(make_eval_step(model, mesh), params, inside, outside, 16, mesh, member_mask)

  def uncertainty(x):
    p = np.asarray(jax.nn.softmax(_logits(model, params, x).astype(np.float64)))
    entropy = lambda q: -np.sum(q * np.log(q), -1)
    return entropy(p.mean(0)), entropy(p.mean(0)) - entropy(p).mean(0), entropy(p)

  (ent_in, mi_in, members_in), (ent_out, mi_out, members_out) = (uncertainty(inside.x),
                                                                 uncertainty(outside.x))
  labels = np.r_[np.zeros(N), np.ones(29)]
  ens = got['ensemble']
  np.testing.assert_allclose(ens['auroc_entropy'], sk.roc_auc_score(labels, np.r_[ent_in, ent_out]),
                             atol=1e-6)
  np.testing.assert_allclose(ens['aupr_mi'],
                             sk.average_precision_score(labels, np.r_[mi_in, mi_out]), atol=1e-6)
  np.testing.assert_allclose(
      got['members']['auroc_entropy'][3],
      sk.roc_auc_score(labels, np.r_[members_in[3], members_out[3]]), atol=1e-6)
  np.testing.assert_allclose(ens['mi_out'], mi_out.mean(), rtol=1e-4)


def test_evaluate_ood_refuses_another_input_shape(setup):
  model, mesh, params = setup
  other = data.Split(np.zeros((4, 8, 8, 1), np.float32), np.zeros(4, np.int32))
  with pytest.raises(ValueError, match='shape'):
    evaluate_ood(make_eval_step(model, mesh), params, _split(0), other, 16, mesh,
                 jax.device_put(np.ones(M, bool), mesh_lib.member_sharding(mesh)))


def test_ood_sources_have_their_datasets_shape_and_differ_from_it():
  for name in ood.OOD_SOURCES:  # 'mnist1d_noise' is derived from mnist1d, and so on.
    base = data.load_dataset(name.rsplit('_', 1)[0])
    split = ood.load_ood_split(name, base)
    assert split.x.shape == base.test.x.shape and split.x.dtype == np.float32
    assert not np.allclose(split.x, base.test.x)
  mnist = data.load_dataset('mnist1d')
  shuffled = ood.load_ood_split('mnist1d_shuffled', mnist)
  # A permutation of each signal: the same values, in another order.
  np.testing.assert_array_equal(np.sort(shuffled.x, axis=1), np.sort(mnist.test.x, axis=1))


def test_ood_split_gets_the_training_preprocessing():
  data_config = data.DataSpec(name='mnist1d', mean=(0.5,), std=(2.0,))
  mnist = data.load_dataset('mnist1d', data_config)
  raw = ood.mnist1d_noise().x
  np.testing.assert_allclose(ood.load_ood_split('mnist1d_noise', mnist, data_config).x,
                             (raw - 0.5) / 2.0, rtol=1e-6)


@pytest.mark.parametrize('name,message', [
    ('no/such', 'not a known dataset'),
    ('mnist1d', 'is the training dataset'),
    ('digits', r'has inputs of shape \(8, 8, 1\)'),
])
def test_bad_ood_dataset_names_the_field(name, message):
  if name == 'digits':
    pytest.importorskip('sklearn')
  with pytest.raises(ConfigError, match=r'config\.eval\.ood_dataset=.*' + message):
    ood.load_ood_split(name, data.load_dataset('mnist1d'))


def test_host_scored_outputs_equal_evaluate(setup):
  model, mesh, params = setup
  split = _split(5)
  member_mask = np.arange(M) != 3
  outputs = evaluate_lib.split_outputs(evaluate_lib.make_outputs_step(model, mesh), params,
                                       split, 16, mesh)
  np.testing.assert_allclose(outputs, _logits(model, params, split.x), rtol=1e-5, atol=1e-5)
  log_probs = np.asarray(jax.nn.log_softmax(outputs))
  # Members padded to 8 and examples to a chunk of 16: masked out, so nothing changes.
  scorer = evaluate_lib.Scorer.of(tasks.get_task('classification'))
  got = scorer.metrics(log_probs, split.y, member_mask, chunk=16)
  expected = evaluate(make_eval_step(model, mesh), params, split, 16, mesh,
                      jax.device_put(member_mask, mesh_lib.member_sharding(mesh)))
  for group in expected:
    for key in expected[group]:
      np.testing.assert_allclose(got[group][key], expected[group][key], rtol=1e-5, atol=1e-6,
                                 err_msg=f'{group}/{key}')
  # A member listed twice weighs twice in the ensemble.
  twice = scorer.metrics(log_probs[[0, 1, 1]], split.y)
  probs = np.exp(log_probs[0]) / 3 + 2 * np.exp(log_probs[1]) / 3
  np.testing.assert_allclose(twice['ensemble']['nll'],
                             -np.log(probs[np.arange(N), split.y]).mean(), rtol=1e-5)


_COLLECTIVES = ('all-reduce', 'all-gather', 'all-to-all', 'collective-permute',
                'reduce-scatter')


def _loop_collectives(hlo: str) -> list[str]:
  """The collective ops inside any while loop's body of compiled HLO text (callees too)."""
  computations, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r'(?:ENTRY )?%?([\w.\-]+) .*\{$', line)
    if head and not line.startswith(' '):
      name = head.group(1)
      computations[name] = []
    elif name is not None:
      computations[name].append(line)
  pending = re.findall(r'body=%?([\w.\-]+)', hlo)
  assert pending, 'expected a while loop in the program'
  seen, found = set(), []
  while pending:
    body = pending.pop()
    if body in seen or body not in computations:
      continue
    seen.add(body)
    for line in computations[body]:
      found += [op for op in _COLLECTIVES if f' {op}(' in line or f' {op}-start(' in line]
      pending += re.findall(r'(?:body|condition|calls|to_apply)=%?([\w.\-]+)', line)
  return found


def test_the_regression_mixtures_loop_holds_no_collective(setup):
  # The eval and predict programs gather every member's outputs before the task's metrics,
  # so the mixture's bisection sums its members on each device. An all-reduce over
  # 'member' inside that loop hung XLA:CPU's collectives at random (one device left the
  # loop while the others waited in it: a slow-tier matrix case, until the 600 s timeout).
  model, mesh, params = setup
  task = tasks.get_task('regression')
  rows = 16
  data_sharding = mesh_lib.batch_sharding(mesh)
  x, y, mask = (jax.device_put(a, data_sharding) for a in (
      _split(0).x[:rows], np.linspace(-1, 1, rows * C // 2, dtype=np.float32).reshape(rows, -1),
      np.ones(rows, bool)))  # The model's C outputs are C / 2 targets' (mean, variance).
  member_mask = jax.device_put(np.ones(M, bool), mesh_lib.member_sharding(mesh))
  eval_step = make_eval_step(model, mesh, task.eval_batch)
  assert _loop_collectives(eval_step.lower(params, x, y, mask, member_mask)
                           .compile().as_text()) == []
  predict_step = shift.make_predict_step(model, mesh, task.eval_batch)
  index, zero = jax.device_put(np.arange(rows, dtype=np.int32), data_sharding), np.int32(0)
  assert _loop_collectives(predict_step.lower(params, x, y, mask, member_mask, index, zero,
                                              zero).compile().as_text()) == []
