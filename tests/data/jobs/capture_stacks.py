#!/usr/bin/env python3
"""Capture what py-spy shows of a rank waiting in each kind of communication: ``tests/fixtures/stacks/<wait>.json``.

For each ``--wait`` of ``comm_waits_job.py`` this runs the job (2 gloo
ranks under torchrun), waits for rank 0 to enter the wait, and dumps rank 0
twice: ``py-spy dump --json --nonblocking`` (what the live sidecar takes,
``watchdog/probes/pyspy.py``) into ``<wait>.json`` and ``py-spy dump --json
--native`` into ``<wait>.native.json``.  Then it releases rank 1, which posts
its side, and the job ends by itself.  Run from the repository root with the venv's
Python (py-spy beside it)::

    .venv/bin/python tests/data/jobs/capture_stacks.py [--wait schedule_1f1b ...]

Captured with torch 2.13.0+cpu, Python 3.11, py-spy 0.4.3.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from comm_waits_job import WAITS  # this folder is on sys.path when run as a script

HERE = Path(__file__).resolve().parent
OUT = HERE.parents[1] / "fixtures" / "stacks"
SETTLE_S = 2.0  # after rank 0 marks itself: it is inside the wait by then


def pyspy() -> str:
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise SystemExit("py-spy not found beside python or on PATH")
    return found


def capture(wait: str, hold_s: float, out: Path) -> None:
    with tempfile.TemporaryDirectory() as marks:
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                str(HERE / "comm_waits_job.py"),
                f"--wait={wait}",
                f"--hold={hold_s}",
                f"--mark-dir={marks}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        mark = Path(marks) / "waiting.0"
        deadline = time.monotonic() + hold_s
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not mark.exists():
            job.kill()
            raise SystemExit(f"{wait}: rank 0 never reached its wait: {job.communicate()[1][-2000:]}")
        time.sleep(SETTLE_S)
        pid = json.loads(mark.read_text())["pid"]
        for mode, suffix in (("--nonblocking", ".json"), ("--native", ".native.json")):
            dump = [pyspy(), "dump", "--pid", str(pid), "--json", mode]
            dumped = subprocess.run(dump, capture_output=True, text=True, timeout=30)
            if dumped.returncode != 0:
                raise SystemExit(f"{wait}: py-spy {mode} failed: {dumped.stderr}")
            (out / f"{wait}{suffix}").write_text(json.dumps(json.loads(dumped.stdout), indent=1) + "\n")
        (Path(marks) / "release").touch()
        _, stderr = job.communicate(timeout=120)
        if job.returncode != 0:
            raise SystemExit(f"{wait}: the job failed ({job.returncode}): {stderr[-2000:]}")
        print(f"{wait}: rank 0 (pid {pid}) -> {out / wait}.json, .native.json", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wait", action="append", choices=WAITS, help="default: every one")
    parser.add_argument("--hold", type=float, default=300.0, help="at most this long for rank 0 to reach its wait")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for wait in args.wait or WAITS:
        capture(wait, args.hold, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
