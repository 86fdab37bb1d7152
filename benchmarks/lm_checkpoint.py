"""A GPT-2 checkpoint folder as Hugging Face's `save_pretrained` lays it out, made here:
the starting point of benchmarks/lm_recipe.py, on machines with no pretrained language
model and no network to fetch one.

  tokenizer = train_tokenizer(texts, vocab_size=384)        # byte-level BPE
  folder = random_checkpoint(dir, gpt2_config('tiny', tokenizer), tokenizer)
  ...                                                         # dist_ens trains from 'hf:' + folder
  checkpoint_from_workdir(workdir, folder, pretrained_dir)    # its member 0, as a checkpoint
  untie('hf:/ckpt/gpt2', untied_dir)     # a released GPT-2 (tied), for own='lora'

A folder holds config.json (GPT2LMHeadModel), tokenizer.json and model.safetensors, so
`config.model.init_from='hf:FOLDER'` and the text source (its tokenizer.json beside the
checkpoint) read it as they read a real GPT-2. The weights are written through the same
table dist_ens loads them with (dist_ens.models.hf): each params leaf goes back to the
elements of the file tensor its conversion took it from, so writing then loading gives
the params back exactly.
"""

import json
import math
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dist_ens import Ensemble
from dist_ens.io.peft_adapters import write_safetensors
from dist_ens.io.pretrained import flatten
from dist_ens.models import from_hf, hf
from dist_ens.models.hf.checkpoint import locate

END_OF_TEXT = '<|endoftext|>'  # id 0: GPT-2's bos, eos and (here) padding token
# name -> (n_embd, n_layer, n_head, n_positions, vocab_size; None: the tokenizer's).
SIZES: dict[str, tuple[int, int, int, int, int | None]] = {
    'tiny': (128, 4, 4, 128, None),  # 0.9M parameters with a 384-token vocabulary
    # GPT-2 small's shape and vocabulary (124M with tied embeddings; 163M here, the
    # output layer untied so that each LoRA member owns one). Ids past the tokenizer's
    # are never inputs; the output layer learns to give them no mass.
    'gpt2': (768, 12, 12, 1024, 50257),
}


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
  """A byte-level BPE tokenizer (GPT-2's kind: every byte has an id, so any text encodes
  without unknown tokens) with END_OF_TEXT as id 0 and merges learnt from `texts`."""
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator(texts, trainer)
  return tokenizer


def gpt2_config(size: str, tokenizer: Tokenizer) -> dict[str, Any]:
  """config.json of a GPT2LMHeadModel of SIZES[size], untied output layer, dropout as
  GPT-2's (dist_ens reads config.model.dropout instead)."""
  hidden, depth, heads, positions, vocab = SIZES[size]
  vocab = vocab or tokenizer.get_vocab_size()
  if vocab < tokenizer.get_vocab_size():
    raise ValueError(f'size {size!r} has vocab_size {vocab}, fewer than the tokenizer\'s '
                     f'{tokenizer.get_vocab_size()} ids.')
  return {'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2',
          'activation_function': 'gelu_new', 'n_embd': hidden, 'n_layer': depth,
          'n_head': heads, 'n_positions': positions, 'vocab_size': vocab,
          'layer_norm_epsilon': 1e-5, 'initializer_range': 0.02, 'scale_attn_weights': True,
          'tie_word_embeddings': False, 'bos_token_id': 0, 'eos_token_id': 0,
          'pad_token_id': 0, 'attn_pdrop': 0.1, 'embd_pdrop': 0.1, 'resid_pdrop': 0.1}


def file_tensors(folder: Path, params: Any) -> dict[str, np.ndarray]:
  """{file tensor name: array} that loading `folder`'s architecture turns into `params`.

  Each table entry's conversion is applied to the file tensor's element indices, which
  says which elements the leaf came from (a transpose, a slice of GPT-2's packed
  c_attn); the leaf's values go back there. Every element must be written once.
  """
  _, _, family, arch = hf.describe(str(folder), f'checkpoint {folder}')
  leaves = flatten(params)
  out, written = {}, {}
  for w in family.weights(arch):
    index = np.arange(math.prod(w.shape)).reshape(w.shape)
    taken = np.asarray(w.convert(index)).reshape(-1)
    tensor = out.setdefault(w.name, np.zeros(math.prod(w.shape), np.float32))
    tensor[taken] = np.asarray(leaves[w.path], np.float32).reshape(-1)
    written[w.name] = written.get(w.name, 0) + np.bincount(taken, minlength=tensor.size)
  for name, count in written.items():
    if not (count == 1).all():
      raise ValueError(f'{name}: the weight table writes elements {int((count != 1).sum())} '
                       'times other than once; it cannot be inverted.')
  return {w.name: out[w.name].reshape(w.shape) for w in family.weights(arch)}


def write_checkpoint(folder: Path, config_json: dict[str, Any], tokenizer: Tokenizer | None,
                     params: Any = None, seed: int = 0) -> Path:
  """config.json, tokenizer.json (unless `tokenizer` is None) and model.safetensors in
  `folder`; params None: the model's own random init from `seed` (transformers'
  normal(0.02), ones, zeros)."""
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / 'config.json').write_text(json.dumps(config_json, indent=1) + '\n')
  if tokenizer is not None:
    tokenizer.save(str(folder / 'tokenizer.json'))
  if params is None:
    model = hf.build(str(folder), where=f'checkpoint {folder}')
    params, _ = model.init(jax.random.key(seed), None)
  write_safetensors(folder / 'model.safetensors', file_tensors(folder, params))
  return folder


def checkpoint_from_workdir(workdir: str, base: Path, folder: Path) -> Path:
  """Member 0 of a dist_ens run that trained from 'hf:' + base, written as a checkpoint
  beside base's config.json and tokenizer.json."""
  params = Ensemble.load(workdir, devices=jax.devices()[:1]).member(0)
  config_json = json.loads((Path(base) / 'config.json').read_text())
  tokenizer = Tokenizer.from_file(str(Path(base) / 'tokenizer.json'))
  return write_checkpoint(folder, config_json, tokenizer, params)


def untie(source: str, folder: Path) -> Path:
  """A checkpoint whose output layer is its token embedding (tie_word_embeddings: every
  released GPT-2) written untied, lm_head.weight a copy of the embedding: the same
  outputs, and an output layer each member of own='lora' owns (on the tied model its
  members own their LoRA factors alone, sharing the embedding). The source's other files
  (its tokenizer) are copied beside."""
  where = f'untie({source!r})'
  source_folder = locate(source, where)
  _, params = from_hf(str(source_folder))
  if 'lm_head' in params:
    raise ValueError(f'{where}: the checkpoint has its own lm_head already.')
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  for path in source_folder.iterdir():
    if path.is_file() and path.name != 'config.json' and 'model' not in path.name:
      shutil.copy(path, folder / path.name)
  config_json = {**json.loads((source_folder / 'config.json').read_text()),
                 'tie_word_embeddings': False}
  params = {**params, 'lm_head': {'w': np.asarray(params['tokens']).T}}
  return write_checkpoint(folder, config_json, None, params)
