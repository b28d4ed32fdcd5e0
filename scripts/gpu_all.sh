#!/usr/bin/env bash
# Every GPU check and benchmark the open issues name, in one unattended call on a CUDA box
# (the project's H200 device machine, or any GPU host with the modern stack):
#
#   bash scripts/gpu_all.sh OUT [part ...]      parts: env tests train memory autobatch pipeline ddp
#                                               (and the short re-runs: input ckpt-sgd ddp-accuracy few-cores;
#                                               defaults: issue 17's rows, pipeline levers, flatness;
#                                               parity: this tree's trainer against .bench_old/src)
#
# Each part writes OUT/<part>.txt (its full log); SUMMARY.md gathers the scripts' markdown tables, and
# memory.png is bench-memory's chart: at most 8 files, what the device tool brings back. Default: all
# parts; `ddp` runs only with 2+ GPUs (on the project's device tool: a second call, kind nvidia-h200-x2).
# The tests part on one H100 (2026-12-06, gpu_all.sh OUT tests): 278 to 353 s on a fresh machine, 248 s on a warm one.
# Measured on H200s (2026-11-30): env+tests ~7.5 min, train ~3, memory ~9 (the allocator comparison
# autotunes every shape), autobatch ~1, pipeline ~4.5, ddp ~4 (x2); input ~2.5, ddp-accuracy ~2.5 (x2).
# On nvidia-h200-x2 two parts can run at once, one per GPU (CUDA_VISIBLE_DEVICES, taskset -c 0-15 /
# 16-31), each into its own OUT; that is how the README's numbers were taken.
set -u
out=${1:?usage: bash scripts/gpu_all.sh OUT [part ...]}; shift
parts=${*:-env tests train memory autobatch pipeline ddp}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
tmp=$(mktemp -d)
: > "$tmp/tables.md"

run() {  # run PART CMD...: log to OUT/PART.txt, keep going on failure
    local part=$1; shift
    echo "== $part: $*" | tee -a "$out/$part.txt"
    "$@" 2>&1 | tee -a "$out/$part.txt" | tail -n 25
    echo "== $part exit ${PIPESTATUS[0]}" | tee -a "$out/$part.txt"
}

for part in $parts; do
    case $part in
    env)   run env nvidia-smi
           run env python3 -m dlenv verify-env ;;
    tests) # the whole GPU suite in one call: four workers share the card, a test that fills or probes it does
           # so on a 24 GiB card in one of its places, a whole_gpu test runs alone and last (tests/gpushare.py);
           # timeline.tsv says per test (and per place) when it asked for the card, got it and let go
           DLENV_GPU_TIMELINE="$out/timeline.tsv" run tests python3 -m pytest -q -m gpu -n 4 --dist loadgroup \
               --durations=30 -p no:cacheprovider --junitxml "$out/gpu-tests.xml" tests ;;
    train) run train python3 scripts/bench_train.py --steps 20 --out "$tmp/train"
           cat "$tmp"/train/*.md >> "$tmp/tables.md" 2>/dev/null ;;
    memory)
           run memory python3 -m dlenv bench-memory --model resnet50 --batch-size 256 --out "$tmp/bm-r50"
           run memory python3 -m dlenv bench-memory --model vit_b_16 --batch-size 128 --no-allocator --out "$tmp/bm-vit"
           run memory python3 scripts/bench_memory_yardstick.py --model resnet50 --batch-size 256
           run memory python3 scripts/bench_memory_yardstick.py --model vit_b_16 --batch-size 128
           cat "$tmp"/bm-r50/memory.md "$tmp"/bm-vit/memory.md >> "$tmp/tables.md" 2>/dev/null
           cp "$tmp/bm-r50/memory.png" "$out/memory.png" 2>/dev/null ;;
    autobatch) run autobatch python3 scripts/bench_autobatch.py --model resnet50 ;;
    input) run input python3 -m pytest -q -m gpu tests/data/test_decode.py tests/data/test_plan.py tests/data/test_fastpath_gpu.py -p no:cacheprovider
           run input python3 scripts/bench_pipeline.py --only gpu-augment,nvjpeg,cache-ram,cache-disk --out "$tmp/input"
           cat "$tmp"/input/*.md >> "$tmp/tables.md" 2>/dev/null ;;
    defaults)  # issue 17's done-when in one call: the default path's rows, the pipeline, memory flatness
           run defaults python3 -m pytest -q -m gpu tests/data/test_memory_flat_gpu.py tests/train/test_train_gpu.py \
               -k "flat or auto" -p no:cacheprovider
           run defaults python3 scripts/bench_train.py --only resnet50 --steps 20 --out "$tmp/defaults" \
               --config="--amp" --config="--amp, a long run: --compile auto compiles" \
               --config="--amp --checkpoint --checkpoint-ratio 1" --config="--amp --checkpoint (ratio auto)" \
               --config="--amp --checkpoint (ratio auto, card capped at 7 GiB)" \
               --config="--amp --checkpoint (ratio auto, card capped at 9 GiB)"
           run defaults python3 scripts/bench_pipeline.py --out "$tmp/defaults-input" \
               --only synthetic,default,gpu-augment-12w,cache-ram
           cat "$tmp"/defaults/*.md "$tmp"/defaults-input/*.md >> "$tmp/tables.md" 2>/dev/null ;;
    ckpt-sgd)  # the trainer's --amp --checkpoint with the yardstick's optimizer: is the gap AdamW's CPU time?
           run ckpt-sgd python3 scripts/bench_train.py --only resnet50 --optimizer sgd --steps 50 --out "$tmp/ckpt"
           cat "$tmp"/ckpt/*.md >> "$tmp/tables.md" 2>/dev/null ;;
    parity)  # the trainer of this tree against an older one: git archive OLD --prefix=.bench_old/ | tar -x
           if [ -d .bench_old/src ]; then
               run parity python3 scripts/bench_parity.py --old .bench_old/src --new src --out "$tmp/parity"
               cat "$tmp"/parity/parity.md >> "$tmp/tables.md" 2>/dev/null
           else
               echo "== parity skipped: no .bench_old/src" | tee -a "$out/parity.txt"
           fi ;;
    few-cores)  # issue 49: the overlapped GPU decoders' tests, then its rows at 4, 2, 16 and 8 cores (~8 min; carry
                # the nvImageCodec wheels: docs/input-pipeline.md, "Overlap on few cores")
           run few-cores python3 -m pytest -q -m gpu tests/data/test_overlap_gpu.py tests/data/test_plan.py -p no:cacheprovider
           TORCH_LOGS=recompiles run few-cores python3 scripts/bench_pipeline.py --cores 4,2,16,8 --train-images 12000 \
               --epochs 3 --budget 420 --where default-serial=2,4 --where default-long=4 --where default=2,8,16 \
               --where nvimgcodec=8 --where synthetic-compiled=16 --where default-compiled=16 \
               --only synthetic,default,default-serial,default-long,nvimgcodec,synthetic-compiled,default-compiled \
               --out "$tmp/few-cores"
           cat "$tmp"/few-cores/bench_pipeline_cores.md >> "$tmp/tables.md" 2>/dev/null ;;
    ddp-accuracy)
           run ddp-accuracy python3 scripts/bench_ddp.py --skip-speed --out "$tmp/ddpacc"
           cat "$tmp"/ddpacc/*.md >> "$tmp/tables.md" 2>/dev/null ;;
    pipeline)
           run pipeline python3 scripts/bench_pipeline.py --out "$tmp/pipeline"
           cat "$tmp"/pipeline/*.md >> "$tmp/tables.md" 2>/dev/null ;;
    ddp)   if [ "$gpus" -ge 2 ]; then
               run ddp python3 scripts/bench_ddp.py --out "$tmp/ddp"
               cat "$tmp"/ddp/*.md >> "$tmp/tables.md" 2>/dev/null
           else
               echo "== ddp skipped: $gpus GPU(s)" | tee -a "$out/ddp.txt"
           fi ;;
    *)     echo "unknown part $part (env tests train memory autobatch pipeline ddp input defaults ckpt-sgd ddp-accuracy few-cores parity)" >&2
           exit 2 ;;
    esac
done
cp "$tmp/tables.md" "$out/SUMMARY.md" 2>/dev/null
grep -h "^== .* exit" "$out"/*.txt
