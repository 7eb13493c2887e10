"""Lines as launchers and schedulers print them: the prefix is found once per file and rewritten, lines kept."""

from __future__ import annotations

import pytest

from ncclwatch.watchdog.parsing.line_prefix import PrefixStripper, detect

NCCL = (
    b"node1:700:700 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x2 count 4 datatype 7 op 0 root 0 "
    b"comm 0x5 [nranks=2] stream 0x1"
)

# (form, two lines as the tool prints them, what the parsers read)
FORMS = [
    ("srun --label", [b" 0: " + NCCL, b"12: Traceback"], [b"[task0]: " + NCCL, b"[task12]: Traceback"]),
    ("pdsh", [b"10.1.2.3: " + NCCL, b"node-2: x"], [b"[host 10.1.2.3]: " + NCCL, b"[host node-2]: x"]),
    (
        "mpirun --tag-output",
        [b"[1,12]<stdout>:" + NCCL, b"[1,3]<stderr>: x"],
        [b"[mpirank12]: " + NCCL, b"[mpirank3]: x"],
    ),
    (
        "Ray",
        [b"(RayTrainWorker pid=123, ip=10.0.0.1) " + NCCL, b"(pid=124, ip=10.0.0.2) x"],
        [b"[ray RayTrainWorker pid=123, ip=10.0.0.1]: " + NCCL, b"[ray pid=124, ip=10.0.0.2]: x"],
    ),
    ("ISO 8601 timestamp", [b"2026-11-26T03:12:45.123+00:00 " + NCCL, b"2026-11-26 03:12:45 x"], [NCCL, b"x"]),
    ("bracketed timestamp", [b"[2026-11-26 03:12:45,123] " + NCCL, b"[2026-11-26 03:12:46,001] x"], [NCCL, b"x"]),
    (
        "syslog",
        [b"Nov 26 03:12:45 node3 python[4242]: " + NCCL, b"Nov  6 03:12:45 node3 python[4242]: x"],
        [b"[host node3]: " + NCCL, b"[host node3]: x"],
    ),
    (
        "journalctl short-iso",
        [b"2026-11-26T03:12:45+0000 node3 python[4242]: " + NCCL, b"2026-11-26T03:12:46+0000 node3 python[4242]: x"],
        [b"[host node3]: " + NCCL, b"[host node3]: x"],
    ),
    (
        "ISO 8601 timestamp + srun --label",
        [b"2026-11-26T03:12:45.123Z  3: " + NCCL, b"2026-11-26T03:12:45.124Z 11: x"],
        [b"[task3]: " + NCCL, b"[task11]: x"],
    ),
    (
        "mpirun --timestamp-output + mpirun --tag-output",
        [b"Thu Nov 26 03:12:45 2026[1,0]<stdout>:" + NCCL, b"Thu Nov 26 03:12:46 2026[1,1]<stdout>:x"],
        [b"[mpirank0]: " + NCCL, b"[mpirank1]: x"],
    ),
]


@pytest.mark.parametrize(("name", "lines", "read"), FORMS, ids=[f[0] for f in FORMS])
def test_each_form_is_found_and_rewritten_line_for_line(name: str, lines: list[bytes], read: list[bytes]) -> None:
    text = b"\n".join(lines) + b"\n"
    prefix = detect(text)
    assert prefix is not None and prefix.name == name
    assert prefix.strip(b"\n" + text)[1:] == b"\n".join(read) + b"\n"


def test_lines_without_the_prefix_pass_unchanged() -> None:
    text = b" 0: a\n 1: b\nTraceback (most recent call last):\n 0: c\n"
    prefix = detect(text)
    assert prefix is not None
    assert prefix.strip(b"\n" + text)[1:] == b"[task0]: a\n[task1]: b\nTraceback (most recent call last):\n[task0]: c\n"


@pytest.mark.parametrize(
    "text",
    [
        NCCL + b"\n" + NCCL + b"\n",  # NCCL's own host:pid:tid is no pdsh host
        b"RuntimeError: NCCL error\nValueError: x\n",  # words, not hosts
        b"[rank0]: x\n[rank1]: y\n",  # torchrun's own prefixes: rank_prefix reads them as they are
        b"epoch 1\n12: loss 0.3\nepoch 2\nepoch 3\n",  # a printout that once looks like an srun label
        b"",
    ],
)
def test_no_prefix_where_most_lines_have_none(text: bytes) -> None:
    assert detect(text) is None


def test_chunks_cut_anywhere_give_the_whole_text_and_the_streams() -> None:
    text = b"".join(b"%2d: line %d of task %d\n" % (i % 5, i, i % 5) for i in range(500))
    prefix = detect(text)
    assert prefix is not None
    whole = prefix.strip(b"\n" + text)[1:]
    for size in (1, 7, 100, 4096):
        stripper = PrefixStripper(prefix)
        out = b"".join(stripper.feed(text[i : i + size]) for i in range(0, len(text), size)) + stripper.feed(
            b"", final=True
        )
        assert out == whole
        assert sorted(stripper.labels) == [b"%d" % t for t in range(5)]
    assert whole.count(b"\n") == text.count(b"\n")


def test_remove_lines_drops_the_tag_too() -> None:
    text = b" 0: Communicators...\n 0: Group 0\n"
    prefix = detect(text)
    assert prefix is not None and prefix.remove_lines(text) == b"Communicators...\nGroup 0\n"
