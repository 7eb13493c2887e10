#!/usr/bin/env bash
# Issue 30's job-shape matrix, one pass of every cell but the GPU hangs, on a machine of 4 GPUs (a lent
# nvidia-h100-x4 / h200-x4), sized to fit one device call (about 6 minutes on 4 x H200).
#   bash bench/gpu_matrix.sh [extra bench/job_shapes.py args...]
# Three lanes at once: the two-rank shapes of the DDP family on GPUs 0-1 and the pipelines on GPUs 2-3 (4 jobs a
# lane), the four-rank shapes on all four (3 jobs).  About 11 jobs on 64 cores: a first try of 26 at once lost the
# machine.  GPU hangs are left out: their ranks need a GPU each, alone (run them with --faults gpu_hang --parallel 1).
# Rows, logs and the wrong runs' folders are packed into $OUT/matrix.tar.gz every 30 s, so that a call cut short
# still brings back what ran.
set -uo pipefail
OUT=${OUT:-bench/out}
R=$OUT/matrix
mkdir -p "$R"/a "$R"/b "$R"/d
OUT=$R bash bench/gpu.sh shapes --help >"$R/install.log" 2>&1
export GPU_SH_INSTALLED=1
# Inductor's compile workers: one a rank, not one a core for every compiled rank at once.
export TORCHINDUCTOR_COMPILE_THREADS=1
pack() {
    python3 bench/keep_runs.py "$R/runs.tar.gz" "$R"/*/shapes.jsonl >/dev/null 2>&1
    tar czf "$OUT/matrix.tar.gz.part" -C "$R" . && mv "$OUT/matrix.tar.gz.part" "$OUT/matrix.tar.gz"
}
(while sleep 30; do pack; done) &
packer=$!
common=(--faults stuck,skip,dead,none,recv_first --fault-step 200 --budget 240 --watch=-v "$@")
lane() {  # name, GPUs ("" for all), parallel, timeout, shapes
    local name=$1 gpus=$2 parallel=$3 timeout=$4 shapes=$5
    (
        [ -n "$gpus" ] && export CUDA_VISIBLE_DEVICES=$gpus
        OUT=$R/$name bash bench/gpu.sh shapes --only "$shapes" --parallel "$parallel" --timeout "$timeout" \
            --work "/tmp/matrix-$name" --out "$R/$name/shapes.jsonl" "${common[@]}" >"$R/$name/shapes.out" 2>&1
    ) &
}
lane a 0,1 4 150 ddp,fsdp2,tp,compiled
lane b 2,3 4 150 pp_gpipe,pp_1f1b,pp_interleaved
lane d "" 3 200 fsdp2_tp,pp_dp
wait -n; wait -n; wait -n
kill "$packer" 2>/dev/null
pack
PYTHONPATH=/tmp/site python3 bench/job_shapes.py --summarize "$R"/*/shapes.jsonl  # gpu.sh installed ncclwatch there
