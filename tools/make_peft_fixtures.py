"""Writes tests/data/hf/peft_llama/peft_logits.npz: peft's outputs of the PEFT adapters
dist_ens exported (dist_ens.io.peft_adapters), which tests/test_peft_export.py compares
dist_ens's members against. Two steps, from the repository root:

  PYTHONPATH=. python tests/test_peft_export.py            # dist_ens: train, export adapters
  /tmp/hf-ref/bin/python tools/make_peft_fixtures.py       # peft: load them, save outputs

The second runs in the reference environment of tools/make_hf_fixtures.py (torch,
transformers, peft; never dist_ens dependencies). Each member_{i}/ adapter is loaded with
peft.PeftModel.from_pretrained on transformers' model of tests/data/hf/llama, in eval mode
with eager attention, on that fixture's reference inputs; 'logits' is [M, B, L, vocab].
"""

import json
import sys
from pathlib import Path

import numpy as np
import peft
import torch
import transformers

DATA = Path(__file__).resolve().parents[1] / 'tests' / 'data' / 'hf'


def main() -> None:
  folder, base = DATA / 'peft_llama', DATA / 'llama'
  inputs = torch.from_numpy(np.load(base / 'reference.npz')['inputs']).long()
  members, logits = sorted(folder.glob('member_*'), key=lambda p: int(p.name.split('_')[1])), []
  for member in members:
    model = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation='eager')
    model = peft.PeftModel.from_pretrained(model, member).eval()
    with torch.no_grad():
      logits.append(model(input_ids=inputs).logits.float().numpy())
  np.savez(folder / 'peft_logits.npz', logits=np.stack(logits))
  versions = {m.__name__: m.__version__ for m in (torch, transformers, peft, np)}
  (folder / 'VERSIONS.json').write_text(json.dumps(versions, indent=1) + '\n')
  print(f'{len(members)} members, logits {np.stack(logits).shape}', versions, file=sys.stderr)


if __name__ == '__main__':
  main()
