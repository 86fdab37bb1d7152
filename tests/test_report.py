"""`dist-ens report`: the figures (PNG and SVG), report.md and report.html of short runs."""

import contextlib
import io
import itertools
import json
import re
import struct
from html.parser import HTMLParser
from pathlib import Path
from xml.etree import ElementTree

import numpy as np
import pytest

import support

from dist_ens import data
from dist_ens.report import (build as report, data as report_data, pages as report_pages,
                             plots as report_plots, scatter as report_scatter,
                             stats as report_stats)
from dist_ens.training import train
from dist_ens import Ensemble

PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'
# What a classification run's report draws, each as PNG and SVG (a sweep adds
# 'sweep_scatter.png', a run of several methods its comparison).
FIGURES = ('reliability.png', 'members_vs_ensemble.png', 'learning_curves.png',
           'ensemble_size.png')


def _config(**overrides):
  """The sweep's run: support.config's tiny run (4 members of a (16,) MLP, batch 32, on its
  own mesh): 20 steps logged and evaluated every 10 (the report's curves have two points),
  saved at the end. No joint evaluation: the report does not read it."""
  return support.config({'train.steps': SWEEP_STEPS, 'train.log_every': 10,
                         'train.eval_every': 10, 'checkpoint.every': SWEEP_STEPS,
                         'eval.joint_tau': 0}, **overrides)


SWEEP_STEPS = 20


@pytest.fixture(scope='module')
def sweep(tmp_path_factory):
  """A learning-rate sweep (over 10x among the finite members) with top-k selection, an OOD
  set, and member 3 diverging at once (init x 1e30): frozen, with NaN metrics; reported
  through the command line. Every report test reads this one report (each report draws
  every figure twice, PNG and SVG: most of this file's time): it holds every figure a
  plain run's report has and the sweep's, methods' and frozen member's parts besides."""
  path = tmp_path_factory.mktemp('sweep')
  train(_config(optim__learning_rate=[1e-3, 4e-3, 2e-2, 3e-2],
                    model__init_scale=[1.0, 1.0, 1.0, 1e30], data__validation_size=200,
                    select__top_k=2, eval__ood_dataset='mnist1d_noise'), str(path))
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    assert report.main(['--workdir', str(path)]) == 0
  # What it wrote: make_report's folder, returned to main.
  assert printed.getvalue().startswith(f"wrote {path / 'report' / 'report.md'} and ")
  return path


def _png_dpi(path: Path) -> float:
  """The resolution the PNG's pHYs chunk records (pixels per metre -> per inch)."""
  blob = path.read_bytes()
  assert blob[:8] == PNG_SIGNATURE, path
  offset = 8
  while offset < len(blob):
    (length,), kind = struct.unpack('>I', blob[offset:offset + 4]), blob[offset + 4:offset + 8]
    if kind == b'pHYs':
      x, y, unit = struct.unpack('>IIB', blob[offset + 8:offset + 17])
      assert unit == 1 and x == y, path  # Metres, square pixels.
      return x * 0.0254
    offset += 12 + length
  raise AssertionError(f'{path} has no pHYs chunk')


class _Tables(HTMLParser):
  """The text of every table cell, as tables -> rows -> cells; and every <img>'s src."""

  def __init__(self):
    super().__init__()
    self.tables, self.images, self._cell = [], [], None

  def handle_starttag(self, tag, attrs):
    if tag == 'table':
      self.tables.append([])
    elif tag == 'tr':
      self.tables[-1].append([])
    elif tag in ('td', 'th'):
      self._cell = ''
    elif tag == 'img':
      self.images.append(dict(attrs)['src'])

  def handle_data(self, text):
    if self._cell is not None:
      self._cell += text

  def handle_endtag(self, tag):
    if tag in ('td', 'th'):
      self.tables[-1][-1].append(self._cell.strip())
      self._cell = None


def _parse_html(path: Path) -> _Tables:
  parser = _Tables()
  parser.feed(path.read_text(encoding='utf-8'))
  return parser


def test_every_figure_is_a_150_dpi_png_and_an_svg(sweep):
  image = pytest.importorskip('matplotlib.image')
  sizes = {}
  for name in FIGURES:
    path = sweep / 'report' / name
    assert _png_dpi(path) >= 150, name
    pixels = image.imread(path)
    sizes[name] = pixels.shape[:2]
    assert pixels.shape[0] >= 450 and pixels.shape[1] >= 900, name
    assert pixels[..., :3].std() > 0.05, f'{name} is blank'
    svg = ElementTree.parse(path.with_suffix('.svg')).getroot()
    assert svg.tag == '{http://www.w3.org/2000/svg}svg', name
    assert len(list(svg.iter())) > 100, f'{name}: an empty SVG'
  # Three reliability panels side by side (ensemble, best and worst member), each with
  # its bin-count histogram below.
  height, width = sizes['reliability.png']
  assert width >= 2 * height


def test_report_md_embeds_the_figures_and_the_final_table(sweep):
  text = (sweep / 'report' / 'report.md').read_text()
  final = json.loads((sweep / 'final_metrics.json').read_text())
  for name in FIGURES:
    assert f']({name})' in text and f'({name[:-4]}.svg)' in text
  assert f'**{final["ensemble"]["accuracy"]:.4f}**' in text
  assert all(f'| {member} |' in text for member in ('0', '1', '2', '3 (frozen)'))
  assert 'adaptive ECE' in text and 'mutual information' in text
  assert f'step {SWEEP_STEPS} of {SWEEP_STEPS}' in text  # Which checkpoint the figures describe.
  assert '(report.html)' in text


def test_report_html_is_self_contained_with_every_member_and_figure(sweep):
  path = sweep / 'report' / 'report.html'
  text = path.read_text(encoding='utf-8')
  # Opens from disk: nothing fetched from a server (no remote src/href, stylesheet, script).
  assert not re.search(r'''(src|href)\s*=\s*["']?\s*(https?:)?//''', text, re.I)
  assert '<link' not in text and '<script' not in text and '@import' not in text
  parsed = _parse_html(path)
  assert len(parsed.images) == len(FIGURES) + 2  # + sweep_scatter and methods
  assert all(src.startswith('data:image/') for src in parsed.images)
  metrics = next(table for table in parsed.tables if table[0][:2] == ['member', 'accuracy'])
  first_cells = [row[0] for row in metrics]
  assert first_cells[:5] == ['member', '0', '1', '2', '3 (frozen)'] and 'ensemble' in first_cells
  final = json.loads((sweep / 'final_metrics.json').read_text())
  ensemble_row = metrics[first_cells.index('ensemble')]
  assert ensemble_row[1] == f'{final["ensemble"]["accuracy"]:.4f}'
  assert metrics[2][2] == f'{final["members"]["nll"][1]:.4f}'  # Member 1's NLL.


def test_sweep_report_draws_the_scatter_and_survives_a_frozen_member(sweep):
  out = sweep / 'report'
  final = json.loads((sweep / 'final_metrics.json').read_text())
  nll = final['members']['nll'][3]
  assert final['frozen_members'] == [3] and (nll is None or np.isnan(nll))  # null: strict JSON
  assert _png_dpi(out / 'sweep_scatter.png') >= 150
  svg = (out / 'sweep_scatter.svg').read_text()
  ElementTree.fromstring(svg)
  # The finite members' learning rates span 20x: a log colour scale (matplotlib keeps
  # each text as a comment beside its glyph paths).
  assert '<!-- optim.learning_rate (log scale) -->' in svg
  parsed = _parse_html(out / 'report.html')
  assert len(parsed.images) == len(FIGURES) + 2  # + sweep_scatter and methods
  tables = {tuple(table[0][:2]): table for table in parsed.tables}
  hparams = tables['member', 'optim.learning_rate']
  assert hparams[0][2] == 'model.init_scale'
  assert [row[0] for row in hparams[1:]] == ['0', '1', '2', '3 (frozen)']
  assert hparams[4][hparams[0].index('test NLL')] == 'NaN'
  assert hparams[2][1] == '0.004'
  assert ('score', 'AUROC') in tables  # OOD
  selected = tables['ensemble', 'members']
  assert selected[2][1] == ', '.join(map(str, final['selected']['members']))
  metrics = tables['member', 'accuracy']
  assert [row[0] for row in metrics[-2:]] == ['ensemble', 'top-2 ensemble']
  assert '](sweep_scatter.png)' in (out / 'report.md').read_text()
  # Selection is one more way the run predicts: beside the trained members, table and plot.
  methods = tables['ensemble', 'accuracy']
  assert [row[0] for row in methods[1:]] == ['trained members', 'top-2']
  assert methods[2][1] == f"{final['selected']['ensemble']['accuracy']:.4f}"
  assert _png_dpi(out / 'methods.png') >= 150
  assert '| top-2 | ' in (out / 'report.md').read_text()


def test_method_rows_list_every_way_a_run_predicted():
  m = lambda acc: {'accuracy': acc, 'nll': 1.0, 'brier': 0.5, 'ece': 0.1}
  final = {'ensemble': m(0.5), 'multiswag': {'members_per_member': 8, 'ensemble': m(0.6)},
           'mc_dropout': {'samples': 16, 'ensemble': m(0.7)},
           'temperature_scaling': {'after': {'ensemble': m(0.8)}, 'before': {'ensemble': m(0)}},
           'greedy': {'ensemble': m(0.9)}, 'distill': {'student': 'hydra', **m(0.95)}}
  rows = report_data.method_rows(final)
  assert {k: v['accuracy'] for k, v in rows.items()} == {
      'trained members': 0.5, 'multiswag (8 per member)': 0.6, 'MC dropout x16': 0.7,
      'temperature scaled': 0.8, 'greedy selection': 0.9, 'distilled student (hydra)': 0.95}


def test_colour_scale_is_log_only_when_values_span_over_10x():
  assert report_scatter._color_norm(np.array([1e-3, 4e-3, 2e-2]))[1] == 'log'
  assert report_scatter._color_norm(np.array([1e-3, 5e-3, 1e-2]))[1] == 'linear'
  assert report_scatter._color_norm(np.array([0.0, 0.01, 0.3]))[1] == 'symlog'
  assert report_scatter._color_norm(np.array([np.nan]))[1] == 'linear'


def _acc_nll(probs, labels):
  return (np.mean(probs.argmax(-1) == labels),
          -np.mean(np.log(probs[np.arange(len(labels)), labels])))


def test_size_spread_on_a_hand_made_ensemble():
  rng = np.random.default_rng(1)
  member_probs = rng.dirichlet(np.ones(3), size=(5, 40))  # [M=5, N=40, C=3]
  labels = rng.integers(0, 3, 40)
  spread = report.ensemble_size_spread(member_probs, labels, range(5), num_subsets=20)
  np.testing.assert_array_equal(spread.size, [1, 2, 3, 4, 5])
  np.testing.assert_array_equal(spread.num_subsets, [5, 10, 10, 5, 1])  # All of them.
  # k = M: the one full ensemble, computed directly.
  acc, nll = _acc_nll(member_probs.mean(0), labels)
  for name in ('mean', 'min', 'max', 'q25', 'q75'):
    np.testing.assert_allclose(spread.stat('accuracy', name)[-1], acc)
    np.testing.assert_allclose(spread.stat('nll', name)[-1], nll, rtol=1e-12)
  # k = 1: the members themselves.
  alone = np.array([_acc_nll(p, labels) for p in member_probs])
  np.testing.assert_allclose(spread.stat('accuracy', 'min')[0], alone[:, 0].min())
  np.testing.assert_allclose(spread.stat('accuracy', 'max')[0], alone[:, 0].max())
  np.testing.assert_allclose(spread.stat('nll', 'min')[0], alone[:, 1].min())
  np.testing.assert_allclose(spread.stat('nll', 'max')[0], alone[:, 1].max())
  # k = 2: the mean over every pair.
  pairs = [_acc_nll(member_probs[list(p)].mean(0), labels)
           for p in itertools.combinations(range(5), 2)]
  np.testing.assert_allclose(spread.stat('nll', 'mean')[1], np.mean(pairs, 0)[1])
  # A subset of members (e.g. the non-frozen ones) draws only from them.
  some = report.ensemble_size_spread(member_probs, labels, [4, 1])
  np.testing.assert_allclose(some.stat('nll', 'mean')[-1],
                             _acc_nll(member_probs[[1, 4]].mean(0), labels)[1])


def test_size_spread_draws_distinct_random_subsets_reproducibly():
  rng = np.random.default_rng(2)
  member_probs = rng.dirichlet(np.ones(4), size=(9, 30))
  labels = rng.integers(0, 4, 30)
  a = report.ensemble_size_spread(member_probs, labels, range(9), num_subsets=6, seed=3)
  b = report.ensemble_size_spread(member_probs, labels, range(9), num_subsets=6, seed=3)
  np.testing.assert_array_equal(a.nll, b.nll)
  np.testing.assert_array_equal(a.num_subsets, [6] * 8 + [1])  # C(9, 8) = 9 > 6.
  assert np.isnan(a.nll[-1, 1:]).all() and np.isfinite(a.nll[:-1]).all()
  picked = report_stats._subsets(9, 4, 6, np.random.default_rng(0))
  assert len(set(picked)) == 6 and all(len(set(s)) == 4 for s in picked)
  # Large ensembles: log-spaced sizes, 1 and M included.
  sizes = report_stats._spread_sizes(256, 24)
  assert sizes[0] == 1 and sizes[-1] == 256 and len(sizes) <= 24


def test_ensemble_size_spread_starts_at_each_member_and_ends_at_the_ensemble(tiny_run):
  """On the session's shared plain run (no sweep, selection or frozen member; read only):
  the spread a report draws agrees with the final metrics, and its report lists the plain
  figures only (the sweep's report draws and embeds every one of them)."""
  workdir = tiny_run[0]
  final = json.loads((workdir / 'final_metrics.json').read_text())
  test = data.load_dataset('mnist1d').test
  out = Ensemble.load(workdir).predict(test.x)
  spread = report.ensemble_size_spread(out.member_probs, test.y, range(4))
  np.testing.assert_array_equal(spread.size, [1, 2, 3, 4])
  # Size 1: every member alone, in member order; size 4: the ensemble.
  np.testing.assert_allclose(spread.accuracy[0, :4], final['members']['accuracy'])
  np.testing.assert_allclose(spread.nll[0, :4], final['members']['nll'], rtol=1e-5)
  np.testing.assert_allclose(spread.accuracy[-1, 0], final['ensemble']['accuracy'])
  np.testing.assert_allclose(spread.stat('accuracy', 'max')[0],
                             max(final['members']['accuracy']))
  np.testing.assert_allclose(spread.stat('nll', 'mean')[-1], final['ensemble']['nll'],
                             rtol=1e-5)
  # The diagrams' bins are those of the metric: the same ECE as training reported.
  rel = report_stats.reliability(out.probs, test.y)
  np.testing.assert_allclose(rel.ece, final['ensemble']['ece'], atol=1e-5)
  assert rel.count.sum() == len(test.y)
  # A plain run's report.md and report.html show FIGURES and no sweep or methods figure.
  listed = report_pages.report_figures(final, spread, [0, 1, 2, 3])
  assert [f'{figure.name}.png' for figure in listed] == list(FIGURES)


def test_non_finite_predictions_do_not_break_the_numbers():
  probs = np.array([[0.9, 0.1], [np.nan, np.nan], [0.2, 0.8]])
  rel = report_stats.reliability(probs, np.array([0, 0, 1]), num_bins=2)
  assert rel.count.sum() == 2 and np.isnan(rel.ece)
  member_probs = np.stack([probs, np.array([[0.6, 0.4]] * 3)])
  spread = report.ensemble_size_spread(member_probs, np.array([0, 0, 1]), range(2))
  assert np.isnan(spread.stat('nll', 'mean')[-1])
  assert spread.stat('nll', 'min')[0] == pytest.approx(-np.mean(np.log([0.6, 0.6, 0.4])))
  assert report_plots._limits([np.nan, np.inf], 0.0, 1.0) == (0.0, 1.0)
  low, high = report_plots._limits([0.91, 0.93, np.nan], 0.0, 1.0)
  assert 0.85 < low < 0.91 and 0.93 < high < 0.99  # Not from 0: the differences show.


def test_report_of_an_unfinished_run_fails_with_a_message(tmp_path, capsys):
  (tmp_path / 'config.json').write_text('{}')  # A run started (an empty folder is none).
  assert report.main(['--workdir', str(tmp_path)]) == 1
  assert 'has not finished' in capsys.readouterr().err


def test_sweep_labels_never_overlap_and_label_every_spread_member():
  boxes = lambda placed, texts: [
      (x, y, x + report_scatter._CHAR_WIDTH * len(texts[i]), y + report_scatter._LABEL_HEIGHT)
      for i, (x, y) in placed]
  r = np.random.default_rng(0)
  crowded = 0.5 + 0.03 * r.standard_normal((30, 2))  # a sweep whose members agree
  texts = [str(i) for i in range(30)]
  placed = report_scatter.place_labels(crowded, texts)
  assert 4 <= len(placed) < 30
  drawn = boxes(placed, texts)
  for a in range(len(drawn)):
    for b in range(a):
      assert not report_scatter._overlap(drawn[a], drawn[b]), (placed[a], placed[b])
  spread = np.stack(np.meshgrid(np.linspace(0.1, 0.9, 5), np.linspace(0.1, 0.9, 4)), -1)
  assert len(report_scatter.place_labels(spread.reshape(-1, 2), texts[:20])) == 20


def test_a_thousand_members_report_their_spread_not_a_row_or_line_each(tmp_path):
  """benchmarks/scaling.py at M=4,096: report.html had a table row per member (4,103)
  and the learning curves a line per member (2 minutes of drawing). Beyond 32 members the
  tables give the members' spread (and the sweep table the best and worst), the curves
  the median, interquartile range and range."""
  m = 1000
  rng = np.random.default_rng(0)
  metric = lambda low, high: rng.uniform(low, high, m).tolist()
  final = {'num_members': m, 'frozen_members': [7],
           'members': {'accuracy': metric(0.1, 0.3), 'nll': metric(2.0, 3.0),
                       'brier': metric(0.8, 1.0), 'ece': metric(0.0, 0.3)},
           'ensemble': {'accuracy': 0.4, 'nll': 1.9, 'brier': 0.7, 'ece': 0.05},
           'hyperparameters': {'optim.learning_rate': metric(1e-4, 1e-2)}}
  final['members']['nll'][7] = float('nan')
  active = [i for i in range(m) if i != 7]
  run = report.Run(tmp_path, final, 'a thousand members', active, [])
  (tmp_path / 'page.html').write_text(report.html_page(run, tmp_path), encoding='utf-8')
  tables = {tuple(t[0][:2]): t for t in _parse_html(tmp_path / 'page.html').tables}
  metrics, hparams = tables['member', 'accuracy'], tables['member', 'optim.learning_rate']
  assert len(metrics) < 12 and len(hparams) == 1 + 32 - 3
  nll = np.array(final['members']['nll'])[active]
  median = next(row for row in metrics if row[0] == 'member median (non-frozen)')
  assert median[metrics[0].index('NLL')] == f'{np.median(nll):.4f}'
  best = np.argsort(np.where(np.isnan(final['members']['nll']), np.inf, final['members']['nll']))
  assert [row[0] for row in hparams[1:4]] == [str(i) for i in best[:3]]
  assert hparams[-1][0] == '7 (frozen)' and 'more (members.csv)' in hparams[-5][0]

  events = [{'step': s, 'split': split, 'members': {k: metric(0.5, 2.5) for k in keys},
             'ensemble': {k: 1.0 for k in keys}}
            for s in (10, 20, 30) for split, keys in (('train', ('loss',)),
                                                       ('test', ('accuracy', 'nll')))]
  report_plots.plot_learning_curves(tmp_path, events, frozen={7})
  svg = (tmp_path / 'learning_curves.svg').read_text()
  assert svg.count('id="line2d_') < 100  # (1,000 members drew 3,000 lines)
  assert svg.count('PolyCollection_') >= 6  # a range and a quartile band per panel
  assert 'median member' in svg and '999 members: range' in svg
