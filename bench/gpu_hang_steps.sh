#!/usr/bin/env bash
# Issue 32's GPU hang on a machine of 4 GPUs (a lent nvidia-h100-x4 / h200-x4), sized to fit one device call (about
# 430 s on 4 x H200): a 1-block kernel that never ends (bench/fault_suite.py's long_kernel) at steps 1, 40 and 200,
# on rank 0 and the last rank in turn, 9 runs on each layout, then a healthy 25 s pause on each.
#   bash bench/gpu_hang_steps.sh
# Two lanes at once, each rank a GPU alone (NVML speaks for a GPU only where one rank runs on it): one node x 2 ranks
# on GPUs 0-1, two wrappers x 1 rank on GPUs 2-3 (--gpu-each).  Rows and every wrapper's -v log are packed into
# $OUT/r.tar.gz every 30 s, so that a call cut short still brings back what ran.
set -uo pipefail
OUT=${OUT:-bench/out}
R=$OUT/r
mkdir -p "$R"/n1 "$R"/w2
OUT=$R bash bench/gpu.sh faults --help >"$R/install.log" 2>&1
export GPU_SH_INSTALLED=1
nvidia-smi >"$R/gpus.txt" 2>&1
pack() { tar czf "$OUT/r.tar.gz.part" -C "$R" . && mv "$OUT/r.tar.gz.part" "$OUT/r.tar.gz"; }
(while sleep 30; do pack; done) &
packer=$!
hangs=(--scenarios long_kernel --fault-steps 1,40,200 --fault-ranks 0,-1 --repeats 9 --timeout 70 --steps-after 60
    --wrapper-arg=-v --budget 420)
pause=(--scenarios pause --pause-s 25 --fault-ranks 0 --fault-steps 100 --steps-after 60 --timeout 70 --wrapper-arg=-v
    --budget 150)
lane() {  # name, GPUs, layout args
    local name=$1 gpus=$2
    shift 2
    (
        export CUDA_VISIBLE_DEVICES=$gpus
        OUT=$R/$name bash bench/gpu.sh faults "$@" "${hangs[@]}" --out-dir "$R/$name" --name "$name" \
            >"$R/$name/$name.out" 2>&1
        OUT=$R/$name bash bench/gpu.sh faults "$@" "${pause[@]}" --out-dir "$R/$name" --name "$name-pause" \
            >"$R/$name/$name-pause.out" 2>&1
    ) &
}
lane n1 0,1 --nnodes 1
lane w2 2,3 --nnodes 2 --gpu-each
wait -n
wait -n
kill "$packer" 2>/dev/null
pack
tail -n 4 "$R"/*/*.out
