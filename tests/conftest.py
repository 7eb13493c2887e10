"""Shared paths and builders for the tests, and the test tiers.

Real captures live in the repository, so every clone runs every test:
``tests/fixtures/nccl-2.28.9-2gpu`` (2 x H200, torch 2.11, NCCL 2.28.9) and
``tests/fixtures/captures`` (made by ``tools/capture`` on H200s).

Every test under ``tests/e2e`` is marked ``e2e`` here, by its folder: ``pytest -m "not e2e"`` is the fast tier.
``serial`` tests bound a wall time or compare latencies; ``.ci/run`` runs them alone, after the parallel run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
E2E = REPO / "tests" / "e2e"
FIXTURES = REPO / "tests" / "fixtures"
CAPTURES = REPO / "tests" / "fixtures" / "captures"
DATA = REPO / "tests" / "data"
NOW = 1_795_301_250.0


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of ``tests/e2e`` ``e2e``.  Under pytest-xdist (``-n``) they go first: each runs a real job
    for up to a minute or two, mostly waiting on the job's clock, so started first they overlap the quick tests
    instead of leaving one worker to finish them alone."""
    for item in items:
        if item.path.is_relative_to(E2E):
            item.add_marker(pytest.mark.e2e)
    if hasattr(config, "workerinput"):  # an xdist worker: the controller hands out items in this order
        items.sort(key=lambda item: not item.path.is_relative_to(E2E))


def shared(*parts: str) -> Path:
    """A path in the real 2-GPU captures (once beside CI's checkout, now in tests/fixtures); missing fails."""
    path = FIXTURES.joinpath(*parts)
    assert path.exists(), f"fixture {path} is missing from the repository"
    return path


@pytest.fixture
def write(tmp_path: Path):
    """Write bytes or text to a file under tmp_path and return its path."""

    def _write(name: str, content: bytes | str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return path

    return _write


class Clock:
    """A settable clock for code that takes one (the sidecar): starts at NOW, moved by assigning ``now``."""

    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    """Poll ``predicate`` every 50 ms; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def stderr_at_end(processes: list[asyncio.subprocess.Process], timeout_s: float) -> list[str]:
    """Wait for each process (started with ``start_new_session=True``) to end; their stderr, decoded.

    Past ``timeout_s`` on any of them, every one still running has its whole session killed: a wrapper's
    torchrun and workers would otherwise outlive the test, holding its port and its folder.
    """
    try:
        return [
            (await asyncio.wait_for(process.communicate(), timeout_s))[1].decode(errors="replace")
            for process in processes
        ]
    finally:
        for process in processes:
            if process.returncode is None:
                os.killpg(process.pid, signal.SIGKILL)
