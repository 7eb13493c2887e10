"""nccl-tests' bandwidth formulas (``doc/PERFORMANCE.md``): ``algbw = S / t`` and ``busbw = algbw * factor``.

Here, in the root package, because both sides use them: the preflight ranks
(``launcher/preflight_job.py``, which must load nothing of the watchdog and
no pydantic) and the slowness engine (``watchdog/slowness/bandwidth.py``).
Standard library only.
"""

from __future__ import annotations

# nccl-tests' bus-bandwidth factor per collective, as a function of the rank count.
_FACTORS = {
    "AllReduce": lambda n: 2 * (n - 1) / n,
    "AllGather": lambda n: (n - 1) / n,
    "ReduceScatter": lambda n: (n - 1) / n,
    "AlltoAll": lambda n: (n - 1) / n,
    "Broadcast": lambda n: 1.0,
    "Reduce": lambda n: 1.0,
    "Send": lambda n: 1.0,
    "Recv": lambda n: 1.0,
}


def bus_factor(op: str, nranks: int) -> float | None:
    """nccl-tests' factor: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; others 1."""
    factor = _FACTORS.get(op)
    return None if factor is None or nranks < 1 else factor(nranks)


def algbw(nbytes: int, seconds: float) -> float | None:
    """Bytes per second moved by the collective as a whole; None for a zero or negative time."""
    return nbytes / seconds if seconds > 0 else None


def busbw(op: str, nbytes: int, nranks: int, seconds: float) -> float | None:
    """nccl-tests' bus bandwidth in bytes/s; None for an op without a factor or a zero time."""
    factor, alg = bus_factor(op, nranks), algbw(nbytes, seconds)
    return None if factor is None or alg is None else alg * factor
