"""dist_ens's Masksembles masks against torch-uncertainty's generator, without torch.

The side-by-side of docs/ensemble_methods.md ("Masksembles beside torch-uncertainty's",
tools/torch_uncertainty/compare.py) compares two trainings whose masks come from two
generators: it means something only if they draw the same kind of masks. The fixture
tests/data/masksembles_tu_masks.json is what torch-uncertainty's own generator
(torch_uncertainty.layers.masksembles.generation_wrapper) drew for the compared widths
(the MLP's 256 hidden units, the 40 inputs its MLP also masks, the CNN's 25 channels, and
256 at scale 4), recorded by `compare.py --masks_fixture`; CI never installs torch.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from dist_ens.ensembles import masksembles

FIXTURE = Path(__file__).parent / 'data' / 'masksembles_tu_masks.json'
CASES = json.loads(FIXTURE.read_text())['cases']


def _overlap(masks: np.ndarray) -> float:
  n = len(masks)
  return float(np.mean([masks[i] @ masks[j] for i in range(n) for j in range(i + 1, n)]))


@pytest.mark.parametrize('case', CASES, ids=lambda c: f"{c['width']}x{c['count']}@{c['scale']}")
def test_masks_match_torch_uncertainty_generator(case):
  width, count, scale = case['width'], case['count'], case['scale']
  # The same ones per mask (the paper's formula, both sides), and every unit used.
  assert case['ones_per_mask'] == [masksembles.ones_per_mask(width, count, scale)]
  assert case['units'] == [width]
  draws = 60
  overlaps = []
  for seed in range(draws):
    masks = masksembles.generate(width, count, scale, np.random.default_rng((7, seed)))
    assert masks.shape == (count, width)
    assert set(masks.sum(1).astype(int)) == set(case['ones_per_mask'])
    assert masks.any(0).all()
    overlaps.append(_overlap(masks))
  # The same distribution of masks: the mean pairwise overlap of dist_ens's draws within
  # 4 standard errors of the difference of torch-uncertainty's recorded mean.
  mean, sd = np.mean(overlaps), np.std(overlaps, ddof=1)
  tolerance = 4 * np.sqrt(sd**2 / draws + case['overlap_sd']**2 / case['draws'])
  assert abs(mean - case['mean_overlap']) <= tolerance, (mean, case['mean_overlap'], tolerance)
