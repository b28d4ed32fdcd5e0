#!/usr/bin/env bash
# `dlenv watch` over `dlenv train` on real JPEGs at 4 and at 16 cores, on a CUDA box (the project's H200):
#
#   bash scripts/watch_train.sh OUT [DATA]          (CORES="4" or "16" for one of the two runs)
#
# Writes (or reuses) a photo-like JPEG dataset (scripts/make_jpeg_dataset.py: 10,000 train + 500 val,
# 500x375) in DATA (default /tmp/jpegs-watch), then for CORES in 4 16: `taskset -c 0-(CORES-1) dlenv watch
# -- dlenv train --data DATA --model resnet50 --amp --epochs 2 --batch-size 256 --cache off` (the decoder
# and workers as auto picks them for those cores). OUT/SUMMARY.md gathers each run's watch paragraph and its
# results.csv rows (data_wait and gpu_busy per epoch); OUT/watch-cores4.png and OUT/watch-cores16.png are
# the timelines, OUT/cores<N>.txt the logs: six files, what the device tool brings back. What to compare:
# watch's busy share against 1 - data_wait, of results.csv here and of bench_pipeline at the same cores.
set -u
out=${1:?usage: bash scripts/watch_train.sh OUT [DATA]}
data=${2:-/tmp/jpegs-watch}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
# NVML's bindings (requirements.txt); a machine without network takes them from a carried wheel in .whl/
python3 -c "import pynvml" 2>/dev/null || pip install -q --no-index --find-links .whl nvidia-ml-py \
    || { echo "watch_train.sh: nvidia-ml-py is missing; pip install nvidia-ml-py (or carry its wheel in .whl/)"; exit 2; }
python3 scripts/make_jpeg_dataset.py --out "$data" --train 10000 --val 500 > "$out/make_data.txt" 2>&1
: > "$out/SUMMARY.md"
runs=$(mktemp -d)  # run folders (with their .pth files) stay here: OUT gets the summary, plots and logs
for cores in ${CORES:-4 16}; do  # CORES="4" or CORES="16": one run per call
    name=cores$cores
    taskset -c 0-$((cores - 1)) python3 -m dlenv watch --project "$runs/watch" --name "$name" --exist-ok -- \
        python3 -m dlenv train --data "$data" --model resnet50 --amp --epochs 2 --batch-size 256 --cache off \
        --project "$runs/train" --name "$name" --exist-ok > "$out/$name.txt" 2>&1
    rc=$?
    {
        echo "## $cores cores (taskset -c 0-$((cores - 1))): exit $rc"
        echo
        cat "$runs/watch/$name/watch.md"
        echo
        echo '```'
        cat "$runs/train/$name/results.csv"
        echo '```'
        echo
    } >> "$out/SUMMARY.md"
    cp "$runs/watch/$name/watch.png" "$out/watch-$name.png"
done
cat "$out/SUMMARY.md"
