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
