#!/usr/bin/env bash
# Masksembles beside torch-uncertainty's (issue 66, item 4): every step, from the repo root.
#
#   bash tools/torch_uncertainty/run.sh            # ~10 min on 2 cores at load 7
#   TEN_SEEDS=1 bash tools/torch_uncertainty/run.sh  # also seeds 0-9 of both, as 'ten_seeds' (+15 min)
#   FIXTURE=1 bash tools/torch_uncertainty/run.sh  # also rewrite tests/data/masksembles_tu_masks.json
#   PACKED=1 bash tools/torch_uncertainty/run.sh   # also Packed-Ensembles (packed.py; +8 min)
#
# 1. tools/.venv-tu (gitignored): torch and torch-uncertainty from PyPI, never in .venv.
#    Their [cpu] extra (torch, torchvision, lightning, timm: torch_uncertainty's __init__
#    imports lightning); PyPI's torch wheel is the CUDA build (with its nvidia
#    libraries; 6 GB in all), which runs on the CPU as it is.
# 2. The MNIST-1D arrays benchmarks/methods.py uses, exported by dist_ens's venv.
# 3. dist_ens's masksembles row (benchmarks/methods.py, seeds 0-2) into $WORK, not over
#    benchmarks/results/methods.json.
# 4. compare.py: torch-uncertainty's Masksembles in the same setting, seeds 0-2, one thread;
#    writes benchmarks/results/masksembles_torch_uncertainty.json with dist_ens's row beside.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/tmp/tu_cmp}
VENV=tools/.venv-tu
mkdir -p "$WORK"
if ! "$VENV/bin/python" -c 'import torch, torch_uncertainty' 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q 'torch-uncertainty[cpu]'
fi
.venv/bin/python tools/torch_uncertainty/export_mnist1d.py "$WORK/mnist1d_methods.npz"
if [ ! -f "$WORK/methods_masksembles.json" ]; then
  .venv/bin/python -m benchmarks.methods --methods masksembles --seeds 0,1,2 \
    --out "$WORK/methods_masksembles.json" 2>&1 | tee "$WORK/methods_masksembles.log"
fi
"$VENV/bin/python" tools/torch_uncertainty/compare.py --data "$WORK/mnist1d_methods.npz" \
  --dist_ens "$WORK/methods_masksembles.json" --dist_ens_log "$WORK/methods_masksembles.log"
if [ "${TEN_SEEDS:-0}" = 1 ]; then
  SEEDS=0,1,2,3,4,5,6,7,8,9
  if [ ! -f "$WORK/methods_masksembles_10.json" ]; then
    .venv/bin/python -m benchmarks.methods --methods masksembles --seeds "$SEEDS" \
      --out "$WORK/methods_masksembles_10.json" 2>&1 | tee "$WORK/methods_masksembles_10.log"
  fi
  "$VENV/bin/python" tools/torch_uncertainty/compare.py --data "$WORK/mnist1d_methods.npz" \
    --seeds "$SEEDS" --variants hidden,hidden_he --dist_ens "$WORK/methods_masksembles_10.json" \
    --dist_ens_log "$WORK/methods_masksembles_10.log" --section ten_seeds
fi
if [ "${FIXTURE:-0}" = 1 ]; then
  "$VENV/bin/python" tools/torch_uncertainty/compare.py \
    --masks_fixture tests/data/masksembles_tu_masks.json
fi
if [ "${PACKED:-0}" = 1 ]; then
  # dist_ens's packed row beside deep and deep16 (its DEE), then their packed_mlp.
  if [ ! -f "$WORK/methods_packed.json" ]; then
    .venv/bin/python -m benchmarks.methods --methods deep,packed,deep16 --seeds 0,1,2 \
      --out "$WORK/methods_packed.json" 2>&1 | tee "$WORK/methods_packed.log"
  fi
  "$VENV/bin/python" tools/torch_uncertainty/packed.py --data "$WORK/mnist1d_methods.npz" \
    --dist_ens "$WORK/methods_packed.json" --dist_ens_log "$WORK/methods_packed.log"
fi
