"""Prints, for each checkpoint in tests/data/hf/, the largest absolute difference between
dist_ens's outputs (dist_ens.models.from_hf) and transformers' committed ones.

  python tools/hf_parity.py            # from the repository root
"""

from pathlib import Path

import jax
import numpy as np

from dist_ens.models import from_hf

DATA = Path(__file__).resolve().parents[1] / 'tests' / 'data' / 'hf'


def main() -> None:
  for folder in sorted(p for p in DATA.iterdir() if (p / 'reference.npz').is_file()):
    model, params = from_hf(str(folder))
    reference = np.load(folder / 'reference.npz')
    logits, _ = jax.jit(lambda p, x: model.apply(p, {}, x, train=False))(
        params, reference['inputs'])
    diff = np.abs(np.asarray(logits) - reference['logits']).max()
    print(f'{folder.name:12s} logits {reference["logits"].shape}  max |dist_ens - '
          f'transformers| {diff:.1e}  (largest |logit| {np.abs(reference["logits"]).max():.2f})')


if __name__ == '__main__':
  main()
