"""The systemd units: ``systemd-analyze verify`` on copies, and the settings each unit must keep.

The agent's ExecStart names an installed path (/usr/local/bin/ncclwatch);
verify refuses a missing binary, so the copy points at this environment's
``ncclwatch`` (or the Python running the tests).  verify exits 0 after an
unknown key or a value it cannot parse ("ignoring"), so its output is
checked too, and a broken copy shows that it is.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from ncclwatch.watchdog.config import ENV_PREFIX, Settings

UNITS = REPO / "systemd"
AGENT = UNITS / "ncclwatch-agent.service"
JOB = UNITS / "ncclwatch-job@.service"
INSTALLED = "/usr/local/bin/ncclwatch"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
# Lines verify may print that depend on the host running the tests, not on the units.
TOLERATED = (
    re.compile(r"Failed to resolve (user|group) ['\"]?ncclwatch"),  # no ncclwatch user on a test machine
    re.compile(r"Unit [\w@.-]+\.target not found"),  # a minimal container without systemd's targets
)

needs_systemd_analyze = pytest.mark.skipif(not Path(SYSTEMD_ANALYZE).exists(), reason="systemd-analyze not installed")


def entries(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) in file order; repeated keys (Environment=) all kept."""
    out, section = [], ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def values(path: Path, key: str) -> list[str]:
    return [v for _, k, v in entries(path) if k == key]


def one(path: Path, key: str) -> str:
    found = values(path, key)
    assert len(found) == 1, f"{path.name}: {key}= {found}"
    return found[0]


def environment(path: Path) -> dict[str, str]:
    return dict(v.split("=", 1) for v in values(path, "Environment"))


def verify(unit_dir: Path, name: str) -> subprocess.CompletedProcess[str]:
    base = [SYSTEMD_ANALYZE, "verify", "--man=no"]
    proc = subprocess.run(
        [*base, "--recursive-errors=no", str(unit_dir / name)], check=False, capture_output=True, text=True, timeout=60
    )
    if "unrecognized option" in proc.stderr:  # systemd < 250
        proc = subprocess.run([*base, str(unit_dir / name)], check=False, capture_output=True, text=True, timeout=60)
    return proc


def complaints(proc: subprocess.CompletedProcess[str]) -> list[str]:
    lines = (proc.stdout + proc.stderr).splitlines()
    return [line for line in lines if line.strip() and not any(p.search(line) for p in TOLERATED)]


@pytest.fixture
def unit_dir(tmp_path: Path) -> Path:
    """Copies of the units, the agent's ExecStart pointing at a binary that exists here."""
    binary = shutil.which("ncclwatch") or sys.executable
    for unit in (AGENT, JOB):
        text = unit.read_text()
        if unit == AGENT:
            assert INSTALLED in text
            text = text.replace(INSTALLED, binary)
        (tmp_path / unit.name).write_text(text)
    return tmp_path


@needs_systemd_analyze
class TestVerify:
    def test_agent_verifies_clean(self, unit_dir):
        proc = verify(unit_dir, AGENT.name)
        print(proc.stdout, proc.stderr)
        assert proc.returncode == 0 and not complaints(proc), proc.stdout + proc.stderr

    def test_job_instance_verifies_clean(self, unit_dir):
        proc = verify(unit_dir, "ncclwatch-job@llama.service")
        print(proc.stdout, proc.stderr)
        assert proc.returncode == 0 and not complaints(proc), proc.stdout + proc.stderr

    def test_a_broken_unit_is_caught_even_when_verify_exits_0(self, unit_dir):
        path = unit_dir / AGENT.name
        path.write_text(path.read_text().replace("KillMode", "X").replace("NotifyAccess=main", "NotifyAcces=main"))
        proc = verify(unit_dir, AGENT.name)
        assert any("NotifyAcces" in line for line in complaints(proc)), proc.stdout + proc.stderr

    def test_a_missing_binary_is_caught(self, unit_dir):
        path = unit_dir / AGENT.name
        path.write_text(re.sub(r"(?m)^ExecStart=\S+", "ExecStart=/nonexistent/ncclwatch", path.read_text()))
        proc = verify(unit_dir, AGENT.name)
        assert proc.returncode != 0 and any("not executable" in line for line in complaints(proc))

    def test_agent_exposure_stays_low(self, unit_dir):
        proc = subprocess.run(
            [SYSTEMD_ANALYZE, "security", "--offline=true", "--no-pager", str(unit_dir / AGENT.name)],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
        if proc.returncode != 0 and not found:
            pytest.skip(f"systemd-analyze security --offline not available: {proc.stderr.strip()[:200]}")
        assert found and float(found.group(1)) < 4.0, proc.stdout[-2000:]


class TestAgent:
    def test_notify_watchdog_and_restart(self):
        assert one(AGENT, "Type") == "notify"
        assert one(AGENT, "NotifyAccess") == "main"
        assert one(AGENT, "WatchdogSec") == "30"
        assert one(AGENT, "Restart") == "on-failure"

    def test_serves_bundles_on_loopback_by_default_settings_in_the_environment(self):
        env = environment(AGENT)
        assert env[f"{ENV_PREFIX}BUNDLE_DIR"] == "/var/lib/ncclwatch/bundles"
        assert env[f"{ENV_PREFIX}LISTEN"] == "127.0.0.1:9464"
        assert one(AGENT, "ExecStart").split()[1:] == ["serve"]
        assert one(AGENT, "EnvironmentFile") == "-/etc/ncclwatch/agent.env"
        # The file comes after Environment=, so its values win (systemd.exec: files override Environment=).
        keys = [k for _, k, _ in entries(AGENT)]
        assert keys.index("EnvironmentFile") > max(i for i, k in enumerate(keys) if k == "Environment")

    def test_every_ncclwatch_variable_is_a_real_setting(self):
        for unit in (AGENT, JOB):
            for name in environment(unit):
                if name.startswith(ENV_PREFIX):
                    assert name.removeprefix(ENV_PREFIX).lower() in Settings.model_fields, f"{unit.name}: {name}"

    def test_token_comes_from_a_credential(self):
        assert one(AGENT, "LoadCredential") == "token:/etc/ncclwatch/token"
        assert environment(AGENT)[f"{ENV_PREFIX}TOKEN_FILE"] == "%d/token"

    def test_py_spy_can_attach(self):
        assert one(AGENT, "AmbientCapabilities") == "CAP_SYS_PTRACE"
        assert one(AGENT, "CapabilityBoundingSet") == "CAP_SYS_PTRACE"
        assert {"@system-service", "@debug"} <= set(one(AGENT, "SystemCallFilter").split())

    def test_nvml_still_sees_the_gpus(self):
        """Each of these narrows /dev (ProtectClock= implies DeviceAllow=char-rtc) and hides /dev/nvidia*."""
        keys = {k for _, k, _ in entries(AGENT)}
        assert not keys & {"PrivateDevices", "ProtectClock", "DevicePolicy", "DeviceAllow"}
        assert not keys & {"ProtectProc", "ProcSubset", "PrivateUsers"}  # other users' /proc, host capabilities

    def test_read_only_system_but_its_state_directory(self):
        assert one(AGENT, "ProtectSystem") == "strict"
        assert one(AGENT, "ReadWritePaths") == "/var/lib/ncclwatch"
        assert one(AGENT, "StateDirectory") == "ncclwatch"
        assert one(AGENT, "ProtectHome") == "read-only"
        assert one(AGENT, "NoNewPrivileges") == "yes"
        assert one(AGENT, "RestrictAddressFamilies").split() == ["AF_UNIX", "AF_INET", "AF_INET6"]
        assert one(AGENT, "LockPersonality") == "yes"

    def test_serve_subcommand_exists_when_written(self):
        from ncclwatch.launcher import cli

        if "serve" not in getattr(cli, "SUBCOMMANDS", ()):
            pytest.skip("ncclwatch serve is not written yet")
        proc = subprocess.run(
            [sys.executable, "-m", "ncclwatch", "serve", "--help"],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr


class TestJob:
    def test_runs_torchrun_through_the_wrapper_from_the_jobs_file(self):
        command = one(JOB, "ExecStart").split()
        assert command[:2] == ["/usr/bin/env", "ncclwatch"]
        assert command[-2:] == ["torchrun", "$TORCHRUN_ARGS"]  # unbraced: split into words
        assert one(JOB, "EnvironmentFile") == "/etc/ncclwatch/jobs/%i.env"
        assert environment(JOB)[f"{ENV_PREFIX}BUNDLE_DIR"] == "/var/lib/ncclwatch/bundles"

    def test_wrapper_accepts_the_options_in_execstart(self):
        proc = subprocess.run(
            [sys.executable, "-m", "ncclwatch", "--help"], check=False, capture_output=True, text=True, timeout=60
        )
        for option in (w for w in one(JOB, "ExecStart").split() if w.startswith("--")):
            assert option in proc.stdout, option

    def test_sigterm_goes_to_the_wrapper_which_forwards_it(self):
        assert one(JOB, "KillMode") == "mixed"
        assert int(one(JOB, "TimeoutStopSec")) >= 60

    def test_training_limits(self):
        assert one(JOB, "LimitMEMLOCK") == "infinity"
        assert one(JOB, "PrivateTmp") == "no"
