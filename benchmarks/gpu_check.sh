#!/usr/bin/env bash
# GPU check of cpt_jax's performance figures, for a session lent an H200 (under 9 minutes).
#
#   run(command="bash benchmarks/gpu_check.sh", timeout_s=560)
#
# Runs on the device machine's own python3 (it has jax[cuda], flax, optax, chex, torch,
# scikit-learn; nothing to carry). Each benchmark has its own time limit (`timeout`), so
# the script always ends in time; the logs and one JSON line per benchmark land in $OUT
# (or ./gpu_results), and the last section prints the measurements beside the model.
# Limits (s) and what each step is expected to take on an H200 host:
#   env          ~15  nvidia-smi, versions
#   overhead     170  train-step time quantized/fp32 (goal <= 1.1x) and peak memory (goal
#                     <= 1.1x), fp32 / bf16 / fake / int per model, 5 models (issue 44's FFN), one compile per step (ResNet-20: ~2 x 30 s; the
#                     others 5-15 s each), 15 rounds x 10 steps of a few ms: ~120 s
#   roofline      90  the MODEL of the same steps (benchmarks/roofline.py): the Transformer
#                     block d4096 (bf16, fp32, CPT fake quant, fp8 / mxfp8 / nvfp4 GEMMs)
#                     and overhead.py's 4 models, lowered for CUDA and fused by the model
#                     (~60 s), then from XLA GPU's own compiled kernels until --budget-s
#   lowp_gemm     60  bf16 vs each low-precision GEMM preset: the GEMM 8192^3 alone (issue
#                     16's goal for FP8: >= 1.3x bf16), with its three training GEMMs, and the
#                     Transformer block step (d_model 4096) for fp8_gemm, mxfp8_gemm,
#                     nvfp4_gemm; whether the HLO holds an FP8 / block-scaled GEMM call. A
#                     JSON line after each preset, so the limit keeps what was measured
#   vs_pytorch    70  the same ResNet-20 step against PyTorch with CPT's quantizers (cuda)
#   int8_matmul   60  int8 path vs bf16 / fp32 fake quant: Transformer MLP block (d_model
#                     4096, 8192 tokens) and ResNet-20 (batch 128)
#   int_gemm      45  a Dense layer's three GEMMs (2048 x 1024 x 1024) in fp32 / bf16 / int8
#                     (int32 accumulation) and three convolution routes, with the kernels
#                     XLA picked: whether compute="auto" should take integers on CUDA
#                     (cpt_jax.providers.int_platforms); overhead's `int` column is the step
#   throughput    35  quantizer GB/s vs a plain copy on a 1 GiB tensor
#   summary       ~2  measured vs modeled, side by side (benchmarks/gpu_summary.py)
# Sum of limits 530 s + env + summary: under 550 s.
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
MODELS="mlp,ffn,transformer"
[ -d "$CPT_DATA_ROOT/planetoid" ] && MODELS="$MODELS,gcn"
MODELS="$MODELS,resnet20"  # the slowest to compile last: a time limit keeps the others

start=$(date +%s)
{
  date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import jax, flax, optax; print('jax', jax.__version__, jax.devices())"
  $PY -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
} 2>&1 | tee "$OUT/env.log"

step() {  # step NAME LIMIT_S ARGS...
  local name=$1 limit=$2; shift 2
  echo "=== MEASURED: $name (limit ${limit}s) $(date +%T)"
  timeout "$limit" $PY "benchmarks/$name.py" --json "$@" 2>&1 | tee "$OUT/$name.log"
  echo "=== $name rc=${PIPESTATUS[0]} after $(( $(date +%s) - start ))s"
  grep '^{' "$OUT/$name.log" | tail -n 1 > "$OUT/$name.json"
}

step overhead 170 --models "$MODELS" --no-hlo
echo "=== MODELED (not measured): roofline"
step roofline 90 --program both --budget-s 70 --workloads block,overhead \
  --presets fp8_gemm,mxfp8_gemm,nvfp4_gemm --models "$MODELS"
step lowp_gemm 60 --size 8192 --d-model 4096 --rounds 3 --iters 5 --budget-s 40 \
  --block-presets fp8_gemm,mxfp8_gemm,nvfp4_gemm
step vs_pytorch 70 --device cuda
step int8_matmul 60
step int_gemm 45 --rounds 5
step throughput 35 --size 268435456
$PY benchmarks/gpu_summary.py "$OUT" 2>&1 | tee "$OUT/summary.log"
echo "total $(( $(date +%s) - start ))s"
