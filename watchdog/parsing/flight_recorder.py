"""PyTorch Flight Recorder dumps (pickle or JSON, versions 1.4-2.10) -> ``FrDump``.

A dump is what one process writes to ``<prefix><global rank>``
(``TORCH_FR_DUMP_TEMP_FILE``, default ``/tmp/nccl_trace_rank_``) on a
timeout or on demand: a pickle of plain types made by ``torch::jit::Pickler``
(protocol 2), or, from ``_dump_nccl_trace_json`` / ``_dump_fr_trace_json``,
the same content as JSON.  Top level: ``version``, ``pg_config``,
``pg_status``, ``comm_lib_version`` and ``entries``, one per operation in
recording order (a ring buffer, so the oldest ones may be gone).

What changed between versions (PyTorch's ``TraceUtils.h``, ``NCCLUtils.hpp``,
``FlightRecorder.hpp`` and ``FlightRecorderDetail.hpp`` at each version; the
analyzer ``torch/distributed/flight_recorder/components/``):

====  =====================================================================
<1.4  refused: 1.0 (PR #118046) put a dict with ``version`` around the bare
      list of entries, 1.1 (PR #119249) added ``time_discovered_*``; no
      ``record_id``/``op_id``/``pg_config`` yet.
1.4   entries: ``record_id, pg_id, seq_id, op_id, profiling_name,
      time_created_ns, [duration_ms], input_sizes, output_sizes, state,
      time_discovered_started_ns, time_discovered_completed_ns, retired,
      frames``; ``pg_config`` is ``{pg uid (int): [global ranks]}``;
      ``entries`` is the first key of the dict.
2.0   ``seq_id`` split into ``collective_seq_id`` and ``p2p_seq_id``; new
      ``process_group`` (a tuple ``(name, desc)``), ``is_p2p``,
      ``input_dtypes``, ``output_dtypes`` (then ``dtype().name()``:
      ``"float"``; later ``c10::toString``: ``"Float"``); ``pg_config``
      becomes ``{name: {"name", "desc", "ranks": "[0, 1]"}}`` (a string).
2.2   ``timeout_ms``; ``version`` first; ``entries`` and ``frames`` may be
      left out (``includeCollectives`` / ``includeStackTraces``).
2.3   ``pg_status``: ``{pg uid (str): {last_enqueued_collective,
      last_started_collective, last_completed_collective}}``; JSON dumps.
2.6   ``nccl_version`` at top level (PR #151048).
2.7   entries for slow-path coalesced collectives too, not only p2p.
2.10  ``comm_lib_version`` replaces ``nccl_version``; entries carry
      ``thread_id`` and ``thread_name`` (which of 2.8-2.10 added each is
      not pinned down; 2.10 has both, as the fixture shows).
====  =====================================================================

The JSON variant spells a few things differently: ``process_group`` is a
list, ``pg_status`` values are strings (``"-1"``), an undiscovered time is
``0`` instead of ``None``, entries carry no ``frames``, and ``entries`` is
absent when there are none.

Failure modes, by design: ``parse_flight_recorder`` never raises.  Empty,
truncated, corrupt or foreign input, a version outside what is known, and
any unexpected exception become one ``Unusable`` with a sentence saying
why.  A field of the wrong type inside an otherwise sound dump becomes
``None``/empty rather than failing the file.

Bounded work and memory, on any input (a pickle's memo lets a few bytes
stand for a reference to an object already built, so a 4 MB file can
describe two million entries).  Refused with a sentence, before the cost is
paid: a pickle over ``MAX_PICKLE_BYTES`` or with more than
``MAX_PICKLE_OPCODES`` opcodes (counted while they are checked, nothing
built); JSON over ``MAX_JSON_BYTES``; more than ``MAX_ENTRIES`` entries (a
real buffer holds ``TORCH_FR_BUFFER_SIZE`` of them, 2000 by default); and a
dump whose tree, each shared object counted once per reference and long
strings by their length, exceeds ``MAX_TREE_COST`` (``_check_tree``).  A
real 2000-entry dump costs a tenth of each bound.

Security: dumps come from user files and are never given to plain
``pickle.loads``.  Their opcodes are walked first (``_check_opcodes``): any
opcode that imports or calls (``GLOBAL``, ``REDUCE``...) refuses the file, as
does a memo index larger than the file (a corrupt one makes the C unpickler
allocate gigabytes).  Only then are they unpickled with ``_PlainUnpickler``,
which refuses every global again.  A real dump holds only dicts, lists,
tuples, strings, numbers, booleans and ``None``.

This module does not import torch.
"""

from __future__ import annotations

import io
import json
import pickle
import pickletools
import re
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

from ncclwatch.watchdog.events import (
    Citation,
    Event,
    FrDump,
    FrEntry,
    FrFrame,
    FrProcessGroup,
    OpState,
    Unusable,
)

OLDEST_VERSION = (1, 4)
NEWEST_KNOWN_VERSION = (2, 10)

# Bounds (module docstring).  The real 2-GPU dump: 132 entries, 35 KB, 13,600 opcodes, tree cost ~20,000.
MAX_PICKLE_BYTES = 32 << 20
MAX_JSON_BYTES = 8 << 20  # JSON has no memo, but each "[]," is a 64-byte object: 8 MB is ~150 MB built
MAX_PICKLE_OPCODES = 2_000_000  # an object built per opcode is ~64 bytes: ~130 MB at most
MAX_ENTRIES = 20_000
MAX_TREE_COST = 2_000_000
_STRING_COST_CHARS = 16  # a string costs 1 + len // 16: parsing copies names, so shared long strings count

_SNIFF_LIMIT = 64 * 1024
_TOP_KEYS = (b"version", b"entries", b"pg_config")
# A dict key as the pickler writes it: BINUNICODE (torch, protocol 2),
# SHORT_BINUNICODE (Python, protocol 4+) or SHORT_BINSTRING.
_PICKLE_KEY_TOKENS = tuple(
    prefix + key
    for key in _TOP_KEYS
    for prefix in (
        b"X" + len(key).to_bytes(4, "little"),
        b"\x8c" + bytes([len(key)]),
        b"U" + bytes([len(key)]),
    )
)
# JSON dumps sort their keys ("comm_lib_version", "entries", ..., "version"),
# and "version" alone also names other tools' JSON: ask for a key only a
# Flight Recorder dump has.  NCCL RAS JSON has "nccl_version", never these.
_JSON_KEY_TOKENS = (b'"entries"', b'"pg_config"', b'"pg_status"')

_DUMP_EXTENSIONS = (".pkl", ".pickle", ".json")
_RANK_SUFFIX = re.compile(r"(\d+)$")
_P2P_NAME = re.compile(r"(\d+)\s*(->|<-)\s*(\d+)")
_STATE_ORDER = {OpState.enqueued: 0, OpState.scheduled: 1, OpState.started: 2, OpState.completed: 3}
_STATE_NAMES = frozenset(state.value for state in OpState)

# profiling_name -> NCCL's spelling.  Names are "<backend>:<op>[ <p2p>]"
# with backend nccl, gloo, xccl, ucc, ncclx...  Seen in libtorch_cuda.so of
# torch 2.11 (nccl:*), libtorch_cpu.so of torch 2.13 (gloo:*) and the
# analyzer's COLLECTIVES set (torch/distributed/flight_recorder/components/types.py).
_OPS = {
    name: op
    for op, names in {
        # allreduce_coalesced is one group of all-reduces, a real op, not a marker
        "AllReduce": "all_reduce allreduce allreduce_coalesced sparse_all_reduce",
        "AllGather": "all_gather allgather _all_gather_base _allgather_base all_gather_into_tensor "
        "all_gather_into_tensor_coalesced allgather_into_tensor_coalesced allgather_coalesced "
        "all_gather_single all_gather_v",
        "ReduceScatter": "reduce_scatter _reduce_scatter_base reduce_scatter_tensor "
        "reduce_scatter_tensor_coalesced reduce_scatter_single reduce_scatter_v",
        "Broadcast": "broadcast _broadcast_oop broadcast_coalesced",
        "Reduce": "reduce _reduce_oop",
        "AlltoAll": "all_to_all alltoall alltoall_base all_to_all_single all_to_all_v_single",
        "Send": "send",
        "Recv": "recv recvanysource",
        "Gather": "gather",
        "Scatter": "scatter",
        "Barrier": "barrier all_reduce_barrier",  # NCCL's barrier is a 1-element all-reduce
        "Coalesced": "coalesced",
    }.items()
    for name in names.split()
}
_UPPER_COALESCED_MARKER = re.compile(r"[A-Z_]+_coalesced")  # "ALLGATHER_coalesced"


# Opcodes that import or call: never in a dump (plain types need none).
_CODE_OPCODES = frozenset(
    [
        "GLOBAL",
        "STACK_GLOBAL",
        "REDUCE",
        "BUILD",
        "INST",
        "OBJ",
        "NEWOBJ",
        "NEWOBJ_EX",
        "EXT1",
        "EXT2",
        "EXT4",
        "PERSID",
        "BINPERSID",
        "NEXT_BUFFER",
        "READONLY_BUFFER",
    ]
)
_MEMO_OPCODES = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})


class _DumpError(ValueError):
    """A dump that cannot be used; the message is the operator's sentence."""


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain types only: every global and persistent id is refused.

    A Flight Recorder dump is made of dicts, lists, tuples, strings, numbers,
    booleans and ``None``, none of which needs ``find_class``; anything that
    asks for a global (``os.system``, ``builtins.eval``, a torch class) is not
    a dump, and refusing it here is what keeps a crafted file from running code.
    """

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused persistent id")


# --------------------------------------------------------------------------
# Sniffing
# --------------------------------------------------------------------------


def looks_like_flight_recorder(head: bytes) -> bool:
    """Whether the first bytes of a file are a Flight Recorder dump.

    A pickle: the protocol header (``\\x80`` and a protocol byte 2-5), an
    optional frame, an empty dict, and one of the top-level keys
    ``version``/``entries``/``pg_config`` as the pickler encodes them within
    the first 64 KiB.  JSON: an object holding ``"entries"``, ``"pg_config"``
    or ``"pg_status"``.  Cheap, and never raises: anything odd is ``False``.
    """
    try:
        window = bytes(head[:_SNIFF_LIMIT])
        return _looks_like_pickle(window) or _looks_like_json(window)
    except Exception:  # noqa: BLE001 - a sniffer must never raise
        return False


def _looks_like_pickle(head: bytes) -> bool:
    if len(head) < 3 or head[0] != 0x80 or not 2 <= head[1] <= 5:
        return False
    pos = 2
    if head[pos] == 0x95:  # FRAME opcode + 8-byte length (Python, protocol 4+)
        pos += 9
    if head[pos : pos + 1] != b"}":  # EMPTY_DICT: the dump is a dict
        return False
    return any(token in head for token in _PICKLE_KEY_TOKENS)


def _looks_like_json(head: bytes) -> bool:
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    return text[:1] == b"{" and any(token in text for token in _JSON_KEY_TOKENS)


# --------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------


def parse_flight_recorder(data: bytes, name: str) -> list[Event]:
    """One dump -> ``[FrDump]``, or ``[Unusable]`` saying why it cannot be read.

    ``name`` is the file's name: it goes into the citation, and its trailing
    integer is the global rank (dumps are written to ``<prefix><rank>``);
    without one, the rank is inferred from p2p entries (``send 0->1`` on the
    default group is rank 0), else ``None``.  Never raises.
    """
    cite = Citation(file=name)
    try:
        raw = _load(bytes(data))
        return [_build_dump(raw, name, cite)]
    except _DumpError as err:
        return [Unusable(reason=str(err)[:500], cite=cite)]
    except Exception as err:  # noqa: BLE001 - one bad file must not stop the rest
        reason = f"unreadable Flight Recorder dump ({type(err).__name__}: {err})"
        return [Unusable(reason=reason[:500], cite=cite)]


def _load(data: bytes) -> dict[Any, Any]:
    """Bytes -> the dump's top-level dict, through the restricted unpickler or JSON.

    Raises ``_DumpError`` for empty, truncated, foreign and malicious input.
    """
    if not data.strip():
        raise _DumpError("empty file: no Flight Recorder dump in it")
    if data[0] == 0x80:
        _refuse_larger(data, MAX_PICKLE_BYTES, "pickle")
        raw = _load_pickle(data)
    elif data.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] in (b"{", b"["):
        _refuse_larger(data, MAX_JSON_BYTES, "JSON")
        raw = _load_json(data)
    else:
        raise _DumpError("not a Flight Recorder dump: neither a pickle nor JSON")
    if isinstance(raw, list):
        raise _DumpError(
            "not a Flight Recorder dump: the top level is a list, not a dict "
            "(only unversioned dumps from before 1.0 were bare lists)"
        )
    if not isinstance(raw, dict):
        raise _DumpError(f"not a Flight Recorder dump: the top level is a {type(raw).__name__}")
    if not any(key in raw for key in ("version", "entries", "pg_config")):
        raise _DumpError("not a Flight Recorder dump: no 'version', 'entries' or 'pg_config' key")
    return raw


def _refuse_larger(data: bytes, limit: int, kind: str) -> None:
    if len(data) > limit:
        raise _DumpError(
            f"refused: a {len(data) / 1e6:.1f} MB Flight Recorder {kind}, over the {limit >> 20} MiB a real dump "
            "stays under (a full 2000-entry buffer with stacks is a few MB); not read, to bound memory"
        )


def _load_pickle(data: bytes) -> Any:
    _check_opcodes(data)
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as err:
        if "refused" in str(err):
            raise _DumpError(
                f"refused to unpickle: the file asks for code ({err}); a Flight Recorder dump holds plain data only"
            ) from None
        raise _DumpError(f"truncated or corrupt pickle ({err})") from None
    except (EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError) as err:
        # EOFError "Ran out of input" is the usual sign of a dump cut short
        # (the writer was killed mid-write); the others come from garbage.
        raise _DumpError(f"truncated or corrupt pickle ({type(err).__name__}: {err})") from None


def _check_opcodes(data: bytes) -> None:
    """Walk the pickle's opcodes, building nothing; ``_DumpError`` on code or corruption.

    Two guards the C unpickler lacks.  It trusts memo indices: one flipped
    byte in a ``LONG_BINPUT`` of the real fixture asked it to grow its memo to
    a billion slots (25 s and gigabytes before it failed); an index can never
    exceed the pickle's length.  And refusing every opcode that can call code
    here means a crafted file is turned away before any object is made
    (``_PlainUnpickler.find_class`` refuses globals again, behind this).
    """
    limit = len(data)
    try:
        for count, (opcode, arg, _) in enumerate(pickletools.genops(io.BytesIO(data))):
            if count >= MAX_PICKLE_OPCODES:
                raise _DumpError(
                    f"refused: more than {MAX_PICKLE_OPCODES:,} pickle opcodes, far beyond a real Flight Recorder "
                    "dump (about 100 per entry); not unpickled, to bound memory and time"
                )
            if opcode.name in _CODE_OPCODES:
                what = f"{opcode.name} {arg}" if arg is not None else opcode.name
                raise _DumpError(
                    f"refused to unpickle: the file asks for code ({what}); "
                    "a Flight Recorder dump holds plain data only"
                )
            if opcode.name in _MEMO_OPCODES and not (isinstance(arg, int) and 0 <= arg <= limit):
                raise _DumpError(f"truncated or corrupt pickle (memo index {arg} in {limit} bytes)")
    except _DumpError:
        raise
    except Exception as err:  # noqa: BLE001 - genops raises ValueError and others on garbage
        raise _DumpError(f"truncated or corrupt pickle ({err})") from None


def _load_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _DumpError(f"truncated or corrupt JSON ({err})") from None


def _check_tree(raw: Any) -> None:
    """``_DumpError`` when reading the dump would touch more than ``MAX_TREE_COST`` values.

    Walks what the build below will read, as a tree: an object the memo
    shares is counted once per reference, the way the build would convert it
    each time (2000 entries sharing one list of 250,000 frames would make 500
    million frames).  The walk stops as soon as the budget is spent, so its
    own cost is bounded too; a cycle just spends the budget.
    """
    stack = [raw]
    cost = 0
    while stack:
        node = stack.pop()
        cost += 1
        if isinstance(node, str):
            cost += len(node) // _STRING_COST_CHARS
        elif isinstance(node, Mapping):
            cost += 2 * len(node)
            if cost <= MAX_TREE_COST:
                stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            cost += len(node)
            if cost <= MAX_TREE_COST:
                stack.extend(node)
        if cost > MAX_TREE_COST:
            raise _DumpError(
                f"refused: reading this dump means more than {MAX_TREE_COST:,} values (shared objects counted once "
                "per use), far beyond a real Flight Recorder dump; crafted or corrupt, not read"
            )


def _check_version(raw: Mapping[Any, Any]) -> str:
    """The dump's version string; ``_DumpError`` when it is missing or unknown.

    Minor versions past 2.10 are read: PyTorch bumps the minor only when it
    adds fields ("minor when adding fields, major when changing existing
    fields", FlightRecorder.hpp), and unknown fields are ignored here.
    """
    version = raw.get("version")
    if version is None:
        raise _DumpError("Flight Recorder dump without a 'version' field: too old or not a dump")
    text = str(version).strip()
    match = re.fullmatch(r"(\d+)\.(\d+)", text)
    if match is None:
        raise _DumpError(f"unknown Flight Recorder dump version {text!r}")
    major_minor = (int(match[1]), int(match[2]))
    if major_minor < OLDEST_VERSION:
        raise _DumpError(f"Flight Recorder dump version {text} is older than 1.4, the oldest this parser reads")
    if major_minor[0] > NEWEST_KNOWN_VERSION[0]:
        raise _DumpError(
            f"unknown Flight Recorder dump version {text}: a new major version may change "
            "the meaning of fields (known: 1.4 to 2.10)"
        )
    return text


def _build_dump(raw: Mapping[Any, Any], name: str, cite: Citation) -> FrDump:
    """The top-level dict -> ``FrDump``; ``_DumpError`` when its shape is wrong."""
    version = _check_version(raw)
    raw_entries = raw.get("entries", [])  # absent: JSON with none, includeCollectives=False
    if not isinstance(raw_entries, list):
        raise _DumpError(f"'entries' is a {type(raw_entries).__name__}, not a list")
    if len(raw_entries) > MAX_ENTRIES:
        raise _DumpError(
            f"refused: {len(raw_entries):,} entries, more than the {MAX_ENTRIES:,} this reader takes (a real "
            "Flight Recorder buffer holds TORCH_FR_BUFFER_SIZE entries, 2000 by default); crafted or corrupt"
        )
    _check_tree(raw)
    entries: list[FrEntry] = []
    uid_to_name: dict[str, str] = {}
    descs: dict[str, str] = {}
    for index, raw_entry in enumerate(raw_entries):
        if not isinstance(raw_entry, Mapping):
            raise _DumpError(f"entries[{index}] is a {type(raw_entry).__name__}, not a dict")
        pg_name, desc, uid = _pg_identity(raw_entry)
        if uid is not None:
            uid_to_name.setdefault(uid, pg_name)
        if desc:
            descs.setdefault(pg_name, desc)
        entries.append(_entry(index, raw_entry, pg_name))
    entries = _undo_abort_completions(entries)
    groups = _process_groups(raw, entries, uid_to_name, descs)
    rank = _rank_from_name(name)
    if rank is None:
        rank = _rank_from_p2p(entries, groups)
    lib = raw.get("comm_lib_version", raw.get("nccl_version"))  # nccl_version in 2.6-2.7
    return FrDump(
        rank=rank,
        version=version,
        comm_lib_version=str(lib) if lib not in (None, "") else None,
        process_groups=groups,
        entries=entries,
        cite=cite,
    )


def _pg_identity(raw_entry: Mapping[Any, Any]) -> tuple[str, str | None, str | None]:
    """(group name, description, numeric uid as text) of one entry.

    Trap: an entry's ``pg_id`` is ``ProcessGroupNCCL::uid_``, a per-process
    counter, while ``pg_config`` is keyed by the group's *name* (the first
    element of ``process_group``) and ``pg_status`` by the uid again.  They
    coincide for the default group ("0" and 0) and often for the others, but
    not always; the name is the identity used here, as the analyzer does.
    Before 2.0 there is no ``process_group`` and the uid is all there is.
    """
    uid_value = raw_entry.get("pg_id")
    uid = str(uid_value) if uid_value is not None else None
    group = raw_entry.get("process_group")
    if isinstance(group, (list, tuple)) and group:
        desc = str(group[1]) if len(group) > 1 and group[1] is not None else None
        return str(group[0]), desc, uid
    if isinstance(group, str):
        return group, None, uid
    return (uid if uid is not None else "unknown"), None, uid


def _entry(index: int, e: Mapping[Any, Any], pg_name: str) -> FrEntry:
    """One raw entry -> ``FrEntry``; missing or mistyped fields become None/empty."""
    profiling_name = str(e.get("profiling_name", ""))
    op, _, peer = parse_profiling_name(profiling_name)
    flag = e.get("is_p2p")
    # Before 2.0 there is no is_p2p; the name always says it.
    is_p2p = (flag is True) or op in ("Send", "Recv")
    seq = e.get("collective_seq_id", e.get("seq_id"))  # seq_id before 2.0
    started = _time_ns(e.get("time_discovered_started_ns"))
    completed = _time_ns(e.get("time_discovered_completed_ns"))
    return FrEntry(
        index=index,
        record_id=_int(e.get("record_id")),
        pg_id=pg_name,
        collective_seq_id=_int(seq),
        p2p_seq_id=_int(e.get("p2p_seq_id")),
        op_id=_int(e.get("op_id")),
        profiling_name=profiling_name,
        op=op,
        is_p2p=is_p2p,
        peer=peer if is_p2p else None,
        input_sizes=_sizes(e.get("input_sizes")),
        output_sizes=_sizes(e.get("output_sizes")),
        input_dtypes=_dtypes(e.get("input_dtypes")),
        output_dtypes=_dtypes(e.get("output_dtypes")),
        state=_state(e.get("state"), started, completed),
        time_created_ns=_time_ns(e.get("time_created_ns")),
        time_started_ns=started,
        time_completed_ns=completed,
        duration_ms=_duration_ms(e.get("duration_ms")),
        timeout_ms=_int(e.get("timeout_ms")),
        retired=e.get("retired") if isinstance(e.get("retired"), bool) else None,
        frames=_frames(e.get("frames")),
    )


def _undo_abort_completions(entries: list[FrEntry]) -> list[FrEntry]:
    """Entries "completed" only because the communicator was aborted get back the state they had before it.

    What "completed" means (torch's ``FlightRecorderDetail.hpp``): the entry's
    CUDA *end event* has fired, found by ``update_state`` when the watchdog
    polls or when the dump is written.  It says the stream moved past the
    kernel, not that the data arrived.  When the watchdog times an op out it
    aborts the communicator (``ncclCommAbort``); NCCL's kernels then return
    early, the stream drains and every end event behind them fires, so a dump
    written after the abort (torch's own on a timeout, ours from a process
    still alive with TORCH_NCCL_ASYNC_ERROR_HANDLING=0/2) marks a ``recv`` whose
    peer never sent, and everything queued behind it, "completed".  A pipeline
    deadlock (both stages ``recv`` first) then reads as "all completed, no hang".

    The trace it leaves: an op found completed at or after its own timeout had
    run out (``time_discovered_completed_ns >= time_created_ns + timeout_ms``)
    was ended by the watchdog, since a live one would have been found within
    the watchdog's poll.  From the first such moment on, per process group, no
    completion is real: those entries are "started" if they were found started
    before it, else "scheduled".  Dumps without times or timeouts (gloo, before
    2.2) are left as they are.  Trap: with TORCH_NCCL_ASYNC_ERROR_HANDLING=0
    nothing is aborted, and an op that did finish after its timeout reads as
    pending from there on; torch reported that timeout itself.
    """
    aborted_at: dict[str, int] = {}
    for entry in entries:
        done, created, timeout = entry.time_completed_ns, entry.time_created_ns, entry.timeout_ms
        if entry.state is OpState.completed and None not in (done, created, timeout) and timeout > 0:
            if done >= created + timeout * 1_000_000:
                aborted_at[entry.pg_id] = min(done, aborted_at.get(entry.pg_id, done))
    if not aborted_at:
        return entries
    undone = []
    for entry in entries:
        moment = aborted_at.get(entry.pg_id)
        if moment is None or entry.state is not OpState.completed or (entry.time_completed_ns or 0) < moment:
            undone.append(entry)
            continue
        started = entry.time_started_ns is not None and entry.time_started_ns < moment
        undone.append(entry.model_copy(update={"state": OpState.started if started else OpState.scheduled}))
    return undone


def parse_profiling_name(profiling_name: str) -> tuple[str, int | None, int | None]:
    """``"nccl:send 0->1"`` -> (``"Send"``, own group rank 0, peer 1).

    The two numbers of a p2p name are group ranks, this process's first:
    ``send 0->1`` sends from 0 to 1, ``recv 0<-1`` receives on 0 from 1.
    Names that are not p2p give ``None`` for both.  An unknown op keeps its
    own name (what follows the backend prefix, without the p2p suffix).
    """
    rest = profiling_name.split(":", 1)[1] if ":" in profiling_name else profiling_name
    token, _, suffix = rest.strip().partition(" ")
    if _UPPER_COALESCED_MARKER.fullmatch(token):  # before the table: not "allgather_coalesced"
        op = "Coalesced"
    else:
        op = _OPS.get(token.lower(), token)
    match = _P2P_NAME.search(suffix)
    if match is None:
        return op, None, None
    return op, int(match[1]), int(match[3])


def _process_groups(
    raw: Mapping[Any, Any],
    entries: Sequence[FrEntry],
    uid_to_name: Mapping[str, str],
    descs: Mapping[str, str],
) -> dict[str, FrProcessGroup]:
    """``pg_config`` + ``pg_status`` (+ groups only the entries name) -> groups by name."""
    groups: dict[str, dict[str, Any]] = {}
    config = raw.get("pg_config")
    if isinstance(config, Mapping):
        for key, value in config.items():
            if isinstance(value, Mapping):  # 2.0+: {name: {name, desc, ranks}}
                pg = str(value.get("name", key))
                info = {"desc": _text(value.get("desc")), "ranks": _ranks(value.get("ranks"))}
            else:  # 1.4: {uid: [global ranks]}
                pg, info = str(key), {"ranks": _ranks(value)}
            if pg == "" and not info["ranks"]:
                continue  # gloo (torch 2.13) records one empty group: name "", ranks "[]"
            groups[pg] = {"pg_id": pg, **info}
    for entry in entries:
        groups.setdefault(entry.pg_id, {"pg_id": entry.pg_id})
    for pg, desc in descs.items():
        if not groups[pg].get("desc"):
            groups[pg]["desc"] = desc
    status = raw.get("pg_status")
    if isinstance(status, Mapping):
        for uid, values in status.items():
            if not isinstance(values, Mapping):
                continue
            # A uid no entry names is taken to be the group of the same name:
            # true of the default group, a guess for the others.
            pg = uid_to_name.get(str(uid), str(uid))
            group = groups.setdefault(pg, {"pg_id": pg})
            group["last_enqueued"] = _seq(values.get("last_enqueued_collective"))
            group["last_started"] = _seq(values.get("last_started_collective"))
            group["last_completed"] = _seq(values.get("last_completed_collective"))
    return {pg: FrProcessGroup(**fields) for pg, fields in groups.items()}


def _rank_from_name(name: str) -> int | None:
    """Trailing integer of the file name (after .pkl/.pickle/.json), else None."""
    base = PurePath(name).name
    for extension in _DUMP_EXTENSIONS:
        if base.lower().endswith(extension):
            base = base[: -len(extension)]
    match = _RANK_SUFFIX.search(base)
    return int(match[1]) if match else None


def _rank_from_p2p(entries: Sequence[FrEntry], groups: Mapping[str, FrProcessGroup]) -> int | None:
    """This process's global rank from its p2p names, default group first.

    ``send 0->1`` says this process is group rank 0; the group's ``ranks``
    turn that into a global rank.  The default group spans the world in rank
    order, so it needs no ``ranks``; another group without them says nothing.
    """
    default = next((pg for pg, g in groups.items() if g.desc == "default_pg"), "0")
    order = [default] + [pg for pg in groups if pg != default]
    for pg in order:
        ranks = groups[pg].ranks if pg in groups else []
        for entry in entries:
            if entry.pg_id != pg or not entry.is_p2p:
                continue
            _, own, _ = parse_profiling_name(entry.profiling_name)
            if own is None:
                continue
            if ranks:
                if own < len(ranks):
                    return ranks[own]
            elif pg == default:
                return own
    return None


# --------------------------------------------------------------------------
# Coalesced groups
# --------------------------------------------------------------------------


def effective_states(dump: FrDump) -> list[OpState]:
    """The state of each entry, with coalesced members given their marker's.

    Trap (seen in the real 2-GPU fixture, torch 2.11): p2p entries recorded
    inside a coalesced group (``batch_isend_irecv``) have no CUDA events of
    their own and stay ``scheduled`` forever, while the ``nccl:coalesced``
    entry that closes the group, with the same ``p2p_seq_id``, completes.
    From 2.7 slow-path coalesced collectives work the same way, keyed by
    ``collective_seq_id``.  A member's effective state is the later of its
    own and its marker's; entries outside a group keep their own.
    """
    states = [entry.state for entry in dump.entries]
    for position, marker in enumerate(dump.entries):
        if marker.op != "Coalesced":
            continue
        for member in _coalesced_members(dump.entries, position):
            if _STATE_ORDER[marker.state] > _STATE_ORDER[states[member]]:
                states[member] = marker.state
    return states


def _coalesced_members(entries: Sequence[FrEntry], position: int) -> list[int]:
    """Indices of the entries the marker at ``position`` closes.

    Walks back over the marker's group (other groups' entries, from other
    threads, are stepped over) while entries share its key: ``p2p_seq_id``
    for p2p members, ``collective_seq_id`` for collectives.  Trap: a p2p
    marker keeps the ``collective_seq_id`` of the collective before the
    group, so the kind of the nearest member decides which key counts.
    Before 2.0 there is one ``seq_id`` (one per kernel launch) for both.
    """
    marker = entries[position]
    members: list[int] = []
    p2p: bool | None = None
    for index in range(position - 1, -1, -1):
        entry = entries[index]
        if entry.pg_id != marker.pg_id:
            continue
        if entry.op == "Coalesced":
            break
        if p2p is None:
            p2p = entry.is_p2p
        if entry.is_p2p != p2p:
            break
        key = _group_key(entry, p2p)
        if key is None or key != _group_key(marker, p2p):
            break
        members.append(index)
    return members


def _group_key(entry: FrEntry, p2p: bool) -> int | None:
    if p2p and entry.p2p_seq_id is not None:
        return entry.p2p_seq_id
    return entry.collective_seq_id


# --------------------------------------------------------------------------
# Field coercion: a mistyped field is "not said", never an exception
# --------------------------------------------------------------------------


def _int(value: Any) -> int | None:
    """An int from an int or a decimal string (JSON's pg_status); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    return None


def _time_ns(value: Any) -> int | None:
    """A timestamp; JSON writes 0 (pickle None) for "not discovered"."""
    number = _int(value)
    return number if number is not None and number > 0 else None


def _duration_ms(value: Any) -> float | None:
    """``duration_ms`` (a float, only with TORCH_NCCL_ENABLE_TIMING); absent, zero or mistyped: None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if value > 0 else None


def _seq(value: Any) -> int | None:
    """A pg_status sequence number; -1 means "none yet" and becomes None.

    Trap: ``last_enqueued_collective`` holds the p2p sequence number when the
    last op was p2p (fixture: 16 while collective_seq_id is at 84).
    """
    number = _int(value)
    return number if number is not None and number >= 0 else None


def _text(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None


def _state(value: Any, started: int | None, completed: int | None) -> OpState:
    if isinstance(value, str) and value in _STATE_NAMES:
        return OpState(value)
    # No usable state: the discovery times say the same thing.
    if completed is not None:
        return OpState.completed
    return OpState.started if started is not None else OpState.scheduled


def _ranks(value: Any) -> list[int]:
    """``"[0, 1]"`` (2.0+) or ``[0, 1]`` (1.4) -> ``[0, 1]``; anything else -> []."""
    if isinstance(value, str):
        if not re.fullmatch(r"\s*\[[\d\s,-]*\]\s*", value):
            return []
        return [int(number) for number in re.findall(r"-?\d+", value)]
    if isinstance(value, (list, tuple)):
        return [number for number in map(_int, value) if number is not None]
    return []


def _sizes(value: Any) -> list[list[int]]:
    if not isinstance(value, (list, tuple)):
        return []
    return [
        [number for number in map(_int, shape) if number is not None]
        for shape in value
        if isinstance(shape, (list, tuple))
    ]


def _dtypes(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [str(item) for item in value if isinstance(item, str)]
    return []


def _frames(value: Any) -> list[FrFrame]:
    """Frames, innermost first, as dumped; JSON dumps have none."""
    if not isinstance(value, (list, tuple)):
        return []
    return [
        FrFrame(
            name=str(frame.get("name", "")),
            filename=str(frame.get("filename", "")),
            line=_int(frame.get("line")),
        )
        for frame in value
        if isinstance(frame, Mapping)
    ]


def collective_times(data: bytes) -> dict[tuple[str, int], int]:
    """(process group, collective number) -> when this rank enqueued it (ns): what tells two runs' dumps apart
    (``watchdog/provenance.py``), without building the entries (a quarter of the cost of ``parse_flight_recorder``).
    Empty for a dump that cannot be read; never raises."""
    try:
        raw = _load(bytes(data))
    except Exception:  # noqa: BLE001 - the ingest says why it cannot be read
        return {}
    times = {}
    for e in raw.get("entries") or ():
        if not isinstance(e, Mapping) or e.get("is_p2p") is True:
            continue
        seq, created = _int(e.get("collective_seq_id", e.get("seq_id"))), _time_ns(e.get("time_created_ns"))
        if seq is not None and created is not None:
            times[(_pg_identity(e)[0], seq)] = created
    return times


__all__ = [
    "NEWEST_KNOWN_VERSION",
    "OLDEST_VERSION",
    "collective_times",
    "effective_states",
    "looks_like_flight_recorder",
    "parse_flight_recorder",
    "parse_profiling_name",
]
