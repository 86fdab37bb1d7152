"""benchmarks/mfu.py end to end on a CPU in --tiny mode: a dist_ens whole run, its FLOPs by
XLA's cost analysis and the MFU arithmetic, the matmul cell, and a torch cell skipped
with its reason where torch is not installed; the init program's compile timed, cut at
--init_timeout_s, and the :cpuinit fallback. About 90 s (two ViT runs): the slow tier."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_tiny_cells_run_and_write_mfu(tmp_path):
  out = tmp_path / 'mfu.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'benchmarks.mfu', '--tiny', '--cells',
       'jax:vit:2,jax:vit:2:cpuinit,peak,torch:vit:2',
       '--peak_tflops', '1', '--out', str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(out.read_text())
  assert results['peak_tflops'] == 1 and results['tiny']
  cells = {c['cell']: c for c in results['cells']}
  run = cells['jax:vit:2']
  assert run['rate'] > 0 and run['timed_steps'] == 4
  assert run['init_compile_s'] > 0 and run['init_on'] == 'cpu'
  assert 'not needed' in cells['jax:vit:2:cpuinit']['skipped']  # the plain cell measured
  assert run['flops_per_member_example'] == pytest.approx(run['flops_lowered'] / (2 * 8))
  assert run['mfu'] == pytest.approx(run['flops_per_member_example'] * run['rate'] / 1e12)
  assert cells['peak']['tflops_median'] > 0
  torch = cells['torch:vit:2']
  try:
    import torch as _  # noqa: F401
  except ImportError:
    assert 'torch is not installed' in torch['skipped']
  else:
    assert torch['rate'] > 0 and torch['mfu'] > 0


@pytest.mark.slow
def test_an_init_compile_past_its_limit_ends_the_cell_and_the_cpu_fallback_runs(tmp_path):
  out = tmp_path / 'mfu.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'benchmarks.mfu', '--tiny', '--cells', 'jax:vit:2,jax:vit:2:cpuinit',
       '--init_timeout_s', '0.001', '--peak_tflops', '1', '--out', str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  cells = {c['cell']: c for c in json.loads(out.read_text())['cells']}
  assert 'rate' not in cells['jax:vit:2']
  assert 'had not compiled after 0.001 s' in cells['jax:vit:2']['error']
  fallback = cells['jax:vit:2:cpuinit']
  assert fallback['rate'] > 0 and fallback['init_on'] == 'the CPU'
  assert fallback['flops_per_member_example'] > 0


@pytest.mark.slow
def test_recount_merges_calls_keeps_replaced_measurements_and_counts_flops(tmp_path):
  def call(cells, matmul, date):
    return {'date': date, 'device_kind': 'fake', 'jax': '0', 'peak_tflops': 1.0,
            'peak_source': 'test', 'measured_matmul_tflops': matmul, 'tiny': True, 'batch': 8,
            'image_side': 8, 'train_examples': 256, 'steps': 6, 'warmup': 2, 'cells': cells}
  vit = lambda rate: {'cell': 'jax:vit:2', 'framework': 'jax', 'net': 'vit', 'members': 2,
                      'rate': rate, 'step_s': 16 / rate}
  first = call([vit(100.0), {'cell': 'torch:vit:2', 'framework': 'torch', 'net': 'vit',
                             'members': 2, 'skipped': 'no time'}], 2.0, 'a')
  second = call([{'cell': 'torch:vit:2', 'framework': 'torch', 'net': 'vit', 'members': 2,
                  'rate': 50.0, 'step_s': 0.32}], None, 'b')
  third = call([vit(200.0)], 4.0, 'c')
  paths = []
  for i, run in enumerate((first, second, third)):
    paths.append(tmp_path / f'{i}.json')
    paths[-1].write_text(json.dumps(run))
  out, again = tmp_path / 'merged.json', tmp_path / 'again.json'
  recount = lambda files, to: subprocess.run(
      [sys.executable, '-m', 'benchmarks.mfu', '--recount', ','.join(map(str, files)),
       '--out', str(to)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
  recount(paths[:2], out)
  recount([out, paths[2]], again)  # a merged file merges on: its calls and cells carry over
  merged = json.loads(again.read_text())
  assert [c['date'] for c in merged['calls']] == ['a', 'b', 'c']
  cells = {c['cell']: c for c in merged['cells']}
  run, torch = cells['jax:vit:2'], cells['torch:vit:2']
  assert run['rate'] == 200 and run['call'] == 2
  assert run['earlier'] == [{'call': 0, 'rate': 100.0, 'step_s': 0.16}]
  assert torch['rate'] == 50 and torch['call'] == 1 and 'earlier' not in torch
  fpe = run['flops_per_member_example']
  assert fpe > 0 and torch['flops_per_member_example'] == fpe
  # Each cell's matmul share against its own call's peak, or the latest before it.
  assert run['of_measured_matmul'] == pytest.approx(fpe * 200 / 1e12 / 4.0)
  assert torch['of_measured_matmul'] == pytest.approx(fpe * 50 / 1e12 / 2.0)
