"""ncclwatch installs under one name and lives beside PyPI's ``watchdog`` (file-system events) in one venv.

Before: the project installed top-level ``watchdog`` and ``launcher`` packages;
``pip install watchdog`` and ncclwatch overwrote each other's files.  Each
test builds a real venv (seeing this interpreter's packages for the
dependencies), installs PyPI ``watchdog`` and ncclwatch (normal, then
editable), imports both from a neutral folder, runs the CLI, uninstalls
``watchdog`` and checks ncclwatch still runs.  The venv sees this test
environment's packages (pydantic, aiohttp...) through a ``.pth`` line, not
the base interpreter's: on a fresh machine only this environment has them.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.fixture
def env(tmp_path: Path) -> Path:
    venv.EnvBuilder(with_pip=True).create(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "test-environment.pth").write_text("".join(f"{path}\n" for path in sorted(ours)))
    got = run(python, "-m", "pip", "install", "-q", "watchdog", cwd=tmp_path)
    if got.returncode != 0 and ("No matching distribution" in got.stderr or "Could not find" in got.stderr):
        pytest.skip(f"PyPI's watchdog cannot be installed here: {got.stderr.strip()[-300:]}")
    assert got.returncode == 0, got.stderr
    return python


@pytest.mark.parametrize("editable", [False, True], ids=["normal", "editable"])
def test_ncclwatch_and_pypi_watchdog_share_a_venv(env: Path, tmp_path: Path, editable: bool) -> None:
    neutral = tmp_path / "elsewhere"  # not the repository: its folders must not be what gets imported
    neutral.mkdir()
    install = ["-m", "pip", "install", "-q", "--no-deps", *(["-e"] if editable else []), str(REPO)]
    done = run(env, *install, cwd=neutral)
    assert done.returncode == 0, done.stderr
    site = env.parent.parent / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"

    both = run(
        env,
        "-c",
        "import watchdog.observers, ncclwatch.watchdog.analyze as c; "
        "print(watchdog.observers.__file__); print(c.__file__)",
        cwd=neutral,
    )
    assert both.returncode == 0, both.stderr
    theirs, ours = both.stdout.split()
    assert Path(theirs).is_relative_to(site)  # PyPI's watchdog, untouched
    assert Path(ours).is_relative_to(REPO / "watchdog") if editable else Path(ours).is_relative_to(site / "ncclwatch")
    cli = env.parent / "ncclwatch"
    assert run(cli, "--help", cwd=neutral).returncode == 0

    assert run(env, "-m", "pip", "uninstall", "-y", "-q", "watchdog", cwd=neutral).returncode == 0
    helped = run(cli, "--help", cwd=neutral)
    assert helped.returncode == 0 and "torchrun" in helped.stdout, helped.stderr
    gone = run(env, "-c", "import watchdog", cwd=neutral)
    assert "No module named 'watchdog'" in gone.stderr  # we never installed a top-level watchdog
    if not editable:
        record = next(site.glob("ncclwatch-*.dist-info")) / "RECORD"
        tops = {line.split("/", 1)[0] for line in record.read_text().splitlines() if line}
        assert {t for t in tops if not t.endswith(".dist-info") and t != ".."} == {"ncclwatch"}, tops


def test_every_package_folder_is_installed() -> None:
    """pyproject lists the packages one by one: a new folder missing there installs nowhere (an editable
    install hides it; a wheel, as on the GPU machines, fails with ModuleNotFoundError)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"ncclwatch"}
    for top, name in (("watchdog", "ncclwatch.watchdog"), ("launcher", "ncclwatch.launcher")):
        for init in (REPO / top).rglob("__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(REPO / top).parts]))
    assert found == listed
