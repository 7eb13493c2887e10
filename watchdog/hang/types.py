"""What the hang engine's rules return: a ``Finding`` with its facts, rank rows and culprits, and the ``Decision``
the classifier makes of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ncclwatch.watchdog.events import Citation, ProcKey
from ncclwatch.watchdog.hang.verdicts import Verdict


@dataclass(frozen=True)
class OpRef:
    """An operation to cite as file:line; resolved after the verdict (the state keeps no line numbers)."""

    file: str
    proc: ProcKey
    comm_ptr: str
    kind: Literal["coll", "Send", "Recv"]
    peer: int | None
    ordinal: int  # 0-based among this kind (and peer) on this communicator in this process


@dataclass(frozen=True)
class Fact:
    """One piece of a finding's evidence: what a source showed, and where (``evidence/`` collects files, not these)."""

    source: str
    fact: str
    cite: Citation | None = None
    op_ref: OpRef | None = None


@dataclass(frozen=True)
class RankStatus:
    """One rank's state on the finding's communicator (the report's ``RankRow`` adds the live fields)."""

    rank: int
    host: str | None
    pid: int | None
    issued: int | None
    last_op: str | None
    status: str
    detail: str = ""
    # The operation at the finding's position as Flight Recorder recorded its stack:
    # "all_reduce (...) <- main (train.py:71)"
    call_site: str | None = None


class CulpritProcess(BaseModel):
    """A culprit whose rank the input does not give (NCCL lines without Init lines or rank prefixes): ``host:pid``."""

    model_config = ConfigDict(frozen=True)

    host: str
    pid: int
    cuda_dev: int | None = Field(None, description="the CUDA device of its NCCL lines' prefix: a hint, not a rank")

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}" + (f" (GPU {self.cuda_dev})" if self.cuda_dev is not None else "")


@dataclass(frozen=True)
class Finding:
    verdict: Verdict
    summary: str
    reason: str = ""
    culprits: tuple[int, ...] = ()
    comm_key: str | None = None
    comm_label: str | None = None
    source: str | None = None
    position: int | None = None  # 1-based sequence number of the operation in its communicator
    operation: str | None = None
    evidence: tuple[Fact, ...] = ()
    missing: tuple[str, ...] = ()
    rows: tuple[RankStatus, ...] = ()
    # Culprits named only because their dump is absent: right when the live watchdog asked them
    # (they could not answer), no evidence when files were merely not given (``live_rules.unblame_absent``).
    absent: tuple[int, ...] = ()
    # Culprits known as processes only, where the input gives no rank (report: ``culprit_processes``).
    culprit_processes: tuple[CulpritProcess, ...] = ()
    # An even split no evidence decides: one of these sides is wrong, but not which (``culprits`` is empty then;
    # report: ``suspect_ranks``, so a hook or a drain can act on them).
    suspects: tuple[int, ...] = ()
    # A sub-kind of the verdict with words of its own (``verdicts.VerdictEntry.kinds``): "dtype", a
    # collective_mismatch whose sides called the same collective with the same count in different datatypes.
    kind: str | None = None


@dataclass(frozen=True)
class Decision:
    """The classifier's answer (``classify.classify``): the finding, and whether to page it now."""

    finding: Finding
    page: bool  # report and alert now
    held: str | None = None  # why a hang-like state is not paged yet
    blind: bool = False  # the probe could not see where the ranks are
