"""NCCL debug file parser: real 2.28.9 files, older and newer formats, broken input."""

from __future__ import annotations

from conftest import DATA, shared
from nccl_lines import init, op

from ncclwatch.watchdog.events import (
    CommEnd,
    CommInit,
    CommTopology,
    LocalPeerClosed,
    NcclVersion,
    NcclWarning,
    OpBatch,
    OpSig,
)
from ncclwatch.watchdog.parsing.nccl_log import NcclLogParser, iter_op_lines, looks_like_nccl_log


def parse(data: bytes, name: str = "f.log") -> tuple[NcclLogParser, list]:
    parser = NcclLogParser(name)
    return parser, parser.feed(data, final=True)


def ops_of(events: list) -> list[OpSig]:
    """Collectives then p2p of each batch (a batch keeps each kind in file order)."""
    return [s for e in events if isinstance(e, OpBatch) for s in (*e.sigs, *e.p2p)]


class TestRealLog:
    def test_mismatch_rank0_has_116_operations_and_its_identity(self):
        path = shared("nccl-2.28.9-2gpu", "mismatch", "nccl", "nccl.vm.714.log")
        parser, events = parse(path.read_bytes(), str(path))
        sigs = ops_of(events)
        assert len(sigs) == 116
        assert [s.op for s in sigs].count("Send") == 16
        assert sigs[-1] == OpSig("Recv", 4096, "7", "0", 1)
        inits = [e for e in events if isinstance(e, CommInit)]
        assert [(i.rank, i.nranks, i.comm_id, i.phase) for i in inits] == [
            (0, 2, "0x678a9195a2e6ef0d", "start"),
            (0, 2, "0x678a9195a2e6ef0d", "complete"),
        ]
        assert inits[0].proc == ("vm", 714)
        assert inits[0].cite.line == 16
        assert [e.version for e in events if isinstance(e, NcclVersion)] == ["2.28.9+cuda13.0"]
        topo = [e for e in events if isinstance(e, CommTopology)]
        assert (topo[0].local_rank, topo[0].local_ranks, topo[0].nnodes) == (0, 2, 1)
        assert parser.garbled == 0
        assert parser.lines_seen == path.read_bytes().count(b"\n")

    def test_healthy_log_ends_with_destroy(self):
        path = shared("nccl-2.28.9-2gpu", "healthy", "nccl", "nccl.vm.640.log")
        _, events = parse(path.read_bytes())
        ends = [e for e in events if isinstance(e, CommEnd)]
        assert [(e.kind, e.phase, e.rank) for e in ends] == [("destroy", "complete", 0)]

    def test_exit_log_shows_the_peer_connection_closing(self):
        path = shared("nccl-2.28.9-2gpu", "exit", "nccl", "nccl.vm.1327.log")
        _, events = parse(path.read_bytes())
        assert [e.local_rank for e in events if isinstance(e, LocalPeerClosed)] == [1]

    def test_line_numbers_of_operations_are_found_on_demand(self):
        path = shared("nccl-2.28.9-2gpu", "mismatch", "nccl", "nccl.vm.714.log")
        data = path.read_bytes()
        found = list(iter_op_lines(data))
        line, text, proc, comm, sig = found[0]
        assert data.split(b"\n")[line - 1].decode() == text
        assert text.startswith("vm:714:714 [0] NCCL INFO AllGather: opCount 0")
        assert (proc, comm, sig.op) == (("vm", 714), "0x18564c40", "AllGather")


class TestVersions:
    """Sample lines built from NCCL's format strings (docs/nccl-log-formats.md)."""

    def test_every_sample_yields_inits_operations_and_an_end(self):
        for path in sorted((DATA / "nccl_versions").glob("*.log")):
            _, events = parse(path.read_bytes(), path.name)
            inits = [e for e in events if isinstance(e, CommInit)]
            assert inits, path.name
            assert ops_of(events), path.name
            assert any(isinstance(e, CommEnd) for e in events), path.name
            assert any(isinstance(e, NcclWarning) for e in events), path.name

    def test_split_without_comm_id_keeps_parent_color_and_count(self):
        _, events = parse((DATA / "nccl_versions" / "nccl-2.23.log").read_bytes())
        split = [e for e in events if isinstance(e, CommInit) and e.parent_ptr]
        assert split and split[0].comm_id is None
        assert (split[0].split_count, split[0].color, split[0].key) == (1, 0, 0)
        assert {s.phase for s in split} == {"start", "complete"}

    def test_warn_lines_with_source_location_are_classified(self):
        _, events = parse((DATA / "nccl_versions" / "nccl-2.23.log").read_bytes())
        warning = next(e for e in events if isinstance(e, NcclWarning))
        assert warning.category == "network"
        assert warning.peer == "gpu-node-01<38211>"

    def test_timestamped_lines_parse(self):
        _, events = parse((DATA / "nccl_versions" / "nccl-2.26-timestamps.log").read_bytes())
        assert ops_of(events)
        assert any(isinstance(e, CommInit) for e in events)

    def test_pre_2_21_init_has_no_function_name(self):
        _, events = parse((DATA / "nccl_versions" / "nccl-2.18.log").read_bytes())
        assert any(isinstance(e, CommInit) and e.comm_id for e in events)


class TestStreaming:
    def test_a_line_split_across_feeds_is_parsed_once(self):
        text = (init(0, 2, "0xc0") + op(0, "AllReduce", 8, "0xc0") + op(0, "Broadcast", 4, "0xc0")).encode()
        parser = NcclLogParser("f")
        cut = len(text) - 30
        events = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.feed(b"", final=True)
        assert [s.op for s in ops_of(events)] == ["AllReduce", "Broadcast"]

    def test_truncated_last_line_is_dropped_as_garbled(self):
        text = (init(0, 2, "0xc0") + op(0, "AllReduce", 8, "0xc0")).encode() + op(0, "AllReduce", 8, "0xc0").encode()[
            :60
        ]
        parser, events = parse(text)
        assert len(ops_of(events)) == 1
        assert parser.garbled == 1

    def test_interleaved_partial_writes_lose_only_the_cut_operation(self):
        # Thread A's line is cut by thread B's whole line (NCCL < 2.27 is not line-buffered).
        good = op(0, "AllReduce", 8, "0xc0")
        cut_a = op(0, "AllGather", 2, "0xc0")
        interleaved = cut_a[:60] + op(0, "Broadcast", 4, "0xc0") + cut_a[60:]
        parser, events = parse((init(0, 2, "0xc0") + good + interleaved + good).encode())
        assert [s.op for s in ops_of(events)] == ["AllReduce", "Broadcast", "AllReduce"]
        assert parser.garbled == 1

    def test_launcher_tee_prefix_and_several_processes_in_one_file(self):
        text = "".join(
            f"[rank{r}]:" + line + "\n"
            for r in (0, 1)
            for line in (init(r, 2, f"0xc{r}") + op(r, "AllReduce", 8, f"0xc{r}")).splitlines()
        )
        _, events = parse(text.encode())
        batches = [e for e in events if isinstance(e, OpBatch)]
        assert sorted(b.proc.pid for b in batches) == [1000, 1001]

    def test_binary_garbage_gives_nothing(self):
        parser, events = parse(bytes(range(256)) * 100)
        assert events == []
        assert not looks_like_nccl_log(bytes(range(256)))
