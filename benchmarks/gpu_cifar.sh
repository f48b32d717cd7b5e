#!/usr/bin/env bash
# ResNet-20 on CIFAR-10, fp32 vs CPT (cos_growth 3..8 / 8), on a lent H200 in under 8 minutes.
#
# Carry (64 MiB limit for the whole tree): copy the data into the ignored local_data/
#   mkdir -p local_data/cifar10
#   cp ../shared/datasets/cifar10/{data_batch_1,test_batch}.npz local_data/cifar10/
# (two files, 56 MB; a third batch does not fit the limit) and ml_collections, which
# the device image lacks, as a wheel:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl ml_collections
# then
#   run(command="bash benchmarks/gpu_cifar.sh", carry=["local_data", ".whl"], timeout_s=560)
#
# The training split needs all five batch files (cpt_jax.data without allow_partial,
# which the task builder does not pass): the batches present are linked under the
# missing names, i.e. training samples uniformly from the images carried (10,000 with
# one batch). Test: the full 10,000-image test batch. Prints a table; logs and
# summary.json files land in $OUT (or ./gpu_results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
STEPS="${STEPS:-4000}"
export PYTHONUNBUFFERED=1

if ! $PY -c "import ml_collections" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  $PY -c "import ml_collections" || { echo "ml_collections missing: carry it as a wheel (see header)"; exit 2; }
fi

DATA=local_data/cifar10
[ -f "$DATA/test_batch.npz" ] || { echo "no $DATA/test_batch.npz: carry the data (see header)"; exit 2; }
present=( $(ls "$DATA"/data_batch_*.npz 2>/dev/null) )
[ ${#present[@]} -ge 1 ] || { echo "no training batch in $DATA"; exit 2; }
for i in 1 2 3 4 5; do
  f="$DATA/data_batch_$i.npz"
  [ -e "$f" ] || ln -s "$(basename "${present[$(( (i - 1) % ${#present[@]} ))]}")" "$f"
done
echo "training files: ${#present[@]} distinct batch(es) carried: ${present[*]}"

run() {  # run NAME EXTRA_FLAGS...
  local name=$1; shift
  local wd="/tmp/gpu_cifar_$name"
  rm -rf "$wd"
  echo "=== $name $(date +%T)"
  timeout 220 $PY -m experiments.train --workdir="$wd" \
    --config=experiments/configs/cifar10_resnet.py --config.data_dir="$DATA" \
    --config.num_steps="$STEPS" --config.eval_every=0 --config.checkpoint_every=0 \
    --config.log_every=500 --config.tensorboard=False --config.precision.num_cycles=8 \
    --progress=false "$@" 2>&1 | tail -n 5 | tee "$OUT/cifar_$name.log"
  cp "$wd/summary.json" "$OUT/cifar_$name.json" 2>/dev/null || echo "no summary for $name"
}

run fp32 --config.precision.schedule=none
run cpt --config.precision.schedule=cos_growth

$PY - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = []
for name in ("fp32", "cpt"):
    path = os.path.join(out, f"cifar_{name}.json")
    if not os.path.exists(path):
        rows.append(f"| {name} | (no result) | | | | |")
        continue
    s = json.load(open(path))
    acc = s.get("final_test_accuracy")
    rows.append(f"| {name} | {s['steps']} | {acc:.4f} | {s.get('relative_cost_fp32', 1):.3f} | "
                f"{s['steps_per_s']:.1f} | {s['num_compiles']} |")
print("| run | steps | test accuracy | cost vs fp32 | steps/s | compiles |")
print("|---|---|---|---|---|---|")
print("\n".join(rows))
PY
