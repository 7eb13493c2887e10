"""RAS is asked once per incident, by the prober's first look, and only on NCCL versions that survive it.

Against a real server on loopback speaking NCCL's side of the protocol with a
real NCCL 2.28.9 reply; no Flight Recorder pipes and no py-spy, so the look
holds only what RAS gave.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import DATA
from support import RasServer

from ncclwatch.watchdog.events import RasReport, Unusable
from ncclwatch.watchdog.hang.snapshot import WorkerView
from ncclwatch.watchdog.live.prober import JobProber, ras_skip_reason

TEXT = (DATA / "ras" / "real-2.28.9-h200x2" / "skip.txt").read_bytes()


def worker(rank: int, step: int) -> WorkerView:
    return WorkerView(
        rank=rank,
        pid=999_000 + rank,
        local_rank=rank,
        world_size=2,
        host="node1",
        state="S",
        cpu_share=0.0,
        io_rate=0.0,
        step=step,
        gone=False,
    )


def looks(tmp_path: Path, versions: list[str], steps: list[tuple[int, bool]]) -> tuple[RasServer, list[list]]:  # type: ignore[type-arg]
    """The prober's looks at ``(step, with_gpus)``: what RAS gave each time, and the server's record."""
    server = RasServer(TEXT)

    async def go() -> list[list]:  # type: ignore[type-arg]
        async with server:
            prober = JobProber(
                tmp_path, pyspy=str(tmp_path / "no-py-spy"), ras_port=server.port, nccl_versions=lambda: versions
            )
            found = []
            for step, first_look in steps:
                events = await prober.probe([worker(0, step), worker(1, step)], with_gpus=first_look)
                found.append([e for e in events if isinstance(e, RasReport | Unusable)])
            return found

    return server, asyncio.run(go())


class TestVersions:
    @pytest.mark.parametrize("version", ["2.29.2", "2.30.1+cuda13.0"])
    def test_fixed_versions_are_asked(self, version: str) -> None:
        assert ras_skip_reason([version]) is None

    @pytest.mark.parametrize(
        "version, issue",
        [
            ("2.26.2", "#1669"),
            ("2.26.5", "#1718"),
            ("2.27.3", "#1762"),
            ("2.27.7", "#1996"),
            ("2.28.9+cuda13.0", "#1762"),
            ("2.29.1", "#1762"),
            ("2.29.7", "#2346"),
        ],
    )
    def test_versions_seen_crashing_are_not_asked_and_the_issue_is_named(self, version: str, issue: str) -> None:
        why = ras_skip_reason([version])
        assert why is not None and why.startswith("not queried") and issue in why

    def test_unknown_version_is_not_asked(self) -> None:
        assert "no NCCL version" in (ras_skip_reason([]) or "")

    def test_one_crashing_version_among_the_ranks_is_enough(self) -> None:
        assert ras_skip_reason(["2.30.1", "2.28.9"]) is not None


class TestProbe:
    def test_first_look_of_an_incident_asks_once(self, tmp_path: Path) -> None:
        server, found = looks(tmp_path, ["2.30.1+cuda13.0"], [(7, True), (7, False), (7, True)])
        assert len(server.commands) == 1  # the confirming look and a re-look of the same incident do not ask
        assert server.commands[0][-1] == "VERBOSE STATUS"
        assert [type(e).__name__ for e in found[0]] == ["RasReport"]
        assert found[1] == found[2] == []

    def test_a_new_incident_asks_again(self, tmp_path: Path) -> None:
        server, _ = looks(tmp_path, ["2.30.1+cuda13.0"], [(7, True), (9, True)])  # steps moved in between
        assert len(server.commands) == 2

    def test_crashing_version_is_never_asked_and_said_once(self, tmp_path: Path) -> None:
        server, found = looks(tmp_path, ["2.28.9+cuda13.0"], [(7, True), (7, True)])
        assert server.commands == []
        (note,) = found[0]
        assert isinstance(note, Unusable) and "NVIDIA/nccl#1762" in note.reason
        assert found[1] == []

    def test_without_a_port_ras_is_not_asked(self, tmp_path: Path) -> None:
        async def go() -> list:  # type: ignore[type-arg]
            prober = JobProber(tmp_path, pyspy=str(tmp_path / "no-py-spy"), nccl_versions=lambda: ["2.30.1"])
            return await prober.probe([worker(0, 1)], with_gpus=True)

        assert not [e for e in asyncio.run(go()) if isinstance(e, RasReport | Unusable)]


@pytest.mark.parametrize("nccl_logged, noted", [(False, False), (True, True)])
def test_a_job_without_nccl_gets_no_ras_note(tmp_path: Path, nccl_logged: bool, noted: bool) -> None:
    """A gloo job (no NCCL debug file) says nothing of RAS.

    An NCCL job whose version is unknown says why it was not asked.
    """
    server = RasServer(TEXT)

    async def go() -> list:  # type: ignore[type-arg]
        async with server:
            prober = JobProber(
                tmp_path, pyspy=str(tmp_path / "no-py-spy"), ras_port=server.port, nccl_logged=lambda: nccl_logged
            )
            return await prober.probe([worker(0, 1), worker(1, 1)], with_gpus=True)

    notes = [e for e in asyncio.run(go()) if isinstance(e, RasReport | Unusable)]
    assert server.commands == []
    assert [isinstance(n, Unusable) and "no NCCL version" in n.reason for n in notes] == ([True] if noted else [])


@pytest.mark.parametrize(
    "port, versions, logged, withheld",
    [
        (None, ["2.30.1"], True, "no RAS port"),
        (28028, [], False, "no NCCL log"),
        (28028, ["2.28.9+cuda13.0"], True, "#1762"),
        (28028, [], True, "no NCCL version"),
        (28028, ["2.30.1+cuda13.0"], True, None),
    ],
)
def test_the_bundle_is_told_the_probes_reason_not_to_ask(
    tmp_path: Path, port: int | None, versions: list[str], logged: bool, withheld: str | None
) -> None:
    prober = JobProber(tmp_path, pyspy=None, ras_port=port, nccl_versions=lambda: versions, nccl_logged=lambda: logged)
    why = prober.ras_withheld()
    assert why is None if withheld is None else (why is not None and withheld in why)
