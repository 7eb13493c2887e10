"""Where a rank's Python is, from a py-spy dump: inside a collective or not.

py-spy shows Python frames only; a collective entered from Python shows as a
frame of ``torch/distributed/distributed_c10d.py`` (``all_reduce``,
``barrier``...).  ``torch.cuda.synchronize`` is a wait on the GPU: a
collective only if Flight Recorder says one is pending (a long eval kernel
is not a hang), so it is its own kind.  DDP's
gradient all-reduces run inside autograd, so a rank stuck in one shows
``backward``: reported as such, and counted as "in a collective" only with
Flight Recorder's word for it.

Next to that frame each rank gets its ``user_frame``: the innermost frame of
the user's own code (not torch, not an installed package, not the standard
library, not ncclwatch), i.e. the line of the training script that led into
the collective.  Frames come in two spellings: py-spy's short file names,
relative to the process's ``sys.path`` (``torch/distributed/...``,
``threading.py``, ``train.py``: the ``site-packages/`` prefix is already
gone), and Flight Recorder's absolute paths.  Both are handled; a package
installed outside ``site-packages`` and not listed in ``LIBRARY_ROOTS``
reads as user code.  Pure functions.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from ncclwatch.watchdog.events import StackDump, ThreadStack

_C10D_FILES = ("distributed_c10d.py", "c10d_logger.py")
_GPU_WAITS = {"synchronize", "wait_stream", "wait_event"}
_BACKWARD = ("_engine_run_backward", "backward")
_INSTALLED = frozenset({"site-packages", "dist-packages"})
_STDLIB_DIR = re.compile(r"python\d(\.\d+)?$")  # /usr/lib/python3.11/threading.py
# py-spy --native frames live in shared objects (libc.so.6, libtorch_cpu.so): never the user's line
_SHARED_OBJECT = re.compile(r"\.so(\.\d+)*$")
# Top-level packages that py-spy shows relative to site-packages: library
# frames between the user's code and torch (a Trainer's loop is not the user's line).
LIBRARY_ROOTS = frozenset(
    {"torch", "torchvision", "torchaudio", "transformers", "accelerate", "deepspeed", "lightning",
     "pytorch_lightning", "apex", "triton", "numpy", "ncclwatch"}
)  # fmt: skip
# ncclwatch's own code in a worker: the injected sitecustomize and the heartbeat hook
# (an editable install keeps them under the repository's launcher/ folder; the
# demo's job, launcher/demo_job.py, is the demo user's code and stays in).
_OWN_SUFFIXES = ("launcher/heartbeat.py", "launcher/inject/sitecustomize.py")
CALL_ARROW = " <- "  # innermost frame <- the user's frame that led there


@dataclass(frozen=True)
class Whereabouts:
    kind: str  # "collective", "gpu_wait", "backward", "python", "unknown"
    frame: str | None  # the frame that says so, innermost relevant first
    user_frame: str | None = None  # the innermost frame of the user's own code (the line that led there)


def split_frame(frame: str) -> tuple[str, str, str]:
    """``"func (path:line)"`` -> (func, path, line); line is "" when the frame has none."""
    name, _, location = frame.partition(" (")
    location = location.removesuffix(")")
    path, colon, line = location.rpartition(":")
    return (name, path, line) if colon and line.isdigit() else (name, location, "")


def short_frame(frame: str) -> str:
    """``func (file.py:123)``: the file's basename only."""
    name, path, line = split_frame(frame)
    base = PurePosixPath(path).name or path
    return f"{name} ({base}:{line})" if line else f"{name} ({base})"


def is_user_frame(frame: str) -> bool:
    """Not torch, an installed package, the standard library, ncclwatch, a frozen/exec'd module or native code."""
    path = split_frame(frame)[1]
    if not path or path.startswith("<") or _SHARED_OBJECT.search(path):
        return False
    parts = PurePosixPath(path).parts
    if _INSTALLED & set(parts) or path.endswith(_OWN_SUFFIXES) or path == "sitecustomize.py":
        return False
    if path.startswith("/"):
        return not any(part == "lib" and _STDLIB_DIR.match(nxt) for part, nxt in zip(parts, parts[1:]))
    top = parts[0].removesuffix(".py")
    return top not in LIBRARY_ROOTS and top not in sys.stdlib_module_names


def user_frame(frames: Sequence[str]) -> str | None:
    """The innermost frame of the user's code (frames innermost first), None when there is none."""
    return next((f for f in frames if is_user_frame(f)), None)


def call_line(frames: Sequence[str]) -> str | None:
    """``all_reduce (torch/...:3252) <- step (train.py:105)``: the innermost frame, then the user's frame that led
    there; the frame alone when it is the user's or none is; None without frames."""
    if not frames:
        return None
    innermost, mine = frames[0], user_frame(frames)
    return innermost if mine is None or mine == innermost else f"{innermost}{CALL_ARROW}{mine}"


def main_thread(dump: StackDump) -> ThreadStack | None:
    """The thread that runs the training loop: MainThread, else one with frames, the active first."""
    threads = sorted(dump.threads, key=lambda t: (t.name != "MainThread", not t.frames, not t.active))
    return threads[0] if threads else None


def whereabouts(dump: StackDump | None) -> Whereabouts:
    thread = main_thread(dump) if dump is not None else None
    if thread is None or not thread.frames:
        return Whereabouts("unknown", None)
    mine = user_frame(thread.frames)
    for frame in thread.frames:  # innermost first
        name, _, location = frame.partition(" (")
        if any(f in location for f in _C10D_FILES) and not name.startswith("_") and name != "wrapper":
            return Whereabouts("collective", frame, mine)
        if name in _GPU_WAITS and "torch" in location:
            return Whereabouts("gpu_wait", frame, mine)
    for frame in thread.frames:
        if frame.partition(" (")[0] in _BACKWARD and "torch" in frame:
            return Whereabouts("backward", frame, mine)
    return Whereabouts("python", thread.frames[0], mine)
