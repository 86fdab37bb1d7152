"""Event writers (JSONL, TensorBoard, both), the progress display and the results table."""

import io
import json
import logging as logging_std

import numpy as np
import pytest
from absl import flags, logging

from dist_ens.io import progress as progress_lib, tables, writers

EVENTS = [
    {'step': 10, 'split': 'train', 'members': {'loss': [2.0, 2.5, 3.0], 'accuracy': [.1, .2, .3]},
     'member_examples_per_s': 1234.5},
    {'step': 10, 'split': 'test', 'members': {'nll': [1.5, float('nan'), 1.7]},
     'ensemble': {'nll': 1.2, 'mutual_information': 0.05}},
    {'step': 20, 'split': 'train', 'members': {'loss': [1.0, 1.5, 2.0], 'accuracy': [.4, .5, .6]},
     'member_examples_per_s': 2000.0},
]


def _read_tensorboard(logdir):
  event_accumulator = pytest.importorskip(
      'tensorboard.backend.event_processing.event_accumulator')
  acc = event_accumulator.EventAccumulator(
      str(logdir), size_guidance={event_accumulator.SCALARS: 0,
                                  event_accumulator.HISTOGRAMS: 0})
  acc.Reload()
  return acc


def test_tensorboard_tags_values_and_histograms(tmp_path):
  writer = writers.TensorBoardWriter(tmp_path / 'tb')
  for event in EVENTS:
    writer.write(event)
  writer.close()

  acc = _read_tensorboard(tmp_path / 'tb')
  scalars = set(acc.Tags()['scalars'])
  assert {'member_0/train/loss', 'member_2/train/accuracy', 'member_1/test/nll',
          'ensemble/test/nll', 'ensemble/test/mutual_information',
          'train/member_examples_per_s'} <= scalars
  assert not any(t.startswith('member_3/') for t in scalars)
  loss = acc.Scalars('member_1/train/loss')
  assert [(e.step, e.value) for e in loss] == [(10, 2.5), (20, 1.5)]
  assert acc.Scalars('ensemble/test/nll')[0].value == pytest.approx(1.2)
  assert set(acc.Tags()['histograms']) == {'members/train/loss', 'members/train/accuracy',
                                           'members/test/nll'}
  hist = acc.Histograms('members/train/loss')[-1].histogram_value
  assert (hist.num, hist.min, hist.max, hist.sum) == (3, 1.0, 2.0, pytest.approx(4.5))
  # The NaN member is left out of the histogram (it would corrupt every bucket).
  assert acc.Histograms('members/test/nll')[0].histogram_value.num == 2


def test_tensorboard_resume_drops_events_after_the_checkpoint(tmp_path):
  first = writers.TensorBoardWriter(tmp_path)
  for step in (10, 20, 30):
    first.write({'step': step, 'split': 'test', 'ensemble': {'nll': float(step)}})
  first.close()
  # Resumed from the checkpoint at step 20: step 30 is replayed with a new value.
  resumed = writers.TensorBoardWriter(tmp_path, keep_through_step=20)
  resumed.write({'step': 30, 'split': 'test', 'ensemble': {'nll': 99.0}})
  resumed.close()
  values = [(e.step, e.value) for e in _read_tensorboard(tmp_path).Scalars('ensemble/test/nll')]
  assert values == [(10, 10.0), (20, 20.0), (30, 99.0)]
  # A fresh run in the same directory hides everything written before it.
  fresh = writers.TensorBoardWriter(tmp_path)
  fresh.write({'step': 10, 'split': 'test', 'ensemble': {'nll': -1.0}})
  fresh.close()
  values = [(e.step, e.value) for e in _read_tensorboard(tmp_path).Scalars('ensemble/test/nll')]
  assert values == [(10, -1.0)]


def test_multi_writer_feeds_jsonl_and_tensorboard_and_keeps_resume_truncation(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  writer = writers.MultiWriter(writers.JsonlWriter(path), writers.TensorBoardWriter(tmp_path / 'tb'))
  for event in EVENTS:
    writer.write(event)
  writer.close()
  lines = path.read_text().splitlines()
  assert [json.loads(line)['step'] for line in lines] == [10, 10, 20]
  assert json.loads(lines[0]) == EVENTS[0]
  assert _read_tensorboard(tmp_path / 'tb').Scalars('member_0/train/loss')[-1].step == 20
  # JsonlWriter's resume behaviour is unchanged: events after the checkpoint go.
  writers.JsonlWriter(path, keep_through_step=10).close()
  assert [json.loads(line)['step'] for line in path.read_text().splitlines()] == [10, 10]


class _Terminal(io.StringIO):

  def isatty(self):
    return True


@pytest.fixture
def absl_records():
  records = []

  class Collect(logging_std.Handler):

    def emit(self, record):
      records.append(record.getMessage())

  handler = Collect()
  logging_std.getLogger('absl').addHandler(handler)
  logging.set_verbosity(logging.INFO)
  yield records
  logging_std.getLogger('absl').removeHandler(handler)


def test_progress_off_a_terminal_only_logs(absl_records):
  stream = io.StringIO()
  progress = progress_lib.Progress(20, start_step=0, stream=stream)
  assert not progress.has_bar
  for step in range(1, 21):
    progress.update(step, f'line at {step}' if step % 10 == 0 else None)
  progress.close()
  assert stream.getvalue() == ''
  assert [r for r in absl_records if r.startswith('line at')] == ['line at 10', 'line at 20']


def test_progress_on_a_terminal_draws_a_bar_and_still_logs(absl_records):
  stream = _Terminal()
  absl_handler = logging.get_absl_handler()
  handler = absl_handler.python_handler
  before = handler.stream
  # As under app.run: flags parsed, absl's handler on the root logger, logging to
  # the terminal the bar is on.
  parsed = flags.FLAGS.is_parsed()
  flags.FLAGS.mark_as_parsed()
  logging_std.getLogger().addHandler(absl_handler)
  handler.stream = stream
  try:
    progress = progress_lib.Progress(20, start_step=5, stream=stream)
    assert progress.has_bar
    for step in range(6, 21):
      progress.update(step, 'half way' if step == 10 else None)
    progress.close()
    assert handler.stream is stream  # Logging is routed back once the bar is gone.
  finally:
    handler.stream = before
    logging_std.getLogger().removeHandler(absl_handler)
    if not parsed:
      flags.FLAGS.unparse_flags()
  shown = stream.getvalue()
  assert '5/20' in shown and '20/20' in shown
  assert 'half way' in absl_records
  # The log line reached the terminal on a line of its own, not glued to the bar.
  assert any(line.rstrip().endswith('half way') and '/20' not in line
             for line in shown.replace('\r', '\n').splitlines())


def test_results_table_shows_new_metrics_and_still_reads_old_results():
  old = {'members': {'accuracy': [.5, .7], 'nll': [1.0, 0.8], 'brier': [.6, .4],
                     'ece': [.1, .05]},
         'ensemble': {'accuracy': .75, 'nll': .7, 'brier': .35, 'ece': .04,
                      'disagreement': .2}}
  table = tables.results_table(old)
  assert '| member mean | 0.6000 | 0.9000 | 0.5000 | 0.0750 |' in table
  new = {'members': dict(old['members'], adaptive_ece=[.12, .06], entropy=[1.1, .9]),
         'ensemble': dict(old['ensemble'], adaptive_ece=.05, entropy=1.3,
                          expected_entropy=1.0, mutual_information=.3, pairwise_kl=.4),
         'frozen_members': [1]}
  table = tables.results_table(new)
  assert 'adaptive ECE' in table and '| 1 (frozen) |' in table
  assert '**0.0500** | **1.3000** |' in table
  assert 'mutual information (epistemic) 0.3000' in table
  np.testing.assert_equal(len(table.splitlines()[0].split('|')), 9)
