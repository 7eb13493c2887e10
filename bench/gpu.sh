#!/usr/bin/env bash
# Run the benchmarks on a lent GPU machine: no network, so the wheels the image
# lacks travel in the git-ignored .whl/ (pass it in the run tool's `carry`).
# Installs them and ncclwatch itself into /tmp/site (the repository on
# PYTHONPATH is not enough: it installs as one package, ncclwatch), logs the
# machine, then runs one benchmark.  Results go to $OUT (default bench/out).
#   bash bench/gpu.sh faults   [bench/fault_suite.py args...]
#   bash bench/gpu.sh overhead [bench/overhead_ab.py args...]
#   bash bench/gpu.sh latency  [bench/latency.py args...]   (the demo-job suite, one rank per GPU)
#   bash bench/gpu.sh slow_links [bench/slow_links.py args...]   (issue 14: preflight, straggler, slow link)
#   bash bench/gpu.sh restart  [bench/restart.py args...]   (issue 24: fault -> training again, the loop guard)
#   bash bench/gpu.sh hard     [bench/hard_cases.py args...]   (issue 23: FSDP2 even splits, pipelines across nodes)
#   bash bench/gpu.sh shapes   [bench/job_shapes.py args...]   (issue 30: DDP, FSDP2, TP, PP schedules, 2-D meshes)
#     (its throttle case needs pyroute2's wheel in .whl/: pip download --no-deps -d .whl pyroute2)
#   bash bench/gpu.sh signal_cost [bench/signal_cost.py args...]   (issue 45: each injected signal's cost)
# Several at once: the first call installs; start the others with GPU_SH_INSTALLED=1 once it has.
set -euo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
what=$1
shift
log="$OUT/$what.log"
# GPU_SH_INSTALLED=1: several benchmarks at once on one machine; the first call installs,
# the others must not rewrite /tmp/site under its running jobs.
if [ -z "${GPU_SH_INSTALLED:-}" ]; then
    # --upgrade: on a machine still warm from an earlier call, replace what is there (the code may have changed).
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    # --no-build-isolation builds with the image's setuptools; an image without one,
    # or with one older than 70.1 (which still needs the separate `wheel` package to
    # build a wheel), gets the carried wheel, on the build's path only (never the jobs').
    build_path=
    if ! python3 -c "import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split('.')[:2])) < (70, 1))" 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/build-tools .whl/build/setuptools-*.whl
        build_path=/tmp/build-tools
    fi
    PYTHONPATH=$build_path python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site .
fi
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
if ! command -v py-spy >/dev/null; then
    # Seen on the lent machines: pip --target left no bin/py-spy; the binary is the wheel's one script.
    mkdir -p /tmp/site/bin
    python3 - <<'PY'
import glob, os, zipfile
wheel = zipfile.ZipFile(glob.glob(".whl/py_spy-*.whl")[0])
name = next(n for n in wheel.namelist() if n.endswith("/scripts/py-spy"))
with open("/tmp/site/bin/py-spy", "wb") as out:
    out.write(wheel.read(name))
os.chmod("/tmp/site/bin/py-spy", 0o755)
PY
fi
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
    echo "== $(date -u +%FT%TZ) host $(hostname) nproc $(nproc) ${what} $*"
    nvidia-smi -L || echo "no nvidia-smi"
    python3 -c 'import sys, torch, ncclwatch.launcher.cli; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.is_available() and ".".join(map(str, torch.cuda.nccl.version())), "gpus", torch.cuda.device_count())'
    echo "py-spy $(py-spy --version 2>&1)"
} 2>&1 | tee -a "$log"
case $what in
    faults) script=bench/fault_suite.py ;;
    overhead) script=bench/overhead_ab.py ;;
    latency) script=bench/latency.py; set -- --nproc "$(nvidia-smi -L | wc -l)" --out "$OUT/latency.jsonl" "$@" ;;
    slow_links) script=bench/slow_links.py; set -- "$OUT/slow_links" "$@" ;;
    restart) script=bench/restart.py; set -- --out "$OUT/restart.jsonl" "$@" ;;
    hard) script=bench/hard_cases.py; set -- --out "$OUT/hard.jsonl" "$@" ;;
    shapes) script=bench/job_shapes.py; set -- --device cuda --out "$OUT/shapes.jsonl" "$@" ;;
    signal_cost) script=bench/signal_cost.py; set -- --out "$OUT/signal_cost.jsonl" "$@" ;;
    *) echo "unknown benchmark: $what (faults, overhead, latency, slow_links, restart, hard, shapes, signal_cost)" >&2; exit 2 ;;
esac
set +e
python3 "$script" "$@" 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
echo "== exit $status" | tee -a "$log"
exit "$status"
