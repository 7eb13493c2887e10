"""The run folders and the environment ``ncclwatch torchrun`` gives torchrun.

Layout of a run folder (``RunDirs``), every level mode 0o700 because the
dumps hold stack frames and a FIFO there lets whoever can write it make a
rank dump:

    <root>/nccl/   NCCL debug files, one per process (``%h.%p``)
    <root>/fr/     Flight Recorder dumps and the per-worker FIFOs
    <root>/hb/     heartbeats, ``<pid>.json`` (format in launcher/heartbeat.py)

What ``injected_env`` adds to the user's environment, and why.  A variable the
user already set is never replaced: their choice wins even where it costs us
evidence; the only merges are ``NCCL_DEBUG_SUBSYS`` and ``PYTHONPATH``.

``NCCL_DEBUG=INFO``
    NCCL prints one INFO line per enqueued operation and the communicator
    init/end lines: the per-rank operation sequence the detectors align.
``NCCL_DEBUG_SUBSYS=INIT,COLL,DESTROY,ENV`` (added to a user's list)
    INIT gives rank and communicator identity, COLL the operations, ENV
    the settings each process's NCCL read (``NCCL_IB_HCA set to ...``,
    ``NCCL_P2P_DISABLE set by environment to 1``; a few lines, once per
    process): the job's own values, even where a launch script or the
    training code set them after the wrapper started.  NCCL
    after 2.29 prints Destroy/Abort under its own DESTROY subsystem; without
    it a clean exit reads as "no end line".  Older NCCL parses the list with
    ``strtok`` and a chain of ``strcasecmp`` and skips a name it does not know
    (mask 0), and the newer option parser lists DESTROY, so the name is safe
    everywhere.  ``ALL`` and an inverted list (``^...``) are left alone: the
    first already has everything, and adding to the second would *remove*
    subsystems.
``NCCL_DEBUG_FILE=<nccl>/%h.%p``
    One file per process; NCCL expands only ``%h`` and ``%p`` (no rank), the
    sidecar learns ranks from the init lines.
``TORCH_FR_BUFFER_SIZE=2000``
    Flight Recorder on with the default depth even where it is off unless
    sized.  Set only if neither it nor its old name
    ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is.  Only the new name: with both, torch
    2.13 prints a deprecation warning in every rank, which would change the
    job's output.  A torch too old to know the new names needs the old ones
    set by the user.
``TORCH_FR_DUMP_TEMP_FILE=<fr>/nccl_trace_rank_``
    Where torch writes a dump: the file is this prefix plus the global rank.
    Set only if neither it nor ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` is, so a
    user's own location still wins.
``TORCH_NCCL_DEBUG_INFO_PIPE_FILE=<fr>/pipe_``
    Each NCCL rank makes the FIFO ``<prefix><rank>.pipe``; a byte written to
    it makes that rank dump while it keeps running (the sidecar's trigger).
``TORCH_NCCL_DUMP_ON_TIMEOUT=1``
    A rank whose collective times out dumps before it aborts.
``TORCH_NCCL_ENABLE_TIMING=1``
    CUDA start events, so Flight Recorder entries reach state ``started``:
    the rank whose collective started while others are only scheduled leads.
``NCCLWATCH_WRAPPER_PID=<pid>`` (when given)
    The wrapper, which the worker names its allowed tracer (Yama
    ``PR_SET_PTRACER``) so py-spy can read it under ``ptrace_scope=1``.
``NCCLWATCH_RUN_DIR=<root>``
    Tells the injected ``sitecustomize`` and ``ncclwatch.beat`` where to write.
``PYTHONPATH=<inject_dir>[:<user's value>]``
    Puts ``launcher/inject/sitecustomize.py`` first so Python runs it at start
    in torchrun and in every worker; it chains to the user's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ncclwatch.watchdog.live.runfolder import RunDirs

_SUBSYS_WANTED = ("INIT", "COLL", "DESTROY", "ENV")
_FR_SIZE_NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_FR_FILE_NAMES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def inject_dir() -> Path:
    """The folder put first on the workers' PYTHONPATH (holds ``sitecustomize.py``).

    It is deliberately not a package: Python finds ``sitecustomize`` as a
    top-level module on ``sys.path``.
    """
    return Path(__file__).resolve().parent / "inject"


def _extend_subsys(value: str | None) -> str:
    if value is None:
        return ",".join(_SUBSYS_WANTED)
    names = [name.strip() for name in value.split(",") if name.strip()]
    upper = {name.upper() for name in names}
    if value.strip().startswith("^") or "ALL" in upper:
        return value
    return ",".join(names + [want for want in _SUBSYS_WANTED if want not in upper])


def injected_env(user_env: Mapping[str, str], dirs: RunDirs, *, wrapper_pid: int | None = None) -> dict[str, str]:
    """The whole environment for torchrun: ``user_env`` plus what we add (see the module docstring).

    Pure: reads nothing but its arguments.
    """
    env = dict(user_env)
    defaults = {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_FILE": f"{dirs.nccl}/%h.%p",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{dirs.fr}/pipe_",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_TIMING": "1",
    }
    for name, value in defaults.items():
        env.setdefault(name, value)
    env["NCCL_DEBUG_SUBSYS"] = _extend_subsys(user_env.get("NCCL_DEBUG_SUBSYS"))
    # The new and old names are one setting: if the user gave either, torch
    # already has their value and a second one from us could contradict it.
    if not any(name in user_env for name in _FR_SIZE_NAMES):
        env[_FR_SIZE_NAMES[0]] = "2000"
    if not any(name in user_env for name in _FR_FILE_NAMES):
        env[_FR_FILE_NAMES[0]] = f"{dirs.fr}/nccl_trace_rank_"
    env["NCCLWATCH_RUN_DIR"] = str(dirs.root)
    if wrapper_pid is not None:
        env["NCCLWATCH_WRAPPER_PID"] = str(wrapper_pid)
    old_path = user_env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{inject_dir()}:{old_path}" if old_path else str(inject_dir())
    return env
