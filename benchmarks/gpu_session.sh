#!/usr/bin/env bash
# What to run when a session is lent a GPU (the `device` tool): the checks of the
# performance issue that need one, one stage per call, each well inside a call's 10 minutes.
#
# Once, here (the machine has no network; its image has jax, optax, absl, orbax, torch,
# flax and equinox, not ml_collections, mnist1d or tensorboardX):
#   echo /.wheels/ >> .git/info/exclude    # (already in .gitignore)
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .wheels ml-collections mnist1d tensorboardX dm-haiku tokenizers
# Then each call: run(command='bash benchmarks/gpu_session.sh STAGE', carry=['.wheels']),
# its files back from $OUT. Stages:
#   check       jax, torch and the GPU they see (seconds)
#   run         the README's first run (configs/default.py) on the GPU, its final metrics
#   tests       the test suite on the machine's (newer) jax, on its CPU as CI runs it
#   throughput  the throughput grid on the GPU with every torch variant (torch/compile:
#               CUDA graphs; torch/amp: bfloat16 autocast and channels_last) and auto/bf16
#   resnet      the ResNet-20 cells on the GPU (JAX forms only)
#   model_axis  the ViT ladder's model=1 column by XLA:GPU's memory analysis (1 member on 1
#               device: model=1's program per device), 3 steps of each run for the
#               allocator's peak (model > 1 needs more GPUs than one)
#   scaling     benchmarks/scaling.py's ResNet-20 sweep on the GPU (M = 1 to 256, as many
#               as fit; every part of a run against M), then the MLP sweep's --quick list;
#               without `dist-ens plan`, so without MFU (a longer lease can add plans and
#               --peak_tflops 494, the H100/H200's dense TF32 peak: XLA:GPU runs float32
#               dots as TF32)
#   lm          benchmarks/lm_recipe.py at GPT-2 small's shape (768 wide, 12 blocks, GPT-2's
#               50,257-id vocabulary, output layer untied: 163M parameters): a LoRA ensemble
#               of 4 against one LoRA fine-tune and 4 full fine-tunes at equal member-steps.
#               The host has no network, so there is no pretrained GPT-2 here either: the
#               base is trained from random init on tests/data/text first, as on the CPU
#               (docs/pretrained.md); needs the tokenizers wheel
#   mfu         benchmarks/mfu.py (issue 65, item 4): WRN-28-10, ViT-S (4x4 patches) and
#               ResNet-18 ensembles on CIFAR-shaped synthetic data in bfloat16, dist_ens
#               whole runs with resident data against torch.func + torch.compile, MFU by
#               XLA's cost analysis; the most important cells first, the results file
#               rewritten after each cell, so a stop at the limit keeps what ran
#   mfu_owed    the mfu cells the first two calls left (issue 65 item 4): the matmul peak,
#               dist_ens's ViT-S (its init program's compile timed and cut at 75 s, then
#               the :cpuinit fallback where it was cut) beside torch.compile's again, then
#               ResNet-18 at M = 16 and 64 (where 64 vmapped members do not fit: 'map' over
#               two chunks of 32); mfu_gpu3.json, merged as BENCHMARKS.md says
#   overhead    benchmarks/order_draws.py and metrics_read.py, then benchmarks/overhead.py
#               on the GPU (issue 65's whole run >= 0.95x its bare
#               step with every member order): M = 256, 64, 8, one round each, 5,000
#               steps (1,000 untimed), the bare step at the runs' automatic K (50, and 10
#               for M = 256's per-member orders), a JSONL-only variant beside the default
#   overhead_profile  the default run's main thread under cProfile with its garbage
#               collections timed, M = 64, shared and 'shuffled' (~2 minutes)
# Each stage is bounded at 560 s or less (all nine: at most 66 min). Run on an H100
# (2026-11-27): check and run (50 s together), scaling's ResNet-20 part (M = 64, 256 in
# 158 s). Run on an H200 (2026-11-27): mfu, 418 s for 5 of its 15 cells (its ViT cell
# timed out in XLA:GPU's compile of the members' init), then `python3 -m benchmarks.mfu
# --cells ...` in a second call (301 s) for 5 more: BENCHMARKS.md, "MFU of real-sized
# members on a GPU"; then (another H200, 2026-11-27) mfu_owed, 381 s for the 7 cells owed
# (dist_ens's ViT ran once its init drew behind a barrier: the init compiled in 1.3 s).
# overhead ran three times on an H200 (2026-11-28), 201-218 s each: BENCHMARKS.md, "On a
# GPU". The others have not run since they were written. A session lent less device time runs the
# stages owed first: scaling, then resnet.
set -euo pipefail
stage=${1:?usage: gpu_session.sh check|run|tests|throughput|resnet|model_axis|scaling|lm|mfu|mfu_owed|overhead|overhead_profile}
out=${OUT:-/tmp/gpu_session}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .wheels/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

case $stage in
  check)
    python3 -c 'import jax, torch; print("jax", jax.__version__, jax.devices());
print("torch", torch.__version__, torch.cuda.is_available())' 2>&1 | tee "$out/check.log"
    ;;
  run)
    # The README's first run on the GPU, in full (the default config, 8 members, 2,000
    # steps): final_metrics.json beside the CPU's first-results row.
    timeout -k 10 120 python3 -m dist_ens.main --config=configs/default.py \
      --workdir=/tmp/gpu_default_run 2>&1 | tail -25 | tee "$out/run.log"
    cp /tmp/gpu_default_run/final_metrics.json "$out/final_metrics_gpu.json"
    ;;
  tests)
    # CI's command on the newer jax; conftest fakes 8 CPU devices (JAX_PLATFORMS=cpu).
    set -o pipefail
    timeout -k 10 560 python3 -m pytest -q -x -n 8 -p no:cacheprovider tests/ 2>&1 \
      | tee "$out/tests.log"
    ;;
  throughput)
    timeout -k 10 560 python3 benchmarks/throughput.py --models mlp_small,mlp_big,cnn1d,cnn2d \
      --members 1,16,64 --variants loop,vmap,map,auto,auto/bf16,torch,torch/compile,torch/amp \
      --repeats 5 --out "$out/throughput_gpu_today.json" 2>&1 | tee "$out/throughput.log"
    ;;
  resnet)
    # resnet20.py's torch twin runs on a CPU only, and its memory column reads host RSS.
    timeout -k 10 560 python3 benchmarks/resnet20.py --members 1,4,16 --no_torch --no_memory \
      --out "$out/resnet20_gpu.json" 2>&1 | tee "$out/resnet.log"
    ;;
  model_axis)
    # The CPU's table (results/model_axis.json) is XLA:CPU's buffer assignment; this reads
    # XLA:GPU's for the same members and what the allocator really peaks at.
    timeout -k 10 560 python3 benchmarks/model_axis.py --device gpu --run_steps 3 \
      --budgets_gb 2,8,70 --out "$out/model_axis_gpu.json" 2>&1 | tee "$out/model_axis.log"
    ;;
  scaling)
    # With plans, M = 1, 8, 64, 256 took over 400 s on an H100 (2026-11-27: each M's process
    # 54-83 s, each plan about as long): plans are left out.
    timeout -k 10 400 python3 -m benchmarks.scaling --model resnet20 --platform gpu \
      --members 1,8,64,256 --no_plan --child_timeout 150 \
      --out "$out/scaling_resnet20_gpu.json" 2>&1 \
      | tee "$out/scaling.log"
    timeout -k 10 150 python3 -m benchmarks.scaling --quick --platform gpu --no_plan \
      --child_timeout 60 \
      --out "$out/scaling_gpu.json" 2>&1 | tee -a "$out/scaling.log"
    ;;
  lm)
    # The runs' workdirs (the full fine-tunes' checkpoint alone is ~8 GB) stay in /tmp;
    # only the results file and the log come back.
    timeout -k 10 560 python3 -m benchmarks.lm_recipe --size gpt2 --pretrain-steps 200 \
      --steps 40 --batch 8 --workdir /tmp/lm_recipe --out "$out/lm_recipe_gpu.json" 2>&1 \
      | tee "$out/lm.log"
    ;;
  mfu)
    # One cell per process, each capped at 180 s and at what is left of the 430 s budget;
    # torch.compile's first step (the compile) is most of a torch cell's time.
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit \
      --format=csv 2>&1 | tee "$out/mfu.log" || true
    python3 -c 'import torch, torchvision; print("torch", torch.__version__,
"torchvision", torchvision.__version__, "(not used)")' 2>&1 | tail -1 | tee -a "$out/mfu.log" \
      || true
    set -o pipefail
    timeout -k 10 450 python3 -m benchmarks.mfu --budget_s 430 --out "$out/mfu_gpu.json" \
      2>&1 | tee -a "$out/mfu.log"
    ;;
  mfu_owed)
    # 381 s on an H200 (2026-11-27; about 2 minutes more where the ViT's init is cut).
    # JAX may take 92% of the GPU (its default 75% could be short for 64 ResNet-18s).
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit \
      --format=csv 2>&1 | tee "$out/mfu.log" || true
    set -o pipefail
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout -k 10 500 python3 -m benchmarks.mfu \
      --cells peak,jax:vit:4,jax:vit:4:cpuinit,torch:vit:4,jax:resnet18:16,torch:resnet18:16,jax:resnet18:64,jax:resnet18:64:map32,torch:resnet18:64 \
      --init_timeout_s 75 --budget_s 480 --min_cell_s 35 --cell_timeout_s 170 \
      --out "$out/mfu_gpu3.json" 2>&1 | tee -a "$out/mfu.log"
    ;;
  overhead)
    # Issue 65's whole run against its bare step on a GPU, every member order: the default
    # run (resident data: 'auto' puts MNIST-1D on the GPU) at M = 256, 64, 8, one process
    # per M, each its own results file (a cut keeps the Ms that ran); the bare step at the
    # runs' automatic K (50, and 10 for M = 256's per-member orders); the default run with
    # JSONL events only beside it (what TensorBoard's writing costs the loop). First what
    # an epoch's orders cost on the GPU against numpy, and the metrics' read with the next
    # call queued (both seconds).
    timeout -k 5 60 python3 -m benchmarks.order_draws --out "$out/order_draws_gpu.json" \
      2>&1 | tee -a "$out/overhead.log" || true
    timeout -k 5 60 python3 -m benchmarks.metrics_read --size 8000 \
      --out "$out/metrics_read_gpu.json" 2>&1 | tee -a "$out/overhead.log" || true
    for m in 256 64 8; do
      timeout -k 10 170 python3 -m benchmarks.overhead --members $m --steps 5000 --warmup 1000 \
        --rounds 1 --bare_k 10,50 \
        --variants "default;writers=('jsonl',);data.member_order='shuffled';data.member_order='bootstrap'" \
        --out "$out/overhead_gpu_m$m.json" 2>&1 | grep -v '^predictive\|^M=.*round\|^step \|^|' \
        | tee -a "$out/overhead.log" || true
    done
    ;;
  overhead_profile)
    # Where the default run's loop waits on a GPU (issue 65): cProfile of the main thread
    # and Python's garbage collections, M = 64, the shared order and 'shuffled'.
    for variant in "default" "data.member_order='shuffled'"; do
      timeout -k 10 120 python3 -m benchmarks.overhead --members 64 --steps 3000 --warmup 500 \
        --profile "$variant" 2>&1 | grep -v '^predictive\|^M=.*round\|^step \|^|' \
        | tee -a "$out/overhead_profile.log" || true
    done
    ;;
  *)
    echo "unknown stage $stage: check, run, tests, throughput, resnet, model_axis, scaling, lm, mfu or mfu_owed" >&2
    exit 2
    ;;
esac
