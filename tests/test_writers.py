"""Event writers (JSONL, CSV, TensorBoard, W&B, users' own, by name), JSON files, the progress
display and the results table."""

import glob
import io
import json
import logging as logging_std
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from absl import flags, logging

from dist_ens.errors import ConfigError
from dist_ens.io import progress as progress_lib, run_files, tables, writers

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


def test_tensorboard_scalars_equal_add_scalars(tmp_path):
  """The writer puts an event's scalars in one record; TensorBoard reads the same tags,
  steps and values as tensorboardX's add_scalar (a record per value) writes, a tag
  that needs cleaning included."""
  tensorboardx = pytest.importorskip('tensorboardX')
  events = EVENTS + [{'step': 30, 'split': 'test', 'members': {'my metric': [0.25, 0.5]},
                      'ensemble': {'/odd:name': 3.0}}]
  writer = writers.TensorBoardWriter(tmp_path / 'ours')
  for event in events:
    writer.write(event)
  writer.close()
  reference = tensorboardx.SummaryWriter(str(tmp_path / 'reference'))
  for event in events:
    split = event['split']
    for name, values in event.get('members', {}).items():
      for i, value in enumerate(values):
        reference.add_scalar(f'member_{i}/{split}/{name}', value, event['step'])
    for name, value in event.get('ensemble', {}).items():
      reference.add_scalar(f'ensemble/{split}/{name}', value, event['step'])
    for name, value in event.items():
      if name not in ('step', 'split', 'members', 'ensemble'):
        reference.add_scalar(f'{split}/{name}', value, event['step'])
  reference.close()
  ours, theirs = _read_tensorboard(tmp_path / 'ours'), _read_tensorboard(tmp_path / 'reference')
  tags = theirs.Tags()['scalars']
  assert 'member_1/test/my_metric' in tags and 'ensemble/test//odd_name' in tags
  assert sorted(ours.Tags()['scalars']) == sorted(tags)
  for tag in tags:
    got = [(e.step, e.value) for e in ours.Scalars(tag)]
    want = [(e.step, e.value) for e in theirs.Scalars(tag)]
    assert got == want or all(s == t and (v == w or (v != v and w != w))
                              for (s, v), (t, w) in zip(got, want)), tag


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


def _strict_loads(text):
  def reject(token):
    raise ValueError(f'not JSON: {token}')
  return json.loads(text, parse_constant=reject)


def test_json_files_write_null_for_non_finite_floats(tmp_path):
  obj = {'nll': [1.5, float('nan'), np.float32('inf')], 'ece': np.float64('-inf'),
         'auroc': np.array([0.5, np.nan]), 'count': np.int64(3), 'ok': 0.25}
  run_files.write_json(tmp_path / 'final.json', obj)
  assert _strict_loads((tmp_path / 'final.json').read_text()) == {
      'nll': [1.5, None, None], 'ece': None, 'auroc': [0.5, None], 'count': 3, 'ok': 0.25}
  writer = writers.JsonlWriter(tmp_path / 'metrics.jsonl')
  writer.write(EVENTS[1])  # A member's NaN test nll.
  writer.close()
  line, = (tmp_path / 'metrics.jsonl').read_text().splitlines()
  assert _strict_loads(line)['members']['nll'] == [1.5, None, 1.7]


def test_atomically_written_files_follow_the_umask(tmp_path):
  # The umask is read once at import, so each umask gets a fresh interpreter.
  script = textwrap.dedent(f"""
      import os, sys
      os.umask(int(sys.argv[1], 8))
      from dist_ens.io import run_files, writers
      run_files.write_json({str(tmp_path)!r} + '/final.json', {{'a': 1}})
      run_files.write_members_csv({str(tmp_path)!r} + '/members.csv', [{{'member': 0}}])
      writers.JsonlWriter({str(tmp_path)!r} + '/metrics.jsonl').close()
      """)
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  root = Path(__file__).resolve().parents[1]
  for umask, mode in (('022', 0o644), ('077', 0o600)):
    subprocess.run([sys.executable, '-c', script, umask], check=True, cwd=root, env=env)
    for name in ('final.json', 'members.csv', 'metrics.jsonl'):
      assert oct((tmp_path / name).stat().st_mode & 0o777) == oct(mode), (umask, name)


def _read_csv(path):
  header, *rows = path.read_text().splitlines()
  return header.split(','), [row.split(',') for row in rows]


def test_csv_writer_one_file_per_split_widening_and_resume(tmp_path):
  writer = writers.make_writer(['csv'], tmp_path)
  for event in EVENTS:
    writer.write(event)
  # A later event brings a column the header lacks: the file gains it.
  writer.write({'step': 30, 'split': 'train', 'members': {'loss': [.5, .6, .7]},
                'lr': 0.01})
  writer.close()
  header, rows = _read_csv(tmp_path / 'csv' / 'train.csv')
  assert header == ['step', 'members/loss/0', 'members/loss/1', 'members/loss/2',
                    'members/accuracy/0', 'members/accuracy/1', 'members/accuracy/2',
                    'member_examples_per_s', 'lr']
  assert rows[0] == ['10', '2.0', '2.5', '3.0', '0.1', '0.2', '0.3', '1234.5', '']
  assert rows[2] == ['30', '0.5', '0.6', '0.7', '', '', '', '', '0.01']
  header, rows = _read_csv(tmp_path / 'csv' / 'test.csv')
  assert header == ['step', 'members/nll/0', 'members/nll/1', 'members/nll/2', 'ensemble/nll',
                    'ensemble/mutual_information']
  assert rows == [['10', '1.5', 'nan', '1.7', '1.2', '0.05']]
  # A crash tore the last row; resumed from the checkpoint at step 10, steps 20 and
  # 30 are replayed.
  with open(tmp_path / 'csv' / 'train.csv', 'a') as f:
    f.write('40,0.1,0.')
  resumed = writers.make_writer(['csv'], tmp_path, keep_through_step=10)
  resumed.write({'step': 20, 'split': 'train', 'members': {'loss': [9., 9., 9.]}})
  resumed.close()
  header, rows = _read_csv(tmp_path / 'csv' / 'train.csv')
  assert [(r[0], r[1]) for r in rows] == [('10', '2.0'), ('20', '9.0')]
  assert len(header) == 9 and all(len(r) == 9 for r in rows)
  assert len(_read_csv(tmp_path / 'csv' / 'test.csv')[1]) == 1
  # A fresh run starts the files over.
  writers.make_writer('csv', tmp_path).close()
  assert not list((tmp_path / 'csv').glob('*.csv'))


_USER_WRITER = """
class Recorder:
  made = []

  def __init__(self, workdir, keep_through_step):
    self.init = (workdir, keep_through_step)
    self.events, self.closed = [], False
    Recorder.made.append(self)

  def write(self, event):
    self.events.append(event)

  def close(self):
    self.closed = True
"""


def test_user_writer_by_import_path_receives_every_event(tmp_path, monkeypatch):
  (tmp_path / 'my_sinks.py').write_text(_USER_WRITER)
  monkeypatch.syspath_prepend(str(tmp_path))
  writer = writers.make_writer('jsonl, my_sinks:Recorder', tmp_path / 'run', keep_through_step=5)
  for event in EVENTS:
    writer.write(event)
  writer.close()
  import my_sinks  # pylint: disable=import-outside-toplevel
  recorder, = my_sinks.Recorder.made
  assert recorder.init == (tmp_path / 'run', 5)
  assert recorder.events == EVENTS and recorder.closed
  assert len((tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()) == 3


@pytest.mark.parametrize('name, message', [
    ('jsonl,tensorbord', "unknown writer 'tensorbord'; valid names are 'jsonl', 'csv', "
                         "'tensorboard', 'wandb'"),
    ('no_such_pkg.mod:Writer', "cannot load writer 'no_such_pkg.mod:Writer'"),
    ('json:NoSuchClass', "cannot load writer 'json:NoSuchClass'"),
])
def test_bad_writer_name_is_a_config_error_naming_the_field(tmp_path, name, message):
  with pytest.raises(ConfigError, match='config.writers') as error:
    writers.make_writer(name, tmp_path)
  assert message in str(error.value) and '\n' not in str(error.value)
  assert not list(tmp_path.iterdir())  # Nothing written before the error.


def test_wandb_missing_is_one_line_with_the_pip_command(tmp_path, monkeypatch):
  monkeypatch.setattr(writers, '_wandb_installed', lambda: False)
  with pytest.raises(ConfigError, match=r"config.writers names 'wandb'.*: pip install wandb$"):
    writers.make_writer(['jsonl', 'wandb'], tmp_path)


def test_wandb_offline_writes_the_run_under_the_workdir(tmp_path, monkeypatch):
  pytest.importorskip('wandb')
  for var, sub in (('WANDB_CONFIG_DIR', 'config'), ('WANDB_CACHE_DIR', 'cache'),
                   ('WANDB_DATA_DIR', 'data')):
    monkeypatch.setenv(var, str(tmp_path / 'home' / sub))
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  workdir = tmp_path / 'run'
  writer = writers.make_writer(['wandb'], workdir)
  for event in EVENTS:
    writer.write(event)
  writer.close()
  run_file, = glob.glob(str(workdir / 'wandb' / 'offline-run-*' / 'run-*.wandb'))
  run_id = (workdir / 'wandb' / 'run_id').read_text().strip()
  assert run_file.endswith(f'run-{run_id}.wandb')
  # Offline runs are protobuf records; their metric names are stored verbatim.
  logged = Path(run_file).read_bytes()
  for key in ('train/members/loss/1', 'test/ensemble/nll', 'train/member_examples_per_s'):
    assert key.encode() in logged
  # A resumed run continues the same W&B run.
  writers.make_writer(['wandb'], workdir, keep_through_step=10).close()
  assert (workdir / 'wandb' / 'run_id').read_text().strip() == run_id


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
    for step in range(6, 21):
      progress.update(step, 'half way' if step == 10 else None,
                      postfix='loss 0.1234 acc 0.900 5,000 member-ex/s' if step == 10 else None)
    progress.close()
    assert handler.stream is stream  # Logging is routed back once the bar is gone.
  finally:
    handler.stream = before
    logging_std.getLogger().removeHandler(absl_handler)
    if not parsed:
      flags.FLAGS.unparse_flags()
  shown = stream.getvalue()
  assert '5/20' in shown and '20/20' in shown
  assert 'loss 0.1234 acc 0.900 5,000 member-ex/s' in shown  # The bar shows the last figures.
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
  # The mean is the non-frozen members' (member 0's here), as report.html's row.
  assert '| member mean (non-frozen) | 0.5000 | 1.0000 | 0.6000 | 0.1000 | 0.1200 |' in table
  assert '**0.0500** | **1.3000** |' in table
  assert 'mutual information (epistemic) 0.3000' in table
  np.testing.assert_equal(len(table.splitlines()[0].split('|')), 9)


def test_tables_of_thousands_of_members_stay_readable():
  """Past tables.MAX_ROWS members the console and the report show the members' spread
  (quantiles) and the best and worst ranked, not one row each; members.csv has them all."""
  from dist_ens.io import tables  # pylint: disable=import-outside-toplevel
  m = 4096
  nll = np.linspace(2.0, 0.5, m)
  final = {'num_members': m, 'members': {'accuracy': (1 - nll / 3).tolist(), 'nll': nll.tolist()},
           'ensemble': {'accuracy': 0.9, 'nll': 0.4}}
  text = tables.results_table(final)
  assert len(text.splitlines()) < 12
  median = [line for line in text.splitlines() if line.startswith('| member median')]
  assert median and f'{np.median(nll):.4f}' in median[0]
  assert f'{nll.min():.4f}' in text and f'{nll.max():.4f}' in text
  rows = tables.member_rows(final, {}, None, 'nll', False)
  ranked = tables.members_table(rows, []).splitlines()
  assert len(ranked) == 2 + tables.MAX_ROWS - 8 + 1 + 4
  assert ranked[2].startswith(f'| {m - 1} |')  # the best first: member 4095's NLL is lowest
  assert f'{m - tables.MAX_ROWS + 4} more' in ranked[2 + tables.MAX_ROWS - 8]
  small = dict(final, num_members=8, members={k: v[:8] for k, v in final['members'].items()})
  assert len(tables.results_table(small).splitlines()) == 2 + 8 + 2  # one row each, as before
