"""tests/run_count.py's table: each file's counts summed over its tests and over the
processes that ran them, the costliest file first."""

import json

import run_count


def test_the_table_sums_each_files_tests_over_processes(tmp_path):
  zero = dict.fromkeys(run_count.FIELDS, 0)
  (tmp_path / 'gw0.json').write_text(json.dumps({
      'tests/test_a.py::test_one': {**zero, 'trainings': 2, 'compiles': 9},
      'tests/test_b.py::test_x[1]': {**zero, 'refusals': 1, 'children': 1}}))
  (tmp_path / 'gw1.json').write_text(json.dumps({
      'tests/test_a.py::test_two': {**zero, 'trainings': 1, 'compiles': 4, 'cache_reads': 3},
      'tests/test_c.py::test_y': {**zero, 'trainings': 5, 'compiles': 1}}))
  rows = [line.split('|')[1:-1] for line in run_count.summary(str(tmp_path)).splitlines()[2:]]
  table = {name.strip(): [int(v) for v in values] for name, *values in rows}
  # tests, trainings, refusals, compiles, cache reads, child processes
  assert table['all'] == [4, 8, 1, 14, 3, 1]
  assert table['tests/test_a.py'] == [2, 3, 0, 13, 3, 0]
  assert table['tests/test_b.py'] == [1, 0, 1, 0, 0, 1]
  assert [name.strip() for name, *_ in rows] == [
      'all', 'tests/test_c.py', 'tests/test_a.py', 'tests/test_b.py']
