"""End to end: a real hang under the real wrapper pages a real (loopback) PagerDuty-compatible receiver.

The receiver fails the first attempt (500), so delivery must retry; the
hang then resolves by itself (the ``straggle`` fault: a rank sleeps, then
goes on), which must send one ``resolve`` with the trigger's dedup key.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from receiver import Receiver, Reply
from support import E2E_TIMEOUT_S, demo, kill_leftovers, watched

pytest.importorskip("torch")


async def run_job(tmp_path: Path, receiver: Receiver) -> tuple[int, str]:
    env = dict(os.environ, NCCLWATCH_PAGERDUTY_ROUTING_KEY="test-routing-key", NCCLWATCH_PAGERDUTY_URL=receiver.url)
    job = demo("straggle", "--pause-s=14", "--steps=20", "--mark-dir", str(tmp_path))
    command = watched(tmp_path, job, "--stall-timeout", "4", run_dir=False)
    process = await asyncio.create_subprocess_exec(*command, env=env, cwd=tmp_path, stderr=asyncio.subprocess.PIPE)
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), E2E_TIMEOUT_S)
    finally:
        leftovers = kill_leftovers(tmp_path)
    assert not leftovers, f"processes outlived the wrapper: {leftovers}"
    return process.returncode, stderr.decode(errors="replace")  # type: ignore[return-value]


def test_hang_pages_once_with_retries_and_resolves_when_progress_returns(tmp_path: Path) -> None:
    async def scenario() -> tuple[int, str, list]:  # type: ignore[type-arg]
        async with Receiver(Reply(500), Reply(202)) as receiver:
            code, stderr = await run_job(tmp_path, receiver)
            return code, stderr, receiver.seen

    code, stderr, seen = asyncio.run(scenario())
    assert code == 0, stderr[-3000:]
    accepted = [json.loads(s.body) for s in seen if s.status == 202]
    actions = [a["event_action"] for a in accepted]
    assert actions == ["trigger", "resolve"], (actions, stderr[-2000:])
    trigger, resolve = accepted
    assert trigger["dedup_key"] == resolve["dedup_key"]
    assert trigger["routing_key"] == "test-routing-key"
    payload = trigger["payload"]
    assert payload["severity"] == "critical"
    assert "rank 2" in payload["summary"] and len(payload["summary"]) <= 1024
    assert payload["custom_details"]["verdict"] == "rank_behind"
    assert payload["custom_details"]["culprit_ranks"] == [2]
    assert payload["custom_details"]["bundle_url"].startswith("file://")
    assert seen[0].status == 500  # the first attempt failed and was retried
