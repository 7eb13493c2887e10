"""Where a rank's Python is, from a py-spy dump: inside communication (a collective, a send or recv) or not.

py-spy (as the sidecar runs it, without ``--native``) shows Python frames
only, so a wait is recognised by the innermost torch frame that issued it.
Seen on torch 2.13 gloo with py-spy 0.4.3 (``tests/fixtures/stacks``, made by
``tests/data/jobs/capture_stacks.py``):

- ``torch/distributed/distributed_c10d.py``: ``all_reduce``, ``barrier``...
  (a collective), ``send``/``recv`` and their ``*_object_list`` forms (a
  point-to-point op on a known side), ``isend``/``irecv``/``batch_isend_irecv``;
- ``torch/distributed/pipelining/schedules.py``: ``_wait_batch_p2p``, where
  every schedule waits for its batched sends and recvs (Schedule1F1B's stage
  0 waiting for stage 1 sits there); the side is not in the frame.  The
  only other wait there (read in the source) is ``_assert_unsharded``, an
  FSDP stage's unshard (an all-gather);
- ``torch/distributed/_functional_collectives.py``: ``wait_tensor``, where a
  functional collective's result is first used, and where DTensor's
  ``redistribute`` waits (``_redistribute.py`` -> ``AsyncCollectiveTensor.wait``);
- with ``--native`` (a dump given to ``analyze``): c10d's ``Work::wait``
  frames, ``SendWork``/``RecvWork`` saying the side.

Not recognisable from Python frames: ``work.wait()`` on an ``isend``/``irecv``
in the user's code (the innermost frame is the user's own line, as when it
sleeps), and a compiled graph's collective (inductor's generated ``call`` or
aot_eager's FX ``forward`` calls ``torch._ops``' dispatcher, which names no
op); their native frames are the ``Work::wait`` above.

``torch.cuda.synchronize`` is a wait on the GPU: a collective only if
Flight Recorder says one is pending (a long eval kernel is not a hang), so
it is its own kind.  DDP's gradient all-reduces run inside autograd, so a
rank stuck in one shows ``backward``: reported as such, and counted as "in
a collective" only with Flight Recorder's word for it.

Next to that frame each rank gets its ``user_frame``: the innermost frame of
the user's own code (not torch, not an installed package, not the standard
library, not ncclwatch, not code torch generated), i.e. the line of the
training script that led into the collective.  Frames come in two
spellings: py-spy's short file names, relative to the process's
``sys.path`` (``torch/distributed/...``, ``threading.py``, ``train.py``: the
``site-packages/`` prefix is already gone), and Flight Recorder's absolute
paths.  Both are handled; a package installed outside ``site-packages`` and
not listed in ``LIBRARY_ROOTS`` reads as user code.  Pure functions.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import PurePosixPath

from ncclwatch.watchdog.events import StackDump, ThreadStack

_C10D_FILES = ("distributed_c10d.py", "c10d_logger.py")
# distributed_c10d's point-to-point calls: the blocking ones name their side.  The others return a Work at once,
# except that NCCL builds a pair's communicator inside the first isend/irecv between them, and with a bound device
# (eager init) that is a split of the parent communicator, which waits for every rank of it: a rank seen in irecv
# at a stall is blocked there, on that side (H200, NCCL 2.28.9, torch 2.11: pipeline x data parallel, ranks 1 and 2
# recv first while 0 and 3 wait in the data-parallel all-reduce; ``recv`` is ``irecv(...).wait()`` since torch 2.5).
_P2P_SIDES = {
    "send": "send",
    "send_object_list": "send",
    "isend": "send",
    "recv": "recv",
    "recv_object_list": "recv",
    "irecv": "recv",
}
_P2P_ISSUES = frozenset({"batch_isend_irecv"})
# Waits issued by torch's own layers, (file, function) as py-spy names them (the function's last qualified part):
# the pipelining schedules' batched sends and recvs; functional collectives (DTensor's redistribute among them)
# and a pipelined FSDP stage's unshard.
_TORCH_P2P_WAITS = {("torch/distributed/pipelining/schedules.py", "_wait_batch_p2p")}
_TORCH_COLLECTIVE_WAITS = {
    ("torch/distributed/_functional_collectives.py", "wait_tensor"),
    ("torch/distributed/pipelining/schedules.py", "_assert_unsharded"),
}
# --native frames in libtorch: "c10d::ProcessGroupGloo::RecvWork::wait", "c10d::Work::wait", "c10d::wait_tensor"
_NATIVE_WAIT = re.compile(r"^c10d::(?:\w+::)*(?:\w*Work::wait|wait_tensor)$")
_NATIVE_SIDES = {"SendWork": "send", "RecvWork": "recv"}
IN_COMMUNICATION = frozenset({"collective", "p2p"})
_GPU_WAITS = {"synchronize", "wait_stream", "wait_event"}
_BACKWARD = ("_engine_run_backward", "backward")
_INSTALLED = frozenset({"site-packages", "dist-packages"})
_STDLIB_DIR = re.compile(r"python\d(\.\d+)?$")  # /usr/lib/python3.11/threading.py
# py-spy --native frames live in shared objects (libc.so.6, libtorch_cpu.so): never the user's line
_SHARED_OBJECT = re.compile(r"\.so(\.\d+)*$")
# Top-level packages that py-spy shows relative to site-packages: library
# frames between the user's code and torch (a Trainer's loop is not the user's line).
LIBRARY_ROOTS = frozenset(
    {
        "torch",
        "torchvision",
        "torchaudio",
        "transformers",
        "accelerate",
        "deepspeed",
        "lightning",
        "pytorch_lightning",
        "apex",
        "triton",
        "numpy",
        "ncclwatch",
    }
)
# Python that torch generated, as py-spy 0.4 names its file (short names): inductor's output code
# ("c7h466...gj.py", kept under /tmp/torchinductor_<user>/) and an FX graph module's forward
# ("proxy_tensor.py:1738 in wrapped", short for "<eval_with_key>.1 from .../proxy_tensor.py:1738 in wrapped").
_GENERATED = re.compile(r"(^|/)torchinductor_|(^|/)c[a-z0-9]{51}\.py$|^<eval_with_key>|\.py:\d+ in \w+$")
# ncclwatch's own code in a worker: the injected sitecustomize and the heartbeat hook
# (an editable install keeps them under the repository's launcher/ folder; the
# demo's job, launcher/demo_job.py, is the demo user's code and stays in).
_OWN_SUFFIXES = ("launcher/heartbeat.py", "launcher/inject/sitecustomize.py")
CALL_ARROW = " <- "  # innermost frame <- the user's frame that led there


@dataclass(frozen=True)
class Whereabouts:
    kind: str  # "collective", "p2p" (both IN_COMMUNICATION), "gpu_wait", "backward", "python", "unknown"
    frame: str | None  # the frame that says so, innermost relevant first
    user_frame: str | None = None  # the innermost frame of the user's own code (the line that led there)
    side: str | None = None  # "send" or "recv": the side of a point-to-point wait, where a frame says it


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


@lru_cache(maxsize=16384)  # the same few frames at every rank of a job, each judgement (8,192 ranks: 25 % of it)
def is_user_frame(frame: str) -> bool:
    """Not torch, an installed package, the standard library, ncclwatch, a frozen/exec'd module, code torch
    generated, or native code."""
    path = split_frame(frame)[1]
    if not path or path.startswith("<") or _SHARED_OBJECT.search(path) or _GENERATED.search(path):
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
    return _whereabouts(tuple(thread.frames))


# The ranks of a hung job mostly sit in a few stacks (every data-parallel rank at the same line): the leader of
# 1,024 nodes classified 8,192 stacks twice per hang, 40 % of its judging.
@lru_cache(maxsize=4096)
def _whereabouts(frames: tuple[str, ...]) -> Whereabouts:
    mine = user_frame(frames)
    native_kind, native_side, native_frame = _native_wait(frames)
    for frame in frames:  # innermost first
        name, path, _ = split_frame(frame)
        function = name.rpartition(".")[2]  # py-spy 0.4 on Python 3.11 qualifies methods: "Schedule1F1B.step"
        if any(f in path for f in _C10D_FILES) and not name.startswith("_") and name != "wrapper":
            if name in _P2P_SIDES or name in _P2P_ISSUES:
                return Whereabouts("p2p", frame, mine, _P2P_SIDES.get(name) or native_side)
            return Whereabouts("collective", frame, mine)
        if any(path.endswith(f) and function == w for f, w in _TORCH_P2P_WAITS):
            return Whereabouts("p2p", frame, mine, native_side)
        if any(path.endswith(f) and function == w for f, w in _TORCH_COLLECTIVE_WAITS):
            return Whereabouts("collective", frame, mine)
        if name in _GPU_WAITS and "torch" in path:
            return Whereabouts("gpu_wait", frame, mine)
    if native_kind is not None:
        return Whereabouts(native_kind, native_frame, mine, native_side)
    for frame in frames:
        if frame.partition(" (")[0] in _BACKWARD and "torch" in frame:
            return Whereabouts("backward", frame, mine)
    return Whereabouts("python", frames[0], mine)


def _native_wait(frames: Sequence[str]) -> tuple[str | None, str | None, str | None]:
    """(kind, side, frame) of the innermost c10d wait among ``--native`` frames; Nones without one."""
    for frame in frames:
        name = split_frame(frame)[0]
        if _NATIVE_WAIT.match(name):
            work = name.split("::")[-2]
            side = _NATIVE_SIDES.get(work)
            return ("p2p" if side else "collective"), side, frame
    return None, None, None
