"""systemd/ncclwatch-server.service: verifies clean, names only real settings, tokens from credentials,
no capability; and ``ncclwatch serve`` starts from exactly its environment (credential files in place)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from test_systemd_units import INSTALLED, complaints, environment, needs_systemd_analyze, one, values, verify

from ncclwatch.watchdog.config import ENV_PREFIX, Settings

SERVER = REPO / "systemd" / "ncclwatch-server.service"


@needs_systemd_analyze
def test_verifies_clean(tmp_path: Path) -> None:
    binary = shutil.which("ncclwatch") or sys.executable
    (tmp_path / SERVER.name).write_text(SERVER.read_text().replace(INSTALLED, binary))
    proc = verify(tmp_path, SERVER.name)
    assert proc.returncode == 0 and not complaints(proc), proc.stdout + proc.stderr


def test_every_variable_is_a_real_setting_and_tokens_are_credentials() -> None:
    env = environment(SERVER)
    for name in env:
        assert name.removeprefix(ENV_PREFIX).lower() in Settings.model_fields, name
    assert values(SERVER, "LoadCredential") == [
        "token:/etc/ncclwatch/token",
        "upload-tokens:/etc/ncclwatch/upload-tokens",
    ]
    assert env[f"{ENV_PREFIX}TOKEN_FILE"] == "%d/token" and env[f"{ENV_PREFIX}UPLOAD_TOKEN_FILE"] == "%d/upload-tokens"
    assert one(SERVER, "CapabilityBoundingSet") == "" and one(SERVER, "ExecStart") == f"{INSTALLED} serve"


def test_serve_starts_from_the_units_environment(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "token").write_text("read-token\n")
    (creds / "upload-tokens").write_text("up-1\nup-2\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    for name, value in environment(SERVER).items():
        env[name] = value.replace("%d", str(creds)).replace("/var/lib/ncclwatch-server", str(tmp_path / "state"))
    env[f"{ENV_PREFIX}LISTEN"] = "127.0.0.1:0"
    process = subprocess.Popen(
        [sys.executable, "-m", "ncclwatch", "serve"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    try:
        assert "http://" in process.stdout.readline()  # type: ignore[union-attr]
        assert (tmp_path / "state" / "bundles" / ".incidents.sqlite").is_file()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
