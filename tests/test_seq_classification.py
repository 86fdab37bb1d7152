"""Sequence classification on a pretrained encoder: the tiny BERT of tests/data/hf/bert
(config.model.init_from='hf:PATH') trained as 4 members on one device over the shipped
text corpus (tests/data/text, tokenised by the tokenizer.json beside the
checkpoint), each member's classifier drawn from its own key; resume is exact;
Ensemble.load(...).predict gives [M, B, classes]; with ensemble.own='head' the encoder
stays the file's, stored once. The encoder built for training masks padding out of
attention and pools by config.model.pool ('cls' or 'mean'), so padding a sequence
further changes none of its outputs."""

import jax
import numpy as np
import pytest

import runs
from support import one_line_refusal as _refusal

import dist_ens
from dist_ens.config import specs
from dist_ens import data
from dist_ens.run import initial_state
from dist_ens.config.loading import load_config
from dist_ens.io.pretrained import flatten, read_orbax
from dist_ens.models import from_hf, hf
from dist_ens.models.hf import load_leaves
from text_fixtures import BERT, CORPUS, PAD, ROOT, bert_with_tokenizer

CLASSES = 3  # the corpus' three books
LENGTH = 12


# The members on one device: a mesh over 8 built 4x the programs (each leaf's shardings)
# for what no test here reads (test_hf trains from an hf: file on a 4 x 2 mesh).
DEVICES = jax.devices()[:1]


def _text_config(checkpoint, steps=4, **model):
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.mesh.member, config.mesh.data = 4, 1, 1
  config.model.init_from = f'hf:{checkpoint}'
  for key, value in model.items():
    config.model[key] = value
  config.data.name, config.data.text_length = f'text:{CORPUS}', LENGTH
  config.train.steps, config.train.log_every, config.train.eval_every = steps, 2, 0
  config.checkpoint.every = 2
  config.data.batch_size, config.eval.batch_size = 8, 16
  config.writers = ('jsonl',)
  config.eval.joint_tau = 0  # nothing here reads the joint log-loss (tests/test_joint.py does)
  return config


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
  """A mean-pooled BERT classifier run to its end: (checkpoint, workdir, final metrics,
  the members' parameters the run started from)."""
  root = tmp_path_factory.mktemp('seq')
  checkpoint = bert_with_tokenizer(root / 'bert')
  started = []
  init_sharded = initial_state.init_sharded

  def seen(parts):  # The run's own step-0 state, kept: no second build and init to read it.
    state = init_sharded(parts)
    started.append(flatten(jax.device_get(state.params)))
    return state

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(initial_state, 'init_sharded', seen)
    results = dist_ens.train(_text_config(checkpoint, pool='mean'), str(root / 'a'),
                             devices=DEVICES)
  (initial,) = started
  return checkpoint, root / 'a', results, initial


def test_members_start_from_the_file_train_and_predict(straight):
  checkpoint, workdir, results, initial = straight
  config = _text_config(checkpoint, pool='mean')
  for name, value in load_leaves(str(checkpoint)).items():
    if not name.startswith('head/'):  # the encoder starts from the file in every member
      for m in range(4):
        np.testing.assert_array_equal(initial[name][m], value, err_msg=name)
  head = initial['head/w']
  assert head.shape == (4, 32, CLASSES)
  assert all(not np.allclose(head[i], head[j]) for i in range(4) for j in range(i))

  assert results['step'] == 4 and np.isfinite(results['members']['nll']).all()
  # The trained heads as saved, read in numpy (Ensemble.member compiles a program; the
  # own-head test reads its members through it).
  trained = flatten(read_orbax(workdir / 'checkpoints' / '4' / 'model')['params'])['head/w']
  assert trained.shape == head.shape and not np.allclose(trained[0], trained[1])
  assert all(not np.allclose(trained[m], head[m]) for m in range(4))  # every head moved
  a = dist_ens.Ensemble.load(workdir, devices=DEVICES)
  test = data.load_dataset(f'text:{CORPUS}', specs.data_spec(config)).test
  out = a.predict(test.x)
  assert out.member_probs.shape == (4, len(test.x), CLASSES)
  assert out.probs.shape == (len(test.x), CLASSES)
  np.testing.assert_allclose(out.member_probs.sum(-1), 1.0, rtol=1e-5)


def test_members_resume_exactly(straight, tmp_path):
  """Resumed from what a kill after the straight run's step-2 checkpoint leaves, the run
  ends where the straight one ended, bit for bit."""
  checkpoint, workdir, results, _ = straight
  killed = runs.killed_after(workdir, 2, tmp_path / 'b')
  resumed = dist_ens.train(_text_config(checkpoint, pool='mean'), str(killed), devices=DEVICES)
  assert resumed['step'] == 4 and resumed['members'] == results['members']
  # Every array of the step-4 checkpoints, the optimizer's too, as saved (Ensemble.load's
  # members of the straight run: test_members_start_from_the_file_train_and_predict).
  for item in ('model', 'optimizer'):
    a, b = (read_orbax(w / 'checkpoints' / '4' / item) for w in (workdir, tmp_path / 'b'))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, b, a)


def test_own_head_keeps_the_encoder_the_files_and_stored_once(straight, tmp_path):
  checkpoint = straight[0]  # The fixture's copy of the BERT file, read only.
  config = _text_config(checkpoint, steps=2, pool='cls')
  config.ensemble.own = 'head'
  dist_ens.train(config, str(tmp_path / 'run'), devices=DEVICES)
  ens = dist_ens.Ensemble.load(tmp_path / 'run', devices=DEVICES)
  file = load_leaves(str(checkpoint))
  # Stored once: the checkpoint holds each encoder leaf as 'shared' at the file's shape
  # (no member axis), the head's as 'own' with one row per member.
  saved = flatten(read_orbax(tmp_path / 'run' / 'checkpoints' / '2' / 'model')['params'])
  stored = {name.rsplit('/', 1)[0]: (name.rsplit('/', 1)[1], value.shape)
            for name, value in saved.items()}
  assert stored.keys() == file.keys()
  for name, (kind, shape) in stored.items():
    want = ('own', (4, *file[name].shape[:-1], CLASSES)) if name.startswith('head/') else (
        'shared', file[name].shape)
    assert (kind, shape) == want, name
  members = [flatten(ens.member(m)) for m in range(4)]
  for name, value in file.items():
    if not name.startswith('head/'):
      for member in members:
        np.testing.assert_array_equal(member[name], value, err_msg=name)
  assert not np.allclose(members[0]['head/w'], members[1]['head/w'])
  assert not np.allclose(members[0]['head/w'], file['head/w'][:, :CLASSES])


def _padded(ids, length):
  return np.pad(ids, ((0, 0), (0, length - ids.shape[1])), constant_values=PAD)


@pytest.mark.parametrize('pool', ['cls', 'mean'])
def test_padding_changes_no_output_of_the_training_encoder(pool):
  reference = np.load(BERT / 'reference.npz')
  ids = reference['inputs'].copy()
  ids[1, 4:] = PAD  # the second sequence is 4 tokens long
  model = hf.build(str(BERT), dropout=0.0, training=True, pool=pool)
  plain, params = from_hf(str(BERT))
  apply = jax.jit(lambda x: model.apply(params, {}, x, train=False)[0])
  short, long = np.asarray(apply(ids)), np.asarray(apply(_padded(ids, 20)))
  np.testing.assert_allclose(long, short, atol=1e-5)
  if pool == 'cls':
    # Without the mask (from_hf: transformers' call without attention_mask) padding counts
    # (the pool does not enter: checked once). Jitted, and the difference in numpy: eager
    # op-by-op compiles a program per operation.
    unmasked = jax.jit(lambda x: plain.apply(params, {}, x, train=False)[0])
    padded, unpadded = (np.asarray(unmasked(x)) for x in (_padded(ids, 20), ids))
    assert np.abs(padded[1] - unpadded[1]).max() > 1e-3
    # No padding: the training encoder is transformers' class exactly.
    np.testing.assert_allclose(apply(reference['inputs']), reference['logits'], atol=1e-5)


def test_pools_that_do_not_apply_are_refused(tmp_path):
  message = _refusal(lambda: hf.build(str(BERT), training=True, pool='last'))
  assert "config.model.pool='last'" in message and "('cls', 'mean')" in message
  gpt2 = ROOT / 'tests' / 'data' / 'hf' / 'gpt2'
  message = _refusal(lambda: hf.build(str(gpt2), training=True, pool='mean'))
  assert 'GPT2LMHeadModel' in message and 'BertForSequenceClassification' in message
