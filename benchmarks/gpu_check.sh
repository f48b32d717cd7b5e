#!/usr/bin/env bash
# GPU check of cpt_jax's performance figures, for a session lent an H200 (under 9 minutes).
#
#   run(command="bash benchmarks/gpu_check.sh", timeout_s=560)
#
# Runs on the device machine's own python3 (it has jax[cuda], flax, optax, chex, torch,
# scikit-learn; nothing to carry). Each benchmark has its own time limit so the script
# always finishes; the logs and one JSON line per benchmark land in $OUT (or
# ./gpu_results). Steps:
#   1. overhead.py     train-step time quantized/fp32 (goal <= 1.1x on GPU), 4 models
#                      (--no-hlo: skips the extra compile for HLO/memory stats, for time)
#   2. vs_pytorch.py   the same ResNet-20 step against PyTorch with CPT's quantizers (cuda)
#   3. int8_matmul.py  int8 path vs bf16 / fp32 fake quant: Transformer MLP block
#                      (d_model 4096, 8192 tokens) and ResNet-20 (batch 128)
#   4. throughput.py   quantizer GB/s vs a plain copy on a 1 GiB tensor
#   5. lowp_gemm.py    bf16 vs each low-precision GEMM preset (fp8_gemm, mxfp8_gemm,
#                      nvfp4_gemm, ...): the GEMM 8192^3 alone (issue 16's goal for FP8:
#                      >= 1.3x bf16) and with its three training GEMMs, and a Transformer
#                      block step (d_model 4096) for the headline presets; whether the HLO
#                      holds the FP8 / block-scaled GEMM custom call (issue 25). It prints a
#                      JSON line after each preset, so the time limit keeps what was measured.
#                      (Replaces fp8_matmul.py, whose figures are its fp8_gemm "gemm" row.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# JAX and PyTorch share the GPU in vs_pytorch: no preallocation.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Datasets: CIFAR-10 images when carried (local_data/cifar10), else random inputs;
# the GCN needs Cora: copied into local_data/planetoid if carried, else skipped.
export CPT_DATA_ROOT="${CPT_DATA_ROOT:-$PWD/local_data}"
MODELS="resnet20,mlp,transformer"
[ -d "$CPT_DATA_ROOT/planetoid" ] && MODELS="$MODELS,gcn"

start=$(date +%s)
{
  date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import jax, flax, optax; print('jax', jax.__version__, jax.devices())"
  $PY -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
} 2>&1 | tee "$OUT/env.log"

step() {  # step NAME LIMIT_S ARGS...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)"
  timeout "$limit" $PY "benchmarks/$name.py" --json "$@" 2>&1 | tee "$OUT/$name.log"
  echo "=== $name rc=${PIPESTATUS[0]} after $(( $(date +%s) - start ))s"
  tail -n 1 "$OUT/$name.log" > "$OUT/$name.json"
}

step overhead 240 --models "$MODELS" --no-hlo
step vs_pytorch 90 --device cuda
step int8_matmul 100
step throughput 45 --size 268435456
step lowp_gemm 60 --size 8192 --d-model 4096 --rounds 3 --iters 5 --budget-s 40 \
  --block-presets fp8_gemm,mxfp8_gemm,nvfp4_gemm
echo "total $(( $(date +%s) - start ))s"
