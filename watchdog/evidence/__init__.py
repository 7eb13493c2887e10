"""Evidence capture after a verdict: every collector writes into one bundle folder.

Bundle layout (paths relative to ``ctx.out_dir``)::

    evidence.json                     every record: name, paths, error, duration_s, rank, note
    fr/nccl_trace_rank_<r>            Flight Recorder dump on demand (torch's NCCL responder)
    fr/ncclwatch_trace_<r>            ... from ncclwatch's own responder (gloo)
    gpu/nvml.json                     one NVML snapshot with GPM
    ras/ras.txt, ras/ras.json         raw NCCL RAS reports (the JSON may be malformed)
    stacks/rank<r>.json               py-spy --nonblocking
    stacks/rank<r>.native.json        py-spy --native
    proc/rank<r>.txt                  state, wchan, /proc status/stat/io/cmdline, thread states (cmdline redacted)
    env/rank<r>.txt                   every variable's name; values of the allowlisted ones, redacted by value
    nccl/<name>                       tails of the NCCL debug files, redacted by value
    logs/rank<r>/<name>               tails of torchrun's worker logs, redacted by value
    ib/counters.json                  InfiniBand counters, two reads and their deltas
    <any of the per-rank paths>.missing   why that file is not there

Collectors, each usable alone: ``collect_flight_recorder``, ``collect_nvml``,
``collect_ras``, ``collect_stacks`` (= ``collect_python_stacks`` then
``collect_native_stacks``), ``collect_proc``, ``collect_env``,
``collect_nccl_logs``, ``collect_worker_logs``, ``collect_infiniband``;
``collect_all`` runs them in order within ``ctx.budget_s``.  What may hold a
credential (environment, command lines, log tails, cited lines) passes
through ``redact`` (allowlist, by name, by value).  Beside them,
``citations.resolve_citations`` turns a verdict's cited operations into
``file:line`` (the bundle's report and ``ncclwatch analyze``'s).
"""

from ncclwatch.watchdog.evidence.base import EvidenceContext, EvidenceRecord, RankTarget
from ncclwatch.watchdog.evidence.collect import EVIDENCE_JSON, collect_all
from ncclwatch.watchdog.evidence.flight_recorder import collect_flight_recorder
from ncclwatch.watchdog.evidence.logs import collect_nccl_logs, collect_worker_logs
from ncclwatch.watchdog.evidence.node import collect_infiniband, collect_nvml, collect_ras
from ncclwatch.watchdog.evidence.process import collect_env, collect_proc
from ncclwatch.watchdog.evidence.stacks import collect_native_stacks, collect_python_stacks, collect_stacks

__all__ = [
    "EVIDENCE_JSON",
    "EvidenceContext",
    "EvidenceRecord",
    "RankTarget",
    "collect_all",
    "collect_env",
    "collect_flight_recorder",
    "collect_infiniband",
    "collect_native_stacks",
    "collect_nccl_logs",
    "collect_nvml",
    "collect_proc",
    "collect_python_stacks",
    "collect_ras",
    "collect_stacks",
    "collect_worker_logs",
]
