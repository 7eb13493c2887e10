"""Shared paths and builders for the tests.

Real captures come first: ``../shared/fixtures`` (beside the checkout, as in
CI) and ``tests/fixtures/captures`` (made by ``tools/capture`` on H200s).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = Path(os.environ.get("NCCLWATCH_SHARED_FIXTURES", REPO.parent / "shared" / "fixtures"))
CAPTURES = REPO / "tests" / "fixtures" / "captures"
DATA = REPO / "tests" / "data"
NOW = 1_795_301_250.0


def shared(*parts: str) -> Path:
    path = SHARED_FIXTURES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared fixture {path} is not beside this checkout")
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


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    """Poll ``predicate`` every 50 ms; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
