"""Writes tests/data/hf/: tiny random Hugging Face checkpoints and transformers' own
outputs on fixed inputs, which tests/test_hf.py compares dist_ens's models against.

transformers, torch and peft are never dependencies of dist_ens (nor installed by CI):
run this in a separate virtual environment, outside the repository:

  python3 -m venv /tmp/hf-ref
  /tmp/hf-ref/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
  /tmp/hf-ref/bin/pip install transformers safetensors peft numpy
  /tmp/hf-ref/bin/python tools/make_hf_fixtures.py          # from the repository root

(Any CPU build of torch does; the committed fixtures were made with torch 2.13.0+cpu,
transformers 5.24.0, safetensors 0.8.0.) Each folder, tests/data/hf/NAME/, holds what
save_pretrained writes (config.json, model.safetensors or a sharded index) and
reference.npz: 'inputs' (token ids [B, L] int32, or images [B, H, W, C] float32 in
dist_ens's NHWC) and 'logits' (float32; per position for the language models, per
example for the classifiers), from the model in eval mode with eager attention.

Every weight is redrawn after transformers' init (norm scales around 1, biases and
matrices of std 0.1-0.2), so a weight loaded into the wrong place changes the outputs
well beyond the tests' 1e-5.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

OUT = Path(__file__).resolve().parents[1] / 'tests' / 'data' / 'hf'
VOCAB, LENGTH, BATCH = 96, 7, 2


def _redraw(model: torch.nn.Module, seed: int) -> None:
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if p.ndim == 1 and ('norm' in name.lower() or 'ln_' in name) and name.endswith('weight'):
        p.copy_(1.0 + 0.2 * noise)
      elif p.ndim == 1:
        p.copy_(0.1 * noise)
      else:
        p.copy_(0.2 * noise)


def _token_inputs(seed: int, low: int = 3, pad: int | None = None) -> np.ndarray:
  ids = np.random.default_rng(seed).integers(low, VOCAB, (BATCH, LENGTH)).astype(np.int32)
  if pad is not None:
    ids[1, -2:] = pad  # padding at the end of the second sequence
  return ids


def _write(name: str, model, inputs: np.ndarray, torch_inputs: dict, **save) -> None:
  folder = OUT / name
  folder.mkdir(parents=True, exist_ok=True)
  for old in folder.iterdir():
    old.unlink()
  model.eval()
  with torch.no_grad():
    logits = model(**torch_inputs).logits.float().numpy()
  model.save_pretrained(folder, **save)
  (folder / 'generation_config.json').unlink(missing_ok=True)  # not read by dist_ens
  np.savez(folder / 'reference.npz', inputs=inputs, logits=logits)
  size = sum(f.stat().st_size for f in folder.iterdir())
  print(f'{name}: {type(model).__name__}, logits {logits.shape}, {size / 1024:.0f} KiB')


def _lm(name: str, config, seed: int, **save) -> None:
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation='eager')
  _redraw(model, seed)
  ids = _token_inputs(seed)
  _write(name, model, ids, {'input_ids': torch.from_numpy(ids).long()}, **save)


def _classifier(name: str, config, seed: int, pad: int | None = None) -> None:
  torch.manual_seed(seed)
  model = transformers.AutoModelForSequenceClassification.from_config(
      config, attn_implementation='eager')
  _redraw(model, seed)
  ids = _token_inputs(seed, pad=pad)
  _write(name, model, ids, {'input_ids': torch.from_numpy(ids).long()})


def main() -> None:
  OUT.mkdir(parents=True, exist_ok=True)
  _lm('gpt2', transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2,
                                      n_head=4, bos_token_id=0, eos_token_id=0), seed=0)
  # Grouped-query attention (4 query heads over 2 key/value heads), untied output
  # projection, saved in shards of ~40 KB (a model.safetensors.index.json).
  _lm('llama', transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
      tie_word_embeddings=False), seed=1, max_shard_size='40KB')
  # Tied embeddings, one key/value head, biases, another rope_theta.
  _lm('llama_tied', transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32,
      tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
      rope_parameters={'rope_type': 'default', 'rope_theta': 500000.0}), seed=2)
  _classifier('bert', transformers.BertConfig(
      vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=64, max_position_embeddings=32, num_labels=3), seed=3)
  _classifier('roberta', transformers.RobertaConfig(
      vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=64, max_position_embeddings=34, type_vocab_size=1, pad_token_id=1,
      num_labels=3), seed=4, pad=1)

  torch.manual_seed(5)
  config = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, num_labels=10)
  model = transformers.ViTForImageClassification(config)
  model.config._attn_implementation = 'eager'  # pylint: disable=protected-access
  _redraw(model, 5)
  images = np.random.default_rng(5).normal(size=(BATCH, 8, 8, 3)).astype(np.float32)
  _write('vit', model, images,
         {'pixel_values': torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()})
  versions = {m.__name__: m.__version__ for m in (torch, transformers, np)}
  (OUT / 'VERSIONS.json').write_text(json.dumps(versions, indent=1) + '\n')
  print(versions, file=sys.stderr)


if __name__ == '__main__':
  main()
