"""Where a rank's Python is, from a py-spy dump: inside a collective or not.

py-spy shows Python frames only; a collective entered from Python shows as a
frame of ``torch/distributed/distributed_c10d.py`` (``all_reduce``,
``barrier``...).  ``torch.cuda.synchronize`` is a wait on the GPU: a
collective only if Flight Recorder says one is pending (a long eval kernel
is not a hang), so it is its own kind.  DDP's
gradient all-reduces run inside autograd, so a rank stuck in one shows
``backward``: reported as such, and counted as "in a collective" only with
Flight Recorder's word for it.  Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from ncclwatch.watchdog.events import StackDump, ThreadStack

_C10D_FILES = ("distributed_c10d.py", "c10d_logger.py")
_GPU_WAITS = {"synchronize", "wait_stream", "wait_event"}
_BACKWARD = ("_engine_run_backward", "backward")


@dataclass(frozen=True)
class Whereabouts:
    kind: str  # "collective", "gpu_wait", "backward", "python", "unknown"
    frame: str | None  # the frame that says so, innermost relevant first


def main_thread(dump: StackDump) -> ThreadStack | None:
    """The thread that runs the training loop: MainThread, else one with frames, the active first."""
    threads = sorted(dump.threads, key=lambda t: (t.name != "MainThread", not t.frames, not t.active))
    return threads[0] if threads else None


def whereabouts(dump: StackDump | None) -> Whereabouts:
    thread = main_thread(dump) if dump is not None else None
    if thread is None or not thread.frames:
        return Whereabouts("unknown", None)
    for frame in thread.frames:  # innermost first
        name, _, location = frame.partition(" (")
        if any(f in location for f in _C10D_FILES) and not name.startswith("_") and name != "wrapper":
            return Whereabouts("collective", frame)
        if name in _GPU_WAITS and "torch" in location:
            return Whereabouts("gpu_wait", frame)
    for frame in thread.frames:
        if frame.partition(" (")[0] in _BACKWARD and "torch" in frame:
            return Whereabouts("backward", frame)
    return Whereabouts("python", thread.frames[0])
