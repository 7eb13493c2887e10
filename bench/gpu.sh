#!/usr/bin/env bash
# Run the live-watchdog benchmarks on a GPU machine (the lent `device` machines:
# no package registry, wheels carried in .whl/). Results go to $OUT (default bench/out).
#   bash bench/gpu.sh latency [latency.py args...]
#   bash bench/gpu.sh overhead [overhead.py args...]
set -euo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import pydantic_settings, psutil, aiohttp" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(nvidia-smi -L | wc -l)
what=$1; shift
{
    echo "host $(hostname) gpus $NGPU $(python3 -c 'import torch;print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())')"
    case $what in
        latency) python3 bench/latency.py --nproc "$NGPU" --out "$OUT/latency.jsonl" "$@" ;;
        overhead) python3 bench/overhead.py --nproc "$NGPU" "$@" ;;
    esac
} 2>&1 | tee -a "$OUT/$what.log"
