"""config.data.name='text:PATH' (dist_ens.data.text): token ids from .jsonl or .npz give
the same arrays and batches, cut and padded as written out by hand here; raw text goes
through the tokenizer.json beside the checkpoint (its own padding off); next-token
targets are the following ids with -1 past the end, so a padded position's input token
changes neither the token_classification loss nor its metrics, and GPT-2 trains on them
from the config; bad input is refused in one line naming the file or field."""

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np

import dist_ens
from dist_ens.config import specs
from dist_ens import data, tasks
from dist_ens.config.loading import load_config
from dist_ens.data import DataSpec
from dist_ens.models import from_hf
from support import one_line_refusal as _one_line
from text_fixtures import (BERT, CLS, CORPUS, PAD, ROOT, SEP, bert_with_tokenizer,
                           make_tokenizer, write_jsonl, write_npz)

GPT2 = ROOT / 'tests' / 'data' / 'hf' / 'gpt2'  # vocab 96
SEQUENCES = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20],
             [21, 22], [23, 24, 25, 26], [27, 28, 29, 30, 31, 32, 33, 34, 35], [36, 37]]
LABELS = [0, 1, 2, 0, 1, 2, 0, 1]


def _spec(folder, **fields):
  return DataSpec(name=f'text:{folder}', **fields)


def _folders(tmp_path, labels=LABELS):
  """The same two splits as .jsonl and as .npz."""
  jsonl, npz = tmp_path / 'jsonl', tmp_path / 'npz'
  for folder in (jsonl, npz):
    folder.mkdir(parents=True)
  for split, rows in (('train', slice(0, 6)), ('test', slice(6, 8))):
    split_labels = None if labels is None else labels[rows]
    write_jsonl(jsonl / f'{split}.jsonl', SEQUENCES[rows], split_labels)
    write_npz(npz / f'{split}.npz', SEQUENCES[rows], split_labels)
  return jsonl, npz


def test_jsonl_and_npz_give_the_same_padded_arrays_and_batches(tmp_path):
  jsonl, npz = _folders(tmp_path)
  a = data.load_dataset(f'text:{jsonl}', _spec(jsonl, text_length=5, pad_id=1))
  b = data.load_dataset(f'text:{npz}', _spec(npz, text_length=5, pad_id=1))
  expected = np.array([[5, 6, 7, 1, 1], [8, 9, 10, 11, 12], [15, 1, 1, 1, 1],
                       [16, 17, 18, 19, 20], [21, 22, 1, 1, 1], [23, 24, 25, 26, 1]])
  np.testing.assert_array_equal(a.train.x, expected)
  assert a.train.x.dtype == np.int32 and a.input_shape == (5,) and a.num_classes == 3
  np.testing.assert_array_equal(a.train.y, [0, 1, 2, 0, 1, 2])
  np.testing.assert_array_equal(a.test.x, [[27, 28, 29, 30, 31], [36, 37, 1, 1, 1]])
  for split in ('train', 'test'):
    np.testing.assert_array_equal(getattr(a, split).x, getattr(b, split).x)
    np.testing.assert_array_equal(getattr(a, split).y, getattr(b, split).y)
  batches = [data.BatchIterator(d.train, 4, seed=3) for d in (a, b)]
  for _ in range(3):
    (xa, ya), (xb, yb) = next(batches[0]), next(batches[1])
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)
  # text_length=0: the longest training sequence (7 ids); the test split is cut to it.
  longest = data.load_dataset(f'text:{jsonl}', _spec(jsonl, pad_id=0))
  assert longest.input_shape == (7,)
  np.testing.assert_array_equal(longest.test.x[0], [27, 28, 29, 30, 31, 32, 33])


def test_next_token_targets_are_the_following_ids(tmp_path):
  jsonl, npz = _folders(tmp_path, labels=None)
  spec = dict(text_length=4, pad_id=0, text_targets='next_token')
  a = data.load_dataset(f'text:{jsonl}', _spec(jsonl, **spec))
  b = data.load_dataset(f'text:{npz}', _spec(npz, **spec))
  np.testing.assert_array_equal(a.train.x[:3], [[5, 6, 7, 0], [8, 9, 10, 11], [15, 0, 0, 0]])
  np.testing.assert_array_equal(a.train.y[:3], [[6, 7, -1, -1], [9, 10, 11, 12],
                                                [-1, -1, -1, -1]])
  np.testing.assert_array_equal(a.train.y, b.train.y)
  assert a.num_classes == 38  # no checkpoint, no tokenizer: the largest id + 1


def test_raw_text_through_the_tokenizer_beside_the_checkpoint(tmp_path):
  checkpoint = bert_with_tokenizer(tmp_path / 'bert')
  spec = _spec(CORPUS, text_length=10, checkpoint=f'hf:{checkpoint}')
  dataset = data.load_dataset(f'text:{CORPUS}', spec)
  tokenizer = make_tokenizer()
  tokenizer.no_padding()
  lines = [json.loads(line) for line in (CORPUS / 'train.jsonl').read_text().splitlines()]
  assert dataset.train.x.shape == (len(lines), 10) and dataset.num_classes == 3
  for row, line in zip(dataset.train.x, lines):
    ids = tokenizer.encode(line['text']).ids[:10]
    np.testing.assert_array_equal(row, ids + [PAD] * (10 - len(ids)))
  np.testing.assert_array_equal(dataset.train.y, [line['label'] for line in lines])
  # 'Call me Ishmael.': [CLS] call me ishmael . [SEP], then the checkpoint's pad_token_id
  # (the tokenizer's own padding, to the longest of a batch, is off).
  short = [i for i, line in enumerate(lines) if line['text'] == 'Call me Ishmael.'][0]
  assert list(dataset.train.x[short]) == [CLS, *dataset.train.x[short, 1:5], SEP] + [PAD] * 4
  assert PAD not in dataset.train.x[short, :6]


@functools.cache
def _causal_loss_and_sums():
  """GPT-2's token_classification loss and eval sums of (x, y), jitted: one compile for
  the test's three calls (eager, each runs GPT-2 op by op)."""
  model, params = from_hf(str(GPT2))
  task = tasks.get_task('token_classification')

  def loss_and_sums(x, y):
    logits, _ = model.apply(params, {}, x, train=False)
    out = task.eval_batch(logits[None], y, jnp.ones(len(y), bool))
    return task.loss(logits, y, {}), out.sums

  return jax.jit(loss_and_sums)


def _causal_loss_and_metrics(dataset):
  loss, sums = _causal_loss_and_sums()(dataset.train.x, dataset.train.y)
  return float(loss), jax.tree.map(np.asarray, sums)


def test_a_padded_positions_token_changes_no_loss_or_metric(tmp_path):
  jsonl, _ = _folders(tmp_path, labels=None)
  spec = _spec(jsonl, text_length=6, pad_id=0, text_targets='next_token')
  dataset = data.load_dataset(f'text:{jsonl}', spec)
  assert (dataset.train.x == 0).any()
  loss, sums = _causal_loss_and_metrics(dataset)
  edited = dataset.train.x.copy()
  edited[dataset.train.x == 0] = 50  # every padded position another token
  same = dataset._replace(train=dataset.train._replace(x=edited))
  loss2, sums2 = _causal_loss_and_metrics(same)
  assert loss2 == loss
  jax.tree.map(np.testing.assert_array_equal, sums2, sums)
  edited[0, 0] = 50  # a real token: the check can fail
  changed = dataset._replace(train=dataset.train._replace(x=edited))
  assert _causal_loss_and_metrics(changed)[0] != loss


def test_bad_input_is_refused_in_one_line(tmp_path):
  jsonl, npz = _folders(tmp_path)
  load = lambda folder, **f: data.load_dataset(f'text:{folder}', _spec(folder, **f))
  assert "'label'" in _one_line(lambda: load(_folders(tmp_path / 'n', labels=None)[0]))
  assert 'config.data.text_targets' in _one_line(lambda: load(jsonl, text_targets='labels'))
  assert 'config.data.text_length' in _one_line(lambda: load(jsonl, text_length=-2))
  shutil.copy(npz / 'train.npz', jsonl / 'train.npz')
  assert 'holds both train.jsonl or train.npz' in _one_line(lambda: load(jsonl))
  (npz / 'test.npz').unlink()
  assert 'has neither test.jsonl or test.npz' in _one_line(lambda: load(npz))
  bad = tmp_path / 'bad'
  bad.mkdir()
  (bad / 'train.jsonl').write_text('{"input_ids": [1, 2], "label": 0}\n{"label": 1}\n')
  (bad / 'test.jsonl').write_text('{"text": "no tokenizer here", "label": 0}\n')
  assert 'train.jsonl, line 2' in _one_line(lambda: load(bad))
  (bad / 'train.jsonl').write_text('{"input_ids": [1, 2], "label": 0}\n')
  message = _one_line(lambda: load(bad))
  assert "'text' lines" in message and 'config.data.tokenizer' in message
  # Ids the checkpoint's embedding does not have.
  (bad / 'train.jsonl').write_text('{"input_ids": [1, 200], "label": 0}\n')
  (bad / 'test.jsonl').write_text('{"input_ids": [1], "label": 0}\n')
  message = _one_line(lambda: load(bad, checkpoint=f'hf:{BERT}'))
  assert 'token id 200' in message and 'vocab_size 96' in message
  assert 'is not a folder' in _one_line(lambda: load(tmp_path / 'nothing'))



def _decoder_config(tmp_path):
  """Two members of the GPT-2 fixture (its output layer tied to the token embedding) on
  next tokens of the raw-text corpus, through a tokenizer saved beside the checkpoint."""
  checkpoint = tmp_path / 'gpt2'
  shutil.copytree(GPT2, checkpoint)
  make_tokenizer().save(str(checkpoint / 'tokenizer.json'))
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.mesh.member, config.mesh.data = 2, 2, 1
  config.task, config.model.init_from = 'token_classification', f'hf:{checkpoint}'
  config.data.name, config.data.text_length = f'text:{CORPUS}', 10
  config.data.text_targets = 'next_token'
  config.train.steps, config.train.log_every, config.train.eval_every = 2, 1, 0
  config.checkpoint.every, config.eval.joint_tau = 2, 0
  config.data.batch_size, config.eval.batch_size, config.writers = 4, 8, ('jsonl',)
  return config


def test_a_decoder_trains_on_next_tokens_of_raw_text(tmp_path):
  # Through the config: the tokenizer beside the checkpoint, the classes its vocab_size.
  config = _decoder_config(tmp_path)
  results = dist_ens.train(config, str(tmp_path / 'run'), devices=jax.devices()[:2])
  assert results['step'] == 2 and np.isfinite(results['members']['nll']).all()


def test_lora_members_of_a_tied_decoder_own_their_factors_alone(tmp_path):
  """GPT-2's output layer is its token embedding: with own='lora' no head is the
  members' own; the embedding is shared (stored once, the file's) and each member owns
  its LoRA factors of the attention kernels alone."""
  config = _decoder_config(tmp_path)
  config.ensemble.own, config.ensemble.lora_rank, config.ensemble.lora_targets = 'lora', 2, 'attn'
  results = dist_ens.train(config, str(tmp_path / 'run'), devices=jax.devices()[:2])
  # Trained through the config on raw text's next tokens, as the decoder test's run.
  assert results['step'] == 2 and np.isfinite(results['members']['nll']).all()
  ens = dist_ens.Ensemble.load(tmp_path / 'run', devices=jax.devices()[:2])  # as trained
  stored = jax.device_get(ens._stored)  # pylint: disable=protected-access
  _, file = from_hf(str(tmp_path / 'gpt2'))
  np.testing.assert_array_equal(stored['tokens']['shared'], file['tokens'])
  factors = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(stored)[0]
             if 'lora_b' in jax.tree_util.keystr(path)]
  assert factors and all(f.shape[0] == 2 for f in factors)  # every member's own
  assert any(not np.allclose(f[0], f[1]) for f in factors)
  ids = data.load_dataset(config.data.name, specs.data_spec(config)).test.x[:3]
  out = ens.predict(ids)
  assert np.isfinite(out.member_probs).all() and not np.allclose(out.member_probs[0],
                                                                 out.member_probs[1])
