#!/usr/bin/env bash
# The CPU demo's numbers (docs/training.md, "The demo on a CPU"): the README's `dlenv train` and its
# --amp / --checkpoint variants and ResNet-18, each pinned to its own pair of cores (taskset), all at
# once, on a machine with at least 12 quiet cores and no GPU in use. Run from the repository root,
# with dlenv importable (the .venv of scripts/tools/setup-cpu.sh). Logs go to $OUT (default runs/bench-cpu).
set -euo pipefail
OUT=${OUT:-runs/bench-cpu}
mkdir -p "$OUT"
export CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 PYTHONUNBUFFERED=1 MPLBACKEND=Agg
python -m dlenv demo-data
job() {  # cores, name, train options
  local cores=$1 name=$2; shift 2
  ( /usr/bin/time -f "$name: wall %e s, user %U s" taskset -c "$cores" \
      python -m dlenv train --name "$name" --project "$OUT" "$@" > "$OUT/$name.log" 2>&1; tail -1 "$OUT/$name.log" ) &
}
job 0,1 recipe
job 2,3 recipe-seed1 --seed 1
job 4,5 amp --amp
job 6,7 checkpoint --checkpoint
job 8,9 checkpoint-all --checkpoint --checkpoint-ratio 1
job 10,11 resnet18-32 --model resnet18 --img-size 32 --epochs 10
wait
grep -h "^done:" "$OUT"/*.log
