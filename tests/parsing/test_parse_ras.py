"""NCCL RAS reports: text (2.24+) and JSON (2.28.7+), malformed JSON, bad input, real captures.

The samples in tests/data/ras/ are written by tests/data/ras/gen_fixtures.py
with NCCL's own printf formats from NVIDIA/nccl src/ras/client_support.cc:

- *.txt (2.26+ text format): rasClientRunInit / rasClientRunComms at NCCL
  2.29.2 (commit ebd1e929; the same strings at 2.32.3, commit 12df1a11).
  mismatch_4rank.txt is the 2.28.9 output quoted in NCCL-FACTS.md.
- incomplete_mismatch_2.24.txt: the 2.24-era file (summed "collective
  operation counts", "The missing rank: 21", the example of NCCL's RAS docs).
- *.json: jsonWriteHeader ... jsonWriteFooter at 2.29.2 (JSON exists since 2.28.7).
- malformed_*.json: mismatch_4rank.json truncated, with a trailing comma and
  a missing one, and behind a text banner, as NCCL 2.28.9 was seen to break it.
- real-2.28.9-h200x2/: real replies (NCCL 2.28.9, 2 x H200) copied from the
  first tools/capture run; they match the formats above byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CAPTURES, DATA

from ncclwatch.watchdog.analyze import analyze_paths
from ncclwatch.watchdog.events import Citation, RasCommunicator, RasRank, RasReport, Unusable
from ncclwatch.watchdog.hang.ras import judge_ras, ras_outliers
from ncclwatch.watchdog.parsing.ras import (
    MALFORMED_JSON_REASON,
    looks_like_ras,
    normalize_comm_hash,
    parse_ras,
    parse_ras_json,
    parse_ras_text,
)

RAS = DATA / "ras"
SAMPLES = sorted(p.name for p in RAS.iterdir() if p.suffix in (".txt", ".json"))


def parse(name: str) -> list:
    return parse_ras((RAS / name).read_bytes(), name)


def report_of(events: list) -> RasReport:
    reports = [e for e in events if isinstance(e, RasReport)]
    assert len(reports) == 1, events
    return reports[0]


def only_report(name: str) -> RasReport:
    """A sample that must parse cleanly: one report, no note."""
    events = parse(name)
    assert [type(e) for e in events] == [RasReport], events
    return events[0]


def notes(events: list) -> list[str]:
    return [e.reason for e in events if isinstance(e, Unusable)]


def comm(label: str | None = None, status: str = "OK", ranks=(), messages=(), nranks=None) -> RasCommunicator:
    return RasCommunicator(label=label, status=status, ranks=list(ranks), messages=list(messages), nranks=nranks)


# --------------------------------------------------------------------------
# Sniffing
# --------------------------------------------------------------------------


class TestSniff:
    @pytest.mark.parametrize("name", SAMPLES)
    def test_every_sample_is_recognised_from_its_first_kilobyte(self, name):
        assert looks_like_ras((RAS / name).read_bytes()[:1024])

    @pytest.mark.parametrize(
        "head",
        [
            b"",
            b"\x00\xff\x13garbage",
            b"vm:714:714 [0] NCCL INFO NCCL version 2.28.9+cuda13.0\n",  # a debug log is not a RAS report
            b'{"time": 1.0, "gpus": [{"index": 0, "util_gpu_pct": 3}]}',
            b"Traceback (most recent call last):\n",
        ],
    )
    def test_other_content_is_not_ras(self, head):
        assert looks_like_ras(head) is False

    def test_sniffer_never_raises(self):
        assert looks_like_ras(None) is False  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Text reports
# --------------------------------------------------------------------------


class TestTextMismatch:
    """The 4-rank AllReduce mismatch quoted in NCCL-FACTS.md (NCCL 2.28.9)."""

    def test_report_header_and_communicator(self):
        report = only_report("mismatch_4rank.txt")
        assert (report.format, report.nccl_version) == ("text", "2.28.9")
        [c] = report.communicators
        assert (c.label, c.comm_hash, c.nranks, c.status) == ("#0-0", "0x93c39a8020f99e2a", 4, "MISMATCH")

    def test_the_named_rank_gets_pid_host_gpu_and_its_count(self):
        [c] = only_report("mismatch_4rank.txt").communicators
        assert c.ranks == [RasRank(rank=2, pid=1710, host="192.0.2.2", cuda_dev=2, collective_counts={"AllReduce": 49})]

    def test_report_sentences_are_kept_in_order(self):
        [c] = only_report("mismatch_4rank.txt").communicators
        assert c.messages[1:] == [
            "Communicator ranks have different AllReduce operation counts",
            "3 ranks have launched up to operation 47",
            "Rank 2 has launched up to operation 49 -- GPU 2 managed by process 1710 on node 192.0.2.2",
        ]
        assert c.messages[0].startswith("Status RUNNING")

    def test_outlier_is_rank_2_ahead_of_the_majority_of_three(self):
        [c] = only_report("mismatch_4rank.txt").communicators
        assert ras_outliers(c) == {2: "AllReduce launched up to 49, majority 47 (3 of 4 ranks), ahead by 2"}


class TestTextHealthy:
    def test_ok_communicators_exist_only_in_the_table_and_get_synthesised_labels(self):
        report = only_report("ok_8rank.txt")
        assert [(c.label, c.nranks, c.status, c.comm_hash) for c in report.communicators] == [
            ("#0-0", 8, "OK", None),
            ("#1-0", 4, "OK", None),
            ("#1-1", 4, "OK", None),
        ]

    def test_stays_quiet(self):
        for c in only_report("ok_8rank.txt").communicators:
            assert c.ranks == []
            assert ras_outliers(c) == {}

    def test_no_communicator_data_is_an_empty_report_not_an_error(self):
        text = (RAS / "ok_8rank.txt").read_text().split("Group ")[0] + "No communicator data collected!\n"
        text += "\nErrors\n======\n\nWarnings\n========\n\n"
        cite = Citation(file="ras.txt")
        assert parse_ras_text(text) == [RasReport(format="text", nccl_version="2.28.9", communicators=[], cite=cite)]


class TestTextMissingAndDead:
    def test_unresponsive_rank_is_missing_with_its_process(self):
        [c] = only_report("incomplete_8rank.txt").communicators
        assert c.status == "INCOMPLETE"
        assert c.ranks == [RasRank(rank=5, host="192.0.2.12", pid=4242, cuda_dev=1, status="MISSING")]
        assert ras_outliers(c) == {5: "no answer to RAS (process unresponsive or stopped)"}

    def test_job_level_blocks_are_attached_to_the_failing_communicator(self):
        [c] = only_report("incomplete_8rank.txt").communicators
        assert "INCOMPLETE: Process 4242 on node 192.0.2.12 managing GPU 1" in c.messages
        assert "TIMEOUT: Encountered 2 communication timeouts while gathering communicator data" in c.messages

    def test_dead_process_turns_its_missing_rank_dead_and_errors_are_named(self):
        [c] = only_report("dead_8rank.txt").communicators
        assert c.status == "INCOMPLETE,ERROR"
        by_rank = {r.rank: r for r in c.ranks}
        assert by_rank[5].status == "DEAD"
        assert by_rank[4] == RasRank(
            rank=4, host="192.0.2.12", pid=4241, cuda_dev=0, status="ERROR: Remote process error (asynchronous)"
        )
        assert ras_outliers(c) == {
            4: "reported remote process error (asynchronous)",
            5: "process considered dead by RAS (unreachable)",
            6: "reported remote process error (asynchronous)",
        }


class TestTextStatusAndTies:
    def test_status_mismatch_names_finalize_and_nocomm_ranks(self):
        [c] = only_report("status_mismatch_8rank.txt").communicators
        assert [(r.rank, r.status, r.cuda_dev, r.pid) for r in c.ranks] == [
            (3, "FINALIZE", 3, 2003),  # "GPU 3 (NVML 7)": cuda_dev is the CUDA id
            (7, "NOCOMM", 3, 2007),
        ]
        assert ras_outliers(c) == {
            3: "status FINALIZE, majority RUNNING (6 of 8 ranks)",
            7: "status NOCOMM, majority RUNNING (6 of 8 ranks)",
        }

    def test_two_ranks_that_differ_have_no_majority_and_both_are_flagged(self):
        [c] = only_report("mismatch_2rank_tie.txt").communicators
        assert c.comm_hash == "0x678a9195a2e6ef0d"  # == CommInit.comm_id of the shared 2.28.9 mismatch run
        assert {r.rank: r.collective_counts for r in c.ranks} == {
            0: {"AllGather": 15, "AllReduce": 47},
            1: {"AllGather": 16, "AllReduce": 48},
        }
        outliers = ras_outliers(c)
        assert set(outliers) == {0, 1}
        assert outliers[0] == (
            "AllGather launched up to 15, lowest; no majority (1 at 15, 1 at 16); "
            "AllReduce launched up to 47, lowest; no majority (1 at 47, 1 at 48)"
        )


class TestTextOldFormat:
    """NCCL 2.24/2.25: counts summed over collective types, missing ranks as a bare list."""

    def test_version_groups_and_missing_rank_without_process(self):
        report = only_report("incomplete_mismatch_2.24.txt")
        assert report.nccl_version == "2.24.3"
        assert [c.label for c in report.communicators] == ["#0-0", "#1-0"] + [f"#2-{i}" for i in range(7)]
        first = report.communicators[0]
        assert (first.nranks, first.status) == (32, "INCOMPLETE")
        assert first.ranks == [RasRank(rank=21, status="MISSING")]

    def test_summed_counts_are_keyed_collective(self):
        c = only_report("incomplete_mismatch_2.24.txt").communicators[1]
        assert c.ranks == [
            RasRank(rank=2, pid=483074, host="172.16.64.210", cuda_dev=2, collective_counts={"Collective": 6649})
        ]
        assert ras_outliers(c) == {2: "Collective launched up to 6649, majority 6650 (3 of 4 ranks), behind by 1"}


class TestTextTruncated:
    def test_cut_before_the_table_is_unusable_not_an_empty_report(self):
        text = (RAS / "mismatch_4rank.txt").read_bytes().split(b"Group ")[0]
        [event] = parse_ras(text, "ras.txt")
        assert isinstance(event, Unusable)
        assert "2.28.9" in event.reason and "truncated" in event.reason

    def test_cut_before_warnings_keeps_the_table_and_says_so(self):
        text = (RAS / "mismatch_4rank.txt").read_bytes().split(b"\nErrors")[0]
        events = parse_ras(text, "ras.txt")
        assert report_of(events).communicators[0].status == "MISMATCH"
        assert "Warnings" in notes(events)[0]

    @pytest.mark.parametrize("name", [n for n in SAMPLES if n.endswith(".txt")])
    def test_no_prefix_ever_reads_healthier_than_the_whole(self, name):
        data = (RAS / name).read_bytes()
        whole = {c.label: c.status for c in only_report(name).communicators}
        for cut in range(0, len(data), 7):
            events = parse_ras(data[:cut], name)
            assert events and all(isinstance(e, RasReport | Unusable) for e in events)
            for report in (e for e in events if isinstance(e, RasReport)):
                for c in report.communicators:
                    assert c.status == whole[c.label] or notes(events), (cut, c)


# --------------------------------------------------------------------------
# JSON reports
# --------------------------------------------------------------------------


class TestJson:
    def test_mismatch_json_agrees_with_the_text_report(self):
        report = only_report("mismatch_4rank.json")
        assert (report.format, report.nccl_version) == ("json", "2.28.9")
        [c] = report.communicators
        [text] = only_report("mismatch_4rank.txt").communicators
        assert (c.comm_hash, c.nranks, c.status) == (text.comm_hash, 4, "MISMATCH")
        assert ras_outliers(c) == ras_outliers(text)

    def test_every_rank_has_identity_status_and_all_counts(self):
        [c] = only_report("mismatch_4rank.json").communicators
        assert c.label is None  # the JSON has no "#g-i" numbering
        assert c.ranks[2] == RasRank(
            rank=2,
            host="192.0.2.2",
            pid=1710,
            cuda_dev=2,
            status="RUNNING",
            collective_counts={"Broadcast": 1, "Reduce": 0, "AllGather": 12, "ReduceScatter": 0, "AllReduce": 49},
        )

    def test_healthy_two_ranks_stay_quiet(self):
        [c] = only_report("ok_2rank.json").communicators
        assert (c.status, ras_outliers(c)) == ("OK", {})
        assert [r.status for r in c.ranks] == ["RUNNING", "RUNNING"]

    def test_missing_dead_rank_and_async_errors(self):
        [c] = only_report("dead_8rank.json").communicators
        assert c.status == "INCOMPLETE,ERROR"
        assert c.ranks[5] == RasRank(rank=5, host="192.0.2.12", pid=4242, cuda_dev=1, status="DEAD")
        assert set(ras_outliers(c)) == {4, 5, 6}
        assert "Rank 4 reported Remote process error (asynchronous)" in c.messages

    def test_responsive_missing_rank_is_nocomm_not_lost(self):
        present = [{"rank": r, "status": {"init_state": 0}, "collective_counts": {"AllReduce": 3}} for r in range(3)]
        gone = {"rank": 3, "host": "unknown", "pid": -1, "status": {"unresponsive": False, "considered_dead": False}}
        obj = {"communicators": [{"hash": "0xab", "size": 4, "ranks": present, "missing_ranks": [gone]}]}
        [c] = report_of(parse_ras_json(obj)).communicators
        assert (c.status, c.ranks[3]) == ("MISMATCH", RasRank(rank=3, status="NOCOMM"))  # "unknown"/-1 -> None
        assert ras_outliers(c) == {3: "status NOCOMM, majority RUNNING (3 of 4 ranks)"}

    def test_timeouts_become_a_message(self):
        obj = {"communicators": [{"hash": "0x1", "ranks": [{"rank": 0}]}], "ras": {"timeouts_count": 3}}
        [c] = report_of(parse_ras_json(obj)).communicators
        assert c.messages[-1].startswith("TIMEOUT: Encountered 3 communication timeout")

    def test_handshake_answers_before_the_document_are_skipped(self):
        data = b"SERVER PROTOCOL 2\nOK\nOK\n" + (RAS / "mismatch_4rank.json").read_bytes()
        assert [type(e) for e in parse_ras(data, "nc.out")] == [RasReport]

    @pytest.mark.parametrize("obj", [[], {"event": "PEER_DEAD", "group": "LIFECYCLE"}, {"communicators": 3}])
    def test_not_a_status_document(self, obj):
        [event] = parse_ras_json(obj)
        assert isinstance(event, Unusable) and "not a RAS STATUS JSON report" in event.reason


class TestMalformedJson:
    def test_truncated_keeps_complete_ranks_and_marks_the_communicator_partial(self):
        events = parse("malformed_truncated.json")
        [c] = report_of(events).communicators
        assert c.status == "MISMATCH,PARTIAL"
        assert c.ranks[3].collective_counts == {"Broadcast": 1, "Reduce": 0}  # cut inside AllGather
        # rank 3's missing AllReduce is unknown, not a mismatch
        assert ras_outliers(c) == {2: "AllReduce launched up to 49, majority 47 (2 of 3 ranks), ahead by 2"}
        assert notes(events) == [f"{MALFORMED_JSON_REASON}; repaired (closed a truncated document)"]

    def test_trailing_and_missing_commas_are_repaired(self):
        events = parse("malformed_commas.json")
        assert report_of(events).communicators[0].status == "MISMATCH"
        assert "removed 1 trailing comma(s), inserted 1 missing comma(s)" in notes(events)[0]

    def test_text_banner_before_the_document_is_skipped(self):
        [report] = parse("malformed_text_prefix.json")
        assert report.format == "json" and report.communicators[0].status == "MISMATCH"

    @pytest.mark.parametrize(
        ("old", "new"),
        [
            ("          }\n        }\n      ],", "          }\n      ],"),  # last rank never closed
            ("        }\n      ],\n", "        }]\n      ],\n"),  # a stray ']'
            ('\n  ],\n  "ras"', '\n  "ras"'),  # communicators never closed: only salvage helps
        ],
    )
    def test_bad_nesting_still_yields_every_rank(self, old, new):
        data = (RAS / "mismatch_4rank.json").read_text().replace(old, new)
        events = parse_ras(data.encode(), "ras.json")
        [c] = report_of(events).communicators
        assert [r.collective_counts["AllReduce"] for r in c.ranks] == [47, 47, 49, 47]
        assert notes(events)[0].startswith(MALFORMED_JSON_REASON)

    def test_unrepairable_document_salvages_rank_records(self):
        data = (RAS / "mismatch_4rank.json").read_text().replace('"size": 4,', '"size": ,')
        events = parse_ras(data.encode(), "ras.json")
        [c] = report_of(events).communicators
        assert (c.comm_hash, len(c.ranks), c.status) == ("0x93c39a8020f99e2a", 4, "MISMATCH,PARTIAL")
        assert notes(events) == [f"{MALFORMED_JSON_REASON}; salvaged rank records only"]

    def test_nothing_salvageable_falls_back_to_text_in_the_same_capture(self):
        data = (RAS / "mismatch_4rank.txt").read_bytes() + b'{"nccl_version": "2.28.9", "communicators": [{"hash": '
        events = parse_ras(data, "ras.out")
        assert report_of(events).format == "text"
        assert "used the text report" in notes(events)[0]

    def test_nothing_salvageable_and_no_text_is_unusable(self):
        [event] = parse_ras(b'{"nccl_version": "2.28.9", "communicators": [{"hash": ', "ras.json")
        assert event == Unusable(reason=MALFORMED_JSON_REASON, cite=event.cite)

    @pytest.mark.parametrize("name", ["mismatch_4rank.json", "dead_8rank.json"])
    def test_no_prefix_raises_or_reads_as_an_empty_healthy_report(self, name):
        data = (RAS / name).read_bytes()
        for cut in range(1, len(data) - 1, 5):
            events = parse_ras(data[:cut], name)
            assert notes(events), cut  # a cut document always says so
            for report in (e for e in events if isinstance(e, RasReport)):
                assert report.communicators, cut
                assert all(c.status != "OK" for c in report.communicators), cut


# --------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------


class TestBadInput:
    @pytest.mark.parametrize(
        ("data", "says"),
        [
            (b"", "empty"),
            (b"  \n\n", "empty"),
            (bytes(range(256)) * 8, "binary"),
            (b"hello world\nnothing to see\n", "not a NCCL RAS status report"),
            (b"vm:714:714 [0] NCCL INFO NCCL version 2.28.9+cuda13.0\n", "not a NCCL RAS status report"),
            (b'{"time": 1.0, "gpus": []}', "not a NCCL RAS status report"),
            (b"SERVER PROTOCOL 2\nOK\n", "no report"),
            (b"ERROR: Unknown command STATUSS\n", "refused the query: ERROR: Unknown command STATUSS"),
            (b"NCCL version 2.28.9\nall good\n", "not a NCCL RAS status report"),
        ],
    )
    def test_is_unusable_with_a_reason(self, data, says):
        [event] = parse_ras(data, "ras.txt")
        assert isinstance(event, Unusable) and says in event.reason
        assert event.cite.file == "ras.txt"

    @pytest.mark.parametrize(
        "obj",
        [
            {"communicators": [{"hash": "0x1", "ranks": 3}]},
            {"communicators": [{"hash": 5, "ranks": [{"rank": 0, "status": [], "collective_counts": [1]}]}]},
            {"communicators": [None, "x", {"ranks": [{"rank": "zero"}]}], "communicators_count": 3},
        ],
    )
    def test_json_of_odd_shapes_never_raises(self, obj):
        events = parse_ras_json(obj, name="odd.json")
        assert events and all(e.cite.file == "odd.json" for e in events)

    def test_a_stray_nul_is_tolerated(self):
        assert [type(e) for e in parse_ras((RAS / "mismatch_4rank.txt").read_bytes() + b"\x00", "x")] == [RasReport]

    def test_never_raises_on_mangled_samples(self):
        for name in SAMPLES:
            data = bytearray((RAS / name).read_bytes())
            for i in range(0, len(data), 13):
                mangled = bytes(data[:i]) + b"\xff}]{[\x00," + bytes(data[i + 3 :])
                assert parse_ras(mangled, name)


class TestHelpers:
    @pytest.mark.parametrize(
        ("value", "expected"),
        [
            ("93c39a8020f99e2a", "0x93c39a8020f99e2a"),
            ("0x678a9195a2e6ef0d", "0x678a9195a2e6ef0d"),
            ("0b7c44e1d95a3f20", "0xb7c44e1d95a3f20"),  # text pads to 16 digits, the log does not
            (0xAB, "0xab"),
            ("not hex", None),
            ("0x" + "f" * 17, None),
            (None, None),
        ],
    )
    def test_normalize_comm_hash(self, value, expected):
        assert normalize_comm_hash(value) == expected

    def test_outliers_stay_quiet_on_agreement(self):
        ranks = [RasRank(rank=r, status="RUNNING", collective_counts={"AllReduce": 5}) for r in range(4)]
        assert ras_outliers(comm(ranks=ranks)) == {}

    def test_outliers_from_json_style_ranks(self):
        ranks = [
            RasRank(rank=r, status="RUNNING", collective_counts={"AllReduce": 9 if r == 3 else 10}) for r in range(4)
        ]
        assert ras_outliers(comm(ranks=ranks)) == {
            3: "AllReduce launched up to 9, majority 10 (3 of 4 ranks), behind by 1"
        }


# --------------------------------------------------------------------------
# Real captures (tools/capture on GPU machines)
# --------------------------------------------------------------------------

REAL_SAMPLES = RAS / "real-2.28.9-h200x2"  # copied from the first tools/capture run, see TestRealSamples
CAPTURED = sorted(CAPTURES.glob("*/*/ras/ras.txt")) + sorted(CAPTURES.glob("*/*/ras/ras.json"))


class TestRealSamples:
    """NCCL 2.28.9 on 2 x H200, tools/capture scenarios "skip" (rank 1 skips the
    collectives of step 15 and goes on) and "python_stuck" (rank 1 sleeps in
    Python at step 15); text and JSON queried back to back, VERBOSE STATUS."""

    @pytest.mark.parametrize("case", ["skip", "python_stuck"])
    def test_text_and_json_agree(self, case):
        text = only_report(f"{REAL_SAMPLES.name}/{case}.txt")
        js = only_report(f"{REAL_SAMPLES.name}/{case}.json")
        assert text.nccl_version == js.nccl_version == "2.28.9"
        [t], [j] = text.communicators, js.communicators
        assert (t.comm_hash, t.status, t.nranks) == (j.comm_hash, j.status, j.nranks)
        assert ras_outliers(t) == ras_outliers(j)

    def test_skip_rank_1_is_ahead_in_allreduce(self):
        [c] = only_report(f"{REAL_SAMPLES.name}/skip.txt").communicators
        assert ras_outliers(c) == {
            0: "AllReduce launched up to 47, lowest; no majority (1 at 47, 1 at 49)",
            1: "AllReduce launched up to 49, highest; no majority (1 at 47, 1 at 49)",
        }

    def test_python_stuck_rank_1_is_behind_in_three_collectives(self):
        [c] = only_report(f"{REAL_SAMPLES.name}/python_stuck.json").communicators
        assert {op: n for op, n in c.ranks[1].collective_counts.items() if n} == {
            "Broadcast": 19,
            "AllGather": 16,
            "AllReduce": 46,
        }
        assert ras_outliers(c)[1].count(", lowest;") == 3


@pytest.mark.skipif(not CAPTURED, reason="no RAS captures under tests/fixtures/captures yet")
class TestCaptures:
    @pytest.mark.parametrize("path", CAPTURED, ids=lambda p: str(p.relative_to(CAPTURES)))
    def test_parses_without_raising_and_names_a_version(self, path: Path):
        events = parse_ras(path.read_bytes(), str(path))
        assert events
        for report in (e for e in events if isinstance(e, RasReport)):
            assert report.nccl_version and report.nccl_version.startswith("2.")
            assert report.communicators

    @pytest.mark.parametrize("case", sorted({p.parent for p in CAPTURED}), ids=lambda p: str(p.relative_to(CAPTURES)))
    def test_text_and_json_name_the_same_communicators(self, case: Path):
        pair = [parse_ras((case / n).read_bytes(), n) for n in ("ras.txt", "ras.json") if (case / n).exists()]
        if len(pair) < 2 or any(notes(events) for events in pair):
            pytest.skip("needs both reports, complete")
        text, js = (report_of(events).communicators for events in pair)
        assert len(text) == len(js)
        assert {c.comm_hash for c in text if c.comm_hash} <= {c.comm_hash for c in js}


# --------------------------------------------------------------------------
# A few ranks one collective ahead (issue 31)
# --------------------------------------------------------------------------


class TestFewAhead:
    """Two of eight ranks launched AllReduce 1235, the other six 1234: the two finished their part of 1234 and went
    on; the rank the six wait for is among the six (few_ahead_8rank.*, NCCL's own text and JSON formats)."""

    BEHIND = (0, 2, 3, 4, 6, 7)

    @pytest.mark.parametrize("name", ["few_ahead_8rank.txt", "few_ahead_8rank.json"])
    def test_the_ranks_behind_are_the_suspects_and_the_few_ahead_are_not_blamed(self, name):
        [c] = only_report(name).communicators
        judged = judge_ras(c)
        assert (judged.culprits, judged.suspects, judged.ahead) == ((), self.BEHIND, (1, 5))
        assert set(ras_outliers(c)) == set(self.BEHIND)
        assert ras_outliers(c)[0] == (
            "AllReduce launched up to 1234, one behind rank 1, 5: those finished their part of AllReduce 1234 and "
            "launched the next; the rank they wait for is among the 6 at 1234"
        )

    def test_text_whose_groups_do_not_add_up_names_no_one(self):
        text = (RAS / "few_ahead_8rank.txt").read_text().replace("  6 ranks have", "  5 ranks have")
        [c] = report_of(parse_ras(text.encode(), "ras.txt")).communicators
        judged = judge_ras(c)
        assert (judged.culprits, judged.suspects, judged.ahead) == ((), (), (1, 5))

    def test_one_rank_one_ahead_is_still_the_culprit(self):
        # tools/capture "extra" on 4 x H200: rank 3 issued one extra all_reduce and is one ahead.
        [c] = only_report("mismatch_4rank.txt").communicators  # rank 2 two ahead: the skip, still the culprit
        assert judge_ras(c).culprits == (2,)
        extra = CAPTURES / "nccl-2.28.9-h200x4" / "extra" / "ras" / "ras.txt"
        [c] = report_of(parse_ras(extra.read_bytes(), "ras.txt")).communicators
        assert (judge_ras(c).culprits, judge_ras(c).suspects) == ((3,), ())

    def test_a_two_rank_tie_is_two_suspects_not_two_culprits(self):
        [c] = only_report("mismatch_2rank_tie.txt").communicators
        assert (judge_ras(c).culprits, judge_ras(c).suspects) == ((), (0, 1))

    def test_a_missing_rank_is_a_culprit_even_beside_a_tie(self):
        ranks = [
            RasRank(rank=0, status="RUNNING", collective_counts={"AllReduce": 5}),
            RasRank(rank=1, status="MISSING", collective_counts={"AllReduce": 6}),
        ]
        assert (judge_ras(comm(ranks=ranks)).culprits, judge_ras(comm(ranks=ranks)).suspects) == ((1,), (0,))


class TestRasVerdict:
    """What ``analyze`` says from a RAS report alone."""

    def test_few_ahead_is_rank_behind_with_the_ranks_behind_as_suspects(self):
        report = analyze_paths([str(RAS / "few_ahead_8rank.txt")], now=1_800_000_000.0)
        assert (report.verdict.value, report.culprit_ranks, report.suspect_ranks) == (
            "rank_behind",
            [],
            list(TestFewAhead.BEHIND),
        )
        assert "rank 1, 5 launched one collective more than all the others" in report.summary

    def test_a_two_rank_tie_names_suspects_only(self):
        report = analyze_paths([str(RAS / "mismatch_2rank_tie.txt")], now=1_800_000_000.0)
        assert (report.verdict.value, report.culprit_ranks, report.suspect_ranks) == (
            "collective_mismatch",
            [],
            [0, 1],
        )

    def test_one_rank_two_ahead_is_still_the_culprit(self):
        report = analyze_paths([str(RAS / "mismatch_4rank.txt")], now=1_800_000_000.0)
        assert (report.culprit_ranks, report.suspect_ranks) == ([2], [])
