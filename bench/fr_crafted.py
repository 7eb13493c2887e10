"""Time and peak memory of the Flight Recorder parser on crafted (hostile) dumps, each in a fresh process.

A pickle's memo lets a few bytes stand for a reference to an object already
built, so a small file can describe an enormous tree.  These inputs are the
ones issue 13 names, plus its siblings; each is written with raw opcodes:

  entries_repeat   4 MB: ``entries`` is one dict referenced 2,000,000 times
  frames_repeat  0.5 MB: 2,000 entries share one ``frames`` list of 250,000 references to one frame
  sizes_repeat   0.5 MB: 2,000 entries share one ``input_sizes`` list of 250,000 references to one shape
  long_name        2 MB: 2,000 entries share one 2 MB ``profiling_name``
  real             the real 2-GPU Flight Recorder dump (tests/fixtures), for comparison

    python bench/fr_crafted.py                # all, a table on stdout (copy into BENCHMARKS.md)
    python bench/fr_crafted.py entries_repeat
    git show 115da06:watchdog/parsing/flight_recorder.py > /tmp/fr_before.py
    python bench/fr_crafted.py --parser /tmp/fr_before.py      # the parser before the bounds

Peak memory is the child's ru_maxrss (the Python interpreter and the parser's
imports included, about 40 MB of it).  Each child is capped at ``--limit-gib``
of address space and ``--timeout`` seconds (an unbounded parser would take the
machine down on frames_repeat: 500 million frames); a child stopped there is
reported as such.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REAL = REPO / "tests/fixtures/nccl-2.28.9-2gpu/mismatch_fr/fr/nccl_trace_rank_0"


def _str(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data  # BINUNICODE


def _put(slot: int) -> bytes:
    return b"r" + slot.to_bytes(4, "little")  # LONG_BINPUT


def _get(slot: int) -> bytes:
    return b"j" + slot.to_bytes(4, "little")  # LONG_BINGET


def _repeat(slot: int, times: int) -> bytes:
    """A list holding ``times`` references to memo ``slot`` (MARK, gets, APPENDS), 2 bytes each with BINGET."""
    one = b"h" + bytes([slot]) if slot < 256 else _get(slot)
    return b"](" + one * times + b"e"


def _dump(entries: bytes) -> bytes:
    """A 2.10 dump: {version: "2.10", pg_config: {}, entries: <entries>}."""
    return b"\x80\x02}(" + _str("version") + _str("2.10") + _str("pg_config") + b"}" + _str("entries") + entries + b"u."


def _entry(extra: bytes = b"") -> bytes:
    """One entry dict, left on the stack; ``extra`` is more key/value pairs."""
    return (
        b"}("
        + _str("record_id")
        + b"K\x01"
        + _str("pg_id")
        + b"K\x00"
        + _str("collective_seq_id")
        + b"K\x01"
        + _str("profiling_name")
        + _str("nccl:all_reduce")
        + _str("state")
        + _str("scheduled")
        + extra
        + b"u"
    )


def entries_repeat() -> bytes:
    return _dump(_entry() + b"q\x01" + b"0" + _repeat(1, 2_000_000))  # POP: the entry is built once, then referenced


def frames_repeat() -> bytes:
    frame = b"}(" + _str("name") + _str("f") + _str("filename") + _str("x.py") + _str("line") + b"K\x01u" + b"q\x01"
    frames = b"0" + _repeat(1, 250_000) + b"q\x02"
    return _dump(frame + frames + b"0" + _entry(_str("frames") + b"h\x02") + b"q\x03" + b"0" + _repeat(3, 2_000))


def sizes_repeat() -> bytes:
    shape = b"](K\x04K\x04e" + b"q\x01"
    sizes = b"0" + _repeat(1, 250_000) + b"q\x02"
    return _dump(shape + sizes + b"0" + _entry(_str("input_sizes") + b"h\x02") + b"q\x03" + b"0" + _repeat(3, 2_000))


def long_name() -> bytes:
    name = _str("nccl:all_reduce " + "x" * (2 << 20)) + b"q\x01" + b"0"
    entry = b"}(" + _str("record_id") + b"K\x01" + _str("profiling_name") + b"h\x01" + b"u" + b"q\x02" + b"0"
    return _dump(name + entry + _repeat(2, 2_000))


def real() -> bytes:
    return REAL.read_bytes()


INPUTS = {f.__name__: f for f in (entries_repeat, frames_repeat, sizes_repeat, long_name, real)}

CHILD = """
import importlib.util, json, resource, sys, time
if len(sys.argv) > 2:  # another version of the parser, e.g. git show <commit>:watchdog/parsing/flight_recorder.py
    spec = importlib.util.spec_from_file_location("flight_recorder_under_test", sys.argv[2])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parse_flight_recorder = module.parse_flight_recorder
else:
    from ncclwatch.watchdog.parsing.flight_recorder import parse_flight_recorder
data = open(sys.argv[1], "rb").read()
start = time.perf_counter()
events = parse_flight_recorder(data, "nccl_trace_rank_0")
seconds = time.perf_counter() - start
event = events[0]
what = getattr(event, "reason", None) or f"{len(event.entries)} entries"
print(json.dumps({"seconds": seconds, "what": what, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def measure(name: str, folder: Path, parser: str | None, limit_gib: int, timeout_s: float) -> dict[str, object]:
    path = folder / name
    path.write_bytes(INPUTS[name]())
    command = [sys.executable, "-c", CHILD, str(path), *([parser] if parser else [])]

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_gib << 30, limit_gib << 30))

    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False, preexec_fn=cap, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"input": name, "bytes": path.stat().st_size, "error": f"still running after {timeout_s} s (stopped)"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        if "MemoryError" in last:
            last = f"MemoryError: over the {limit_gib} GiB cap"
        return {"input": name, "bytes": path.stat().st_size, "error": last}
    result = json.loads(done.stdout)
    peak = f"{result['peak_kib'] / 1024:.0f}"
    return {
        "input": name,
        "bytes": path.stat().st_size,
        "seconds": round(result["seconds"], 2),
        "peak_mib": peak,
        "what": result["what"][:110],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*", default=list(INPUTS))
    parser.add_argument("--parser", metavar="FILE", help="flight_recorder.py to measure instead of the installed one")
    parser.add_argument("--limit-gib", type=int, default=8, help="address-space cap per child (default 8)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per child (default 180)")
    args = parser.parse_args()
    print("| input | file | parse time | peak RSS (MiB) | result |\n| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="ncclwatch-bench-fr-") as folder:
        for name in args.inputs:
            row = measure(name, Path(folder), args.parser, args.limit_gib, args.timeout)
            if "error" in row:
                print(f"| {name} | {row['bytes']} B | - | - | failed: {row['error']} |")
                continue
            print(f"| {name} | {row['bytes'] / 1e6:.1f} MB | {row['seconds']} s | {row['peak_mib']} | {row['what']} |")


if __name__ == "__main__":
    main()
