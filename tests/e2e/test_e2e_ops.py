"""End to end: during a real hung job the sidecar serves the bundle API and metrics on loopback.

The job (3 gloo ranks, one skips a collective) runs under the real wrapper
with ``--listen``; once the bundle exists, a real HTTP client lists it through
the API (with the token; 401 without) and scrapes ``/metrics``, which
prometheus-client's parser must read with the hang, the verdict and each
rank's heartbeat age in it.  SIGTERM then ends the job.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import demo, kill_leftovers, watched

pytest.importorskip("torch")
TOKEN = "e2e-secret-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_sidecar_serves_bundles_and_metrics_during_a_hang(tmp_path: Path) -> None:
    port = free_port()
    job = demo("skip", "--mark-dir", str(tmp_path))
    command = watched(tmp_path, job, "--listen", f"127.0.0.1:{port}", run_dir=False)
    env = {**os.environ, "NCCLWATCH_API_TOKEN": TOKEN}
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(command, stderr=stderr, cwd=tmp_path, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list((tmp_path / "bundles").glob("*.tar.gz")):
            time.sleep(0.5)
        assert list((tmp_path / "bundles").glob("*.tar.gz")), (tmp_path / "stderr.txt").read_text()[-3000:]
        assert get(f"{base}/api/bundles")[0] == 401
        status, body = get(f"{base}/api/bundles", TOKEN)
        assert status == 200
        bundles = json.loads(body)
        assert [(b["verdict"], b["culprit_ranks"]) for b in bundles] == [("collective_mismatch", [2])]
        status, body = get(f"{base}/metrics")
        assert status == 200
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
        }
        assert any(name == "ncclwatch_hang" and value == 1 for (name, _), value in samples.items())
        verdicts = [dict(labels) for (name, labels), _ in samples.items() if name == "ncclwatch_verdict_info"]
        assert verdicts and verdicts[0]["verdict"] == "collective_mismatch" and verdicts[0]["culprit_ranks"] == "2"
        ages = [labels for (name, labels), _ in samples.items() if name == "ncclwatch_heartbeat_age_seconds"]
        assert len(ages) == 3
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        leftovers = kill_leftovers(tmp_path)
    assert not leftovers, f"processes outlived the wrapper: {leftovers}"
