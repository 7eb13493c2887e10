"""Where a rank's Python is, and which line of the user's own code led there.

Frames as py-spy spells them (short file names, relative to the process's
sys.path: the real capture in tests/fixtures) and as Flight Recorder does
(absolute paths).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ncclwatch.watchdog.events import Citation, StackDump, ThreadStack
from ncclwatch.watchdog.hang.stacks import is_user_frame, short_frame, split_frame, user_frame, whereabouts
from ncclwatch.watchdog.parsing.pyspy import parse_pyspy

CAPTURE = (
    Path(__file__).parents[1] / "fixtures" / "captures" / "nccl-2.28.9-h200x4" / "skip" / "pyspy" / "pyspy.1169.json"
)

# A rank in all_reduce, reached from the user's step() through the optimizer hook and a stdlib context manager.
FRAMES = [
    "all_reduce (/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:3252)",
    "wrapper (torch/distributed/c10d_logger.py:81)",
    "on_step (/work/ncclwatch/launcher/inject/sitecustomize.py:80)",
    "__exit__ (/usr/lib/python3.11/contextlib.py:144)",
    "step (train.py:105)",
    "main (train.py:140)",
    "<module> (train.py:150)",
]


def dump(*frames: str) -> StackDump:
    return StackDump(pid=7, threads=[ThreadStack(name="MainThread", frames=list(frames))], cite=Citation(file="py-spy"))


class TestUserFrame:
    def test_innermost_frame_outside_torch_stdlib_and_ncclwatch(self) -> None:
        assert user_frame(FRAMES) == "step (train.py:105)"

    @pytest.mark.parametrize(
        "frame",
        [
            "all_reduce (torch/distributed/distributed_c10d.py:3252)",  # py-spy, relative to site-packages
            "g (/home/u/.venv/lib/python3.11/site-packages/foo/x.py:1)",
            "g (/usr/lib/python3/dist-packages/foo/x.py:1)",
            "train (transformers/trainer.py:2000)",  # a framework's loop is not the user's line
            "wait (threading.py:320)",  # stdlib, py-spy's short name
            "run (concurrent/futures/thread.py:58)",
            "__exit__ (/root/.pyenv/versions/3.11.7/lib/python3.11/contextlib.py:144)",  # stdlib, absolute
            "<module> (<frozen runpy>:88)",
            "beat (/work/main/launcher/heartbeat.py:90)",  # ncclwatch's hook in the worker
            "on_step (sitecustomize.py:80)",
            "beat (ncclwatch/__init__.py:12)",
        ],
    )
    def test_library_frames_are_not_the_users(self, frame: str) -> None:
        assert not is_user_frame(frame)

    @pytest.mark.parametrize(
        "frame",
        [
            "step (train.py:105)",
            "main (/work/main/tools/capture/train.py:164)",
            "forward (mymodel/layers.py:9)",
            "step (/work/main/launcher/demo_job.py:80)",
        ],
    )
    def test_the_users_files_are(self, frame: str) -> None:
        assert is_user_frame(frame)

    def test_none_when_every_frame_is_a_library_frame(self) -> None:
        assert user_frame(FRAMES[:4]) is None

    def test_real_pyspy_capture_names_the_training_script(self) -> None:
        (stacks,) = [e for e in parse_pyspy(CAPTURE.read_bytes(), "capture") if isinstance(e, StackDump)]
        where = whereabouts(stacks)
        assert where.kind == "gpu_wait"
        assert where.frame == "synchronize (torch/cuda/__init__.py:1162)"
        assert where.user_frame == "main (train.py:167)"


class TestWhereabouts:
    def test_collective_keeps_the_torch_frame_and_adds_the_users(self) -> None:
        where = whereabouts(dump(*FRAMES))
        assert (where.kind, where.frame, where.user_frame) == ("collective", FRAMES[0], "step (train.py:105)")

    def test_python_elsewhere_is_its_own_user_frame(self) -> None:
        where = whereabouts(dump("step (train.py:105)", "main (train.py:140)"))
        assert (where.kind, where.frame, where.user_frame) == ("python", "step (train.py:105)", "step (train.py:105)")

    def test_unknown_without_frames(self) -> None:
        where = whereabouts(dump())
        assert (where.kind, where.frame, where.user_frame) == ("unknown", None, None)


class TestFrameText:
    def test_split_and_shorten_to_the_basename(self) -> None:
        assert split_frame(FRAMES[0]) == ("all_reduce", FRAMES[0][12:-6], "3252")
        assert short_frame(FRAMES[0]) == "all_reduce (distributed_c10d.py:3252)"

    def test_frame_without_a_line_keeps_its_file(self) -> None:
        assert split_frame("f (<string>)") == ("f", "<string>", "")
        assert short_frame("f (/a/b.py)") == "f (b.py)"
