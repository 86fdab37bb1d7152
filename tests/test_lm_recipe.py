"""The language-model recipe's pieces (benchmarks/lm_recipe.py, lm_checkpoint.py;
docs/pretrained.md), without training: its arms train equal compute; a checkpoint it
writes from params loads back as those params (GPT-2's packed c_attn included); the
OOD text goes through the checkpoint's tokenizer whole and losslessly; its per-token
means of Ensemble.predict's output are the trainer's per-token metrics; and a tied
GPT-2, which own='lora' refuses, untied gives the same outputs and a head to own."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import lm_checkpoint, lm_recipe
from dist_ens import data, tasks
from dist_ens.data import DataSpec
from dist_ens.ensembles.own import owned_names
from dist_ens.errors import ConfigError
from dist_ens.eval import metrics
from dist_ens.io.pretrained import flatten
from dist_ens.models import from_hf
from dist_ens.inference.prediction import Prediction


def _texts(folder, split):
  return [json.loads(line)['text'] for line in (folder / f'{split}.jsonl').read_text().splitlines()]


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """A GPT-2 of 32 wide, 1 block, with the recipe's tokenizer of the corpus's train split."""
  tokenizer = lm_checkpoint.train_tokenizer(_texts(lm_recipe.CORPUS, 'train'), 384)
  config = {**lm_checkpoint.gpt2_config('tiny', tokenizer), 'n_embd': 32, 'n_layer': 1,
            'n_head': 2}
  folder = tmp_path_factory.mktemp('gpt2')
  return lm_checkpoint.write_checkpoint(folder, config, tokenizer), tokenizer


@pytest.mark.parametrize('members,steps', [(4, 60), (8, 7)])
def test_the_arms_train_equal_member_steps_of_equal_batches(members, steps):
  chosen = lm_recipe.arms(members, steps, full_lr=3e-4, lora_lr=3e-3, rank=8)
  configs = {arm: lm_recipe.run_config(lm_recipe.ROOT / 'nowhere', overrides, 8, 64)
             for arm, overrides in chosen.items()}
  budgets = {arm: c.num_members * c.train.steps * c.data.batch_size for arm, c in configs.items()}
  assert set(budgets.values()) == {members * steps * 8}, budgets
  assert configs['lora_single'].num_members == 1
  assert configs['lora_ensemble'].num_members == configs['full_ensemble'].num_members == members
  assert [configs[a].ensemble.own for a in chosen] == ['lora', 'lora', 'all']
  # One data order per member, and every member starts from the checkpoint's output layer.
  for config in configs.values():
    assert config.data.member_order == 'shuffled' and config.model.init_owned_from_file


def test_a_checkpoint_written_from_params_loads_back_exactly(checkpoint, tmp_path):
  folder, tokenizer = checkpoint
  _, params = from_hf(str(folder))
  rng = np.random.default_rng(0)  # every element its own value: a misplaced one shows
  changed = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), params)
  config = json.loads((folder / 'config.json').read_text())
  again = lm_checkpoint.write_checkpoint(tmp_path / 'again', config, tokenizer, changed)
  _, loaded = from_hf(str(again))
  jax.tree.map(np.testing.assert_array_equal, loaded, changed)
  # GPT-2's file packs q, k and v into one c_attn [D, 3D] (Conv1D: [in, out]).
  attn = changed['blocks'][0]['attn']
  packed = lm_checkpoint.file_tensors(again, changed)['transformer.h.0.attn.c_attn.weight']
  np.testing.assert_array_equal(packed, np.concatenate([attn[k]['w'] for k in 'qkv'], axis=1))
  assert set(flatten(loaded)) == set(flatten(changed))


def test_the_ood_text_goes_through_the_checkpoints_tokenizer_whole(checkpoint):
  folder, tokenizer = checkpoint
  length = lm_recipe.parse_args([]).length
  spec = lambda name: DataSpec(name=name, checkpoint=f'hf:{folder}', text_length=length,
                               text_targets='next_token')
  inside = data.load_dataset(f'text:{lm_recipe.CORPUS}', spec(f'text:{lm_recipe.CORPUS}'))
  outside = data.load_dataset(f'text:{lm_recipe.OOD}', spec(f'text:{lm_recipe.OOD}'))
  assert outside.input_shape == inside.input_shape == (length,)
  assert outside.num_classes == inside.num_classes == tokenizer.get_vocab_size()
  for dataset, folder_ in ((inside, lm_recipe.CORPUS), (outside, lm_recipe.OOD)):
    for split in ('train', 'test'):
      x, y = getattr(dataset, split)
      for ids, targets, text in zip(x, y, _texts(folder_, split), strict=True):
        n = int((targets != lm_recipe.PAD).sum()) + 1  # cut at `length`: n = length + 1
        assert n <= length and tokenizer.decode(ids[:n].tolist()) == text


def test_the_token_means_are_the_trainers_per_token_metrics():
  rng = np.random.default_rng(1)
  logits = 3 * rng.standard_normal((3, 4, 6, 7)).astype(np.float32)  # [M, N, T, C]
  targets = rng.integers(0, 7, (4, 6)).astype(np.int32)
  targets[0, 3:], targets[2, 1:] = lm_recipe.PAD, lm_recipe.PAD
  task = tasks.get_task('token_classification')
  # Jitted, as the trainer runs them: eager, each runs op by op (slower on a CPU).
  out = jax.jit(task.eval_batch)(jnp.asarray(logits), jnp.asarray(targets), jnp.ones(4, bool))
  trainer = task.finalize(jax.device_get(out.sums), jax.device_get(out.examples))['ensemble']
  u = jax.device_get(jax.jit(metrics.member_uncertainty)(logits))
  member_probs = np.asarray(jax.nn.softmax(logits, axis=-1))
  junk = np.where(targets == lm_recipe.PAD, 1e9, 0.0)  # predict's padding positions
  prediction = Prediction(member_probs.mean(0), member_probs, u['entropy'] + junk,
                          u['mutual_information'] + junk)
  means = lm_recipe.token_means(prediction, targets)
  assert means['tokens'] == int((targets != lm_recipe.PAD).sum())
  for key in ('nll', 'entropy', 'mutual_information'):
    np.testing.assert_allclose(means[key], trainer[key], rtol=1e-5, err_msg=key)
  assert means['mutual_information'] > 0


def test_untie_gives_a_released_gpt2s_outputs_and_a_head_for_lora_to_own(tmp_path):
  tied = lm_recipe.ROOT / 'tests' / 'data' / 'hf' / 'gpt2'  # tie_word_embeddings, vocab 96
  model, params = from_hf(str(tied))
  with pytest.raises(ConfigError, match="found no output head"):
    owned_names('head', params, 96)
  assert owned_names('lora', params, 96) == frozenset()  # its LoRA factors alone
  untied = lm_checkpoint.untie(f'hf:{tied}', tmp_path / 'untied')
  model2, params2 = from_hf(str(untied))
  assert owned_names('lora', params2, 96) == {'lm_head/w'}
  ids = np.arange(2 * 12).reshape(2, 12) % 96
  # Jitted: eager, each GPT-2 runs op by op.
  logits = lambda m, p: jax.jit(lambda x: m.apply(p, {}, x, train=False)[0])(ids)
  np.testing.assert_allclose(logits(model2, params2), logits(model, params), atol=1e-5)
  assert (untied / 'reference.npz').exists()  # the source's other files come along
