#!/usr/bin/env bash
# Issue 44's failure matrix on a GPU machine (one GPU is enough), sized to one device call (about 480 s): jobs that
# die (a ValueError in the user's code, a real 1 PiB allocation, SIGKILL, PyTorch's own timeout, a dtype mismatch
# that NCCL's socket transport catches) and jobs the user ends (sys.exit(3), Ctrl-C) plus a healthy run, on rank 0
# and the last rank in turn.
#   bash bench/gpu_failures.sh            (BUDGET=300: start no run past 300 s in either lane)
# Two lanes at once on the same GPU(s): one node x 2 ranks (each rank its own NCCL_HOSTID: NCCL's socket transport,
# as between hosts) and two wrappers x 1 rank.  Rows and every wrapper's -v log are packed into $OUT/r.tar.gz every
# 30 s, so that a call cut short still brings back what ran.
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
common=(--size tiny --fault-steps 20 --fault-ranks 0,-1 --steps-after 40 --timeout 60 --pg-timeout-s 5
    --wrapper-arg=-v)
lane() {  # name, budget, scenarios, repeats, layout args
    local name=$1 budget=$2 scenarios=$3 repeats=$4
    shift 4
    OUT=$R/$name bash bench/gpu.sh faults "$@" "${common[@]}" --scenarios "$scenarios" --repeats "$repeats" \
        --budget "$budget" --out-dir "$R/$name" --name "$name" >"$R/$name/$name.out" 2>&1 &
}
lane n1 "${BUDGET:-440}" raise,oom,sigkill,pg_timeout,dtype,exit,interrupt,none 3 --nnodes 1 --nproc 2
lane w2 "${BUDGET:-440}" raise,sigkill,dtype,pg_timeout,exit 2 --nnodes 2 --nproc 1
wait -n
wait -n
kill "$packer" 2>/dev/null
pack
tail -n 30 "$R"/*/*.out
