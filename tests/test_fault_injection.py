"""The fault-injection script's own checks, on hand-written files (no CLI run)."""

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / 'benchmarks' / 'fault_injection.py'
_spec = importlib.util.spec_from_file_location('fault_injection', _PATH)
fault_injection = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fault_injection)


def test_event_check_flags_repeated_missing_unexpected_and_non_json(tmp_path):
  scheduled = fault_injection.scheduled_events(steps=40, log_every=20, eval_every=20)
  assert scheduled == [(20, 'train'), (20, 'test'), (40, 'train'), (40, 'test')]
  path = tmp_path / 'metrics.jsonl'
  good = [{'step': s, 'split': split, 'members': {'loss': [1.0]}} for s, split in scheduled]
  path.write_text(''.join(json.dumps(e) + '\n' for e in good))
  assert fault_injection.check_events(path, scheduled) == []
  # Step 20's train event twice (a replay not truncated), step 40's test event lost,
  # an event from another schedule, and a NaN token.
  lines = [good[0], good[0], good[1], good[2], {'step': 30, 'split': 'train'}]
  path.write_text(''.join(json.dumps(e) + '\n' for e in lines)
                  + '{"step": 40, "split": "train", "loss": NaN}\n')
  assert fault_injection.check_events(path, scheduled) == [
      'metrics.jsonl line 6 invalid (ValueError)', 'events missing: 40/test',
      'events repeated: 20/train', 'events unexpected: 30/train']


@pytest.mark.parametrize('rc, stderr, signum, problems', [
    (0, 'I1123 log line\n', None, []),
    (1, 'I log\ndist-ens: error: config.json is not valid JSON\n', None, []),
    (1, 'Traceback (most recent call last):\n  ...\nValueError: x\n', None,
     ['run: traceback on stderr', 'run: exit 1 without a one-line error']),
    (130, 'I log\n', 2, []),
    (124, '', None, ['run hung (killed by timeout after 9s)']),
])
def test_exit_check(rc, stderr, signum, problems):
  outcome = fault_injection.Outcome(rc, stderr, 9.0)
  assert fault_injection.check_exit(outcome, 'run', signum) == problems


def test_a_signalled_run_that_stopped_early_must_not_exit_zero(tmp_path):
  stopped = fault_injection.Outcome(0, 'I log\n', 9.0, signalled_at=3.0)
  assert fault_injection.check_stopped_status(stopped, tmp_path) == [
      'faulted run exited 0 though it stopped before the end']
  (tmp_path / 'final_metrics.json').write_text('{}')  # It had finished: 0 is right.
  assert fault_injection.check_stopped_status(stopped, tmp_path) == []
  assert fault_injection.check_stopped_status(
      fault_injection.Outcome(143, '', 9.0, signalled_at=3.0), tmp_path / 'none') == []
