"""Fixtures for the text tests: the tiny BERT checkpoint of tests/data/hf/bert copied
beside a word-level tokenizer.json trained here on tests/data/text (README.md there
says where the corpus comes from), and writers of the two token-id file formats."""

import json
import shutil
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / 'tests' / 'data' / 'text'
BERT = ROOT / 'tests' / 'data' / 'hf' / 'bert'
VOCAB = 96  # the BERT fixture's vocab_size
PAD, CLS, SEP = 0, 2, 3  # the BERT fixture's pad_token_id is 0


def corpus_texts() -> list[str]:
  return [json.loads(line)['text'] for split in ('train', 'test')
          for line in (CORPUS / f'{split}.jsonl').read_text().splitlines()]


def make_tokenizer() -> Tokenizer:
  """A lower-cased word-level tokenizer of the corpus: [CLS] words [SEP], with its own
  padding switched on (the source must switch it off and pad to its own length)."""
  tokenizer = Tokenizer(models.WordLevel(unk_token='[UNK]'))
  tokenizer.normalizer = normalizers.Lowercase()
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  trainer = trainers.WordLevelTrainer(vocab_size=VOCAB,
                                      special_tokens=['[PAD]', '[UNK]', '[CLS]', '[SEP]'])
  tokenizer.train_from_iterator(corpus_texts(), trainer)
  tokenizer.post_processor = processors.TemplateProcessing(
      single='[CLS] $A [SEP]', special_tokens=[('[CLS]', CLS), ('[SEP]', SEP)])
  tokenizer.enable_padding(pad_id=PAD, pad_token='[PAD]')
  return tokenizer


def bert_with_tokenizer(folder: Path) -> Path:
  """The BERT fixture copied to `folder` with tokenizer.json beside it."""
  shutil.copytree(BERT, folder)
  make_tokenizer().save(str(folder / 'tokenizer.json'))
  return folder


def write_jsonl(path: Path, sequences: list[list[int]], labels: list[int] | None) -> None:
  with open(path, 'w') as f:
    for i, ids in enumerate(sequences):
      row = {'input_ids': [int(t) for t in ids]}
      if labels is not None:
        row['label'] = int(labels[i])
      f.write(json.dumps(row) + '\n')


def write_npz(path: Path, sequences: list[list[int]], labels: list[int] | None,
              filler: int = 77) -> None:
  """'input_ids' [N, T] filled past each sequence's end with `filler` (which 'lengths'
  must make the reader ignore)."""
  width = max(len(ids) for ids in sequences)
  table = np.full((len(sequences), width), filler, np.int64)
  for i, ids in enumerate(sequences):
    table[i, :len(ids)] = ids
  arrays = {'input_ids': table, 'lengths': np.array([len(ids) for ids in sequences])}
  if labels is not None:
    arrays['label'] = np.asarray(labels)
  np.savez(path, **arrays)
