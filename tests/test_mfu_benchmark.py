"""benchmarks/mfu.py end to end on a CPU in --tiny mode: a dist_ens whole run, its FLOPs by
XLA's cost analysis and the MFU arithmetic, the matmul cell, and a torch cell skipped
with its reason where torch is not installed. About 30 s (one ViT run): the slow tier."""

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
      [sys.executable, '-m', 'benchmarks.mfu', '--tiny', '--cells', 'jax:vit:2,peak,torch:vit:2',
       '--peak_tflops', '1', '--out', str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(out.read_text())
  assert results['peak_tflops'] == 1 and results['tiny']
  cells = {c['cell']: c for c in results['cells']}
  run = cells['jax:vit:2']
  assert run['rate'] > 0 and run['timed_steps'] == 4
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
