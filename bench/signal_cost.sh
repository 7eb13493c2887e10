#!/usr/bin/env bash
# Issue 45 in one device call, on a lent GPU machine:
#   1. builds NVIDIA's NCCL Inspector profiler plugin from the copy in the git-ignored .inspector/src/
#      (tests/fixtures/inspector/README.md says how it is copied; no network there);
#   2. captures its real output (JSON lines, verbose; Prometheus text) for tests/fixtures/inspector/, with NCCL's own
#      INFO lines of the same runs, into $OUT/inspector-capture.tar.gz;
#   3. measures each injected signal's cost (bench/signal_cost.py) on the worst case, back-to-back tiny all_reduces
#      on 2 ranks, then on an FSDP2 x TP step on 4 ranks, each within what is left of the budget.
# Carry .whl (bench/gpu.sh's wheels) and .inspector in the run tool's `carry`.
#   bash bench/signal_cost.sh [SECONDS]     # the whole call's budget, default 540
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export OUT NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
total=${1:-540}
label=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
log=$OUT/signal_cost.log

# gpu.sh installs .whl and ncclwatch into /tmp/site on its first call and logs the machine.
bash bench/gpu.sh signal_cost --help >/dev/null || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH

so=
if [ -f .inspector/src/Makefile ]; then
    cuda=${CUDA_HOME:-/usr/local/cuda}
    [ -f "$cuda/include/cuda.h" ] || cuda=$(dirname "$(dirname "$(command -v nvcc)")")
    cudart=$(find -L "$cuda" -name 'libcudart.so*' 2>/dev/null | head -1)
    if make -C .inspector/src -j"$(nproc)" CUDA_HOME="$cuda" CUDA_LIB="$(dirname "$cudart")" \
        >"$OUT/inspector-build.log" 2>&1; then
        so=$PWD/.inspector/src/libnccl-profiler-inspector.so
    fi
    echo "== inspector build: ${so:-FAILED} (CUDA $cuda, $cudart) at ${SECONDS} s" | tee -a "$log"
fi

if [ -n "$so" ]; then
    cap=/tmp/inspector-capture
    rm -rf "$cap" && mkdir -p "$cap"
    capture() {  # NAME ARGS...: one small run of the inspector configuration, with NCCL's INFO lines beside it
        local name=$1
        shift
        mkdir -p "$cap/$name"
        python3 bench/signal_cost.py --configs inspector --inspector-so "$so" --warmup-rounds 0 --label "$label" \
            --inspector-env NCCL_DEBUG=INFO --inspector-env NCCL_DEBUG_SUBSYS=INIT,COLL,PROFILE \
            --inspector-env "NCCL_DEBUG_FILE=$cap/$name/nccl.%h.%p" \
            --work "$cap/$name" --out "$cap/$name.jsonl" "$@" >"$cap/$name.out" 2>&1
        echo "== capture $name: exit $? at ${SECONDS} s" | tee -a "$log"
    }
    # Together (none of them is a measurement): FSDP2 x TP (dp, tp and world communicators) in verbose JSON;
    # tiny all_reduces with Inspector's default 8 KiB floor (1 KiB ones are not recorded); Prometheus text,
    # which Inspector writes at start and then every 30 s at most, so that job runs 65 s and is then stopped.
    capture fsdp2_tp_json --workload fsdp2_tp --nproc 4 --rounds 2 --steps 3 \
        --inspector-env NCCL_INSPECTOR_DUMP_VERBOSE=1 &
    capture allreduce_json --workload allreduce --rounds 2 --ops 200 --sync-ops 50 \
        --inspector-env NCCL_INSPECTOR_DUMP_MIN_SIZE_BYTES=8192 &
    capture fsdp2_tp_prom --workload fsdp2_tp --nproc 4 --rounds 1000 --steps 5 --budget 65 --exit-timeout 5 \
        --inspector-env NCCL_INSPECTOR_PROM_DUMP=1 \
        --inspector-env NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS=30000000 &
    wait
    tar czf "$OUT/inspector-capture.tar.gz" -C "$cap" .
fi

# What is left: a third to the worst case, the rest (less a minute to stop and copy back) to FSDP2 x TP.
worst=$(((total - SECONDS) / 3))
GPU_SH_INSTALLED=1 bash bench/gpu.sh signal_cost --workload allreduce --nproc 2 --rounds 10 --ops 2000 \
    --sync-ops 500 --budget "$worst" --label "$label" ${so:+--inspector-so "$so"}
echo "== allreduce done at ${SECONDS} s" | tee -a "$log"
GPU_SH_INSTALLED=1 bash bench/gpu.sh signal_cost --workload fsdp2_tp --nproc 4 --rounds 8 --steps 10 \
    --budget "$((total - SECONDS - 60))" --label "$label" ${so:+--inspector-so "$so"}
echo "== fsdp2_tp done at ${SECONDS} s" | tee -a "$log"
