"""`dist-ens report`: the figures and report.md of a short run."""

import json
from pathlib import Path

import numpy as np
import pytest

from dist_ens import data
from dist_ens.io import report
from dist_ens.training import run as train
from dist_ens.configuration import load_config
from dist_ens.inference import Ensemble

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.mesh.member, config.mesh.data = 4, 4, 2
  config.train.steps, config.train.log_every, config.train.eval_every = 20, 10, 10
  config.model.widths = (32, 32)
  config.data.batch_size = 64
  config.optim.learning_rate = 3e-3
  path = tmp_path_factory.mktemp('report')
  train.run(config, str(path))
  assert report.main(['--workdir', str(path)]) == 0
  return path


def test_report_writes_every_figure_as_a_real_image(workdir):
  image = pytest.importorskip('matplotlib.image')
  sizes = {}
  for name in report.FIGURES:
    path = workdir / 'report' / name
    assert path.read_bytes()[:8] == PNG_SIGNATURE, name
    pixels = image.imread(path)
    sizes[name] = pixels.shape[:2]
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 600, name
    assert pixels[..., :3].std() > 0.05, f'{name} is blank'
  # Three reliability panels side by side: ensemble, best and worst member.
  height, width = sizes['reliability.png']
  assert width >= 2.5 * height


def test_report_md_embeds_the_figures_and_the_final_table(workdir):
  text = (workdir / 'report' / 'report.md').read_text()
  final = json.loads((workdir / 'final_metrics.json').read_text())
  for name in report.FIGURES:
    assert f']({name})' in text
  assert f'**{final["ensemble"]["accuracy"]:.4f}**' in text
  assert '| 3 |' in text and 'adaptive ECE' in text and 'mutual information' in text
  assert 'step 20 of 20' in text  # Which checkpoint the figures describe.


def test_ensemble_size_curve_ends_at_the_ensemble_and_starts_at_member_0(workdir):
  final = json.loads((workdir / 'final_metrics.json').read_text())
  test = data.load_dataset('mnist1d').test
  out = Ensemble.load(workdir).predict(test.x)
  curve = report.ensemble_size_curve(out.member_probs, test.y, range(4))
  np.testing.assert_array_equal(curve['size'], [1, 2, 3, 4])
  np.testing.assert_allclose(curve['accuracy'][0], final['members']['accuracy'][0])
  np.testing.assert_allclose(curve['nll'][0], final['members']['nll'][0], rtol=1e-5)
  np.testing.assert_allclose(curve['accuracy'][-1], final['ensemble']['accuracy'])
  np.testing.assert_allclose(curve['nll'][-1], final['ensemble']['nll'], rtol=1e-5)
  # The diagrams' bins are those of the metric: the same ECE as training reported.
  rel = report.reliability(out.probs, test.y)
  np.testing.assert_allclose(rel.ece, final['ensemble']['ece'], atol=1e-5)
  assert rel.count.sum() == len(test.y)


def test_report_of_an_unfinished_run_fails_with_a_message(tmp_path, capsys):
  assert report.main(['--workdir', str(tmp_path)]) == 1
  assert 'has not finished' in capsys.readouterr().err
