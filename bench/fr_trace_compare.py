#!/usr/bin/env python3
"""``ncclwatch analyze`` against PyTorch's own analyzer on the same Flight Recorder dumps (issue 31).

Every set of real dumps of a real hang the repository holds (tests/fixtures,
../shared/fixtures, the bundles under bench/results) is given, as the same
files, to ``ncclwatch analyze`` and to ``python -m
torch.distributed.flight_recorder.fr_trace`` (default, then ``--mismatch_cap
1000``).  The truth of each set is the fault that was injected, as its run
recorded it (capture's expected.json "whole", bench/hard_cases.py's
scenario, the fixture's README), never what analyze says.  Where the set
came as bundles, analyze is also run on the bundles themselves (the live
incident's files: stacks, journal).

Right, for analyze: the verdict and the culprit ranks are the truth's.  For
fr_trace (it has no verdicts): its first collective error names the truth's
ranks with a matching kind (collective_mismatch: COLLECTIVE_TYPE, SIZE_OR_SYNTAX
or COLLECTIVE_DTYPE mismatch; rank_behind: "Not all ranks joining", missing
ranks; gpu_compute_hang: COLLECTIVE_STATE_MISMATCH), or, for a p2p_deadlock,
no collective error comes first and it flags a p2p MISMATCH listing the hung
recvs (their sizes) both ways between the two culprits: it lists the pairs of
batched sends and recvs as MISMATCH on healthy jobs too.
Refusing the set (a missing dump, a crash) is not right.

Healthy captures (truth no_hang, dumps taken while the job ran) are controls:
in the table, not in the totals.

fr_trace needs ``tabulate`` (without it, it crashes printing its first p2p table).

    python3 bench/fr_trace_compare.py --out bench/results/2026-11-26-cpu-fr-trace
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ncclwatch.watchdog.bundles_in import unpack_bundle

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
SHARED = REPO.parent / "shared" / "fixtures"
RESULTS = REPO / "bench" / "results"
FR_CAP = 1000


@dataclass(frozen=True)
class Case:
    name: str
    truth: tuple[str, tuple[int, ...]]
    source: str  # where the truth comes from
    dumps: tuple[str, ...] = ()  # folders of dumps, dump files, or .tar.gz of dumps (repo-relative)
    bundles: tuple[str, ...] = ()  # bundles: their fr/ files are the dumps
    nested: tuple[str, str] = ("", "")  # (logs .tar.gz under bench/results, glob of the bundles inside)
    # p2p_deadlock: the sizes of the recv each culprit hangs in (pipeline_job.py's both_recv: one count, [[1]])
    recv_sizes: str = "[[1]]"


def captures() -> list[Case]:
    cases = []
    for folder in sorted((FIXTURES / "captures").glob("nccl-2.28.9-h200x*/*")):
        expected = folder / "expected.json"
        if not (folder / "fr").is_dir() or not expected.exists():
            continue
        whole = json.loads(expected.read_text())["whole"]
        cases.append(
            Case(
                f"{folder.parent.name.removeprefix('nccl-2.28.9-')}/{folder.name}",
                (whole["verdict"], tuple(whole["culprit_ranks"])),
                "the capture's expected.json (whole)",
                dumps=(str((folder / "fr").relative_to(REPO)),),
            )
        )
    return cases


HARD = "bench/hard_cases.py's scenario"
CASES_MORE = [
    Case(
        "2gpu/mismatch_fr",
        ("collective_mismatch", (1,)),
        "tests/fixtures/nccl-2.28.9-2gpu/README.md",
        dumps=("tests/fixtures/nccl-2.28.9-2gpu/mismatch_fr/fr",),
    ),
    Case(
        "h100/fsdp2_skip_rank1_late",
        ("collective_mismatch", (1,)),
        HARD,
        bundles=(
            "tests/fixtures/bundles/nccl-2.28.9-h100x1/"
            "fsdp2_skip_rank1_late-vm-20261124T215626Z-collective_mismatch.tar.gz",
        ),
    ),
    Case(
        "h100/pipeline_missing_send (node 1 only)",
        ("rank_behind", (1,)),
        HARD,
        bundles=(
            "tests/fixtures/bundles/nccl-2.28.9-h100-pipeline-missing-send/"
            "pipeline_missing_send-vm-20261124T221715Z-node_lost.tar.gz",
        ),
    ),
    Case(
        "h100/pipeline_both_recv s6",
        ("p2p_deadlock", (0, 1)),
        HARD,
        nested=("2026-11-24-h100-s6/hard-pipeline-logs.tar.gz", "keep/pipeline_both_recv-*/*.tar.gz"),
    ),
    Case(
        "h100/fsdp2_skip_rank1 s6",
        ("collective_mismatch", (1,)),
        HARD,
        nested=("2026-11-24-h100-s6/hard-rerun-logs.tar.gz", "keep/fsdp2_skip_rank1-*/*.tar.gz"),
    ),
    Case(
        "h100/pipeline_both_recv s6 rerun (node 0 only)",
        ("p2p_deadlock", (0, 1)),
        HARD,
        nested=("2026-11-24-h100-s6/hard-rerun-logs.tar.gz", "keep/pipeline_both_recv-*/*.tar.gz"),
    ),
    Case(
        "h100/pipeline_missing_send s6 rerun",
        ("rank_behind", (1,)),
        HARD,
        nested=("2026-11-24-h100-s6/hard-rerun-logs.tar.gz", "keep/pipeline_missing_send-*/*.tar.gz"),
    ),
    Case(
        "h100/fsdp2_skip_rank1 s7",
        ("collective_mismatch", (1,)),
        HARD,
        nested=("2026-11-25-h100-s7/call4-logs.tar.gz", "keep/fsdp2_skip_rank1-*/*.tar.gz"),
    ),
    Case(
        "h100/fsdp2_skip_rank1_clip_accum s7",
        ("collective_mismatch", (1,)),
        HARD,
        nested=("2026-11-25-h100-s7/call4-logs.tar.gz", "keep/fsdp2_skip_rank1_clip_accum-*/*.tar.gz"),
    ),
    Case(
        "h100/fsdp2_skip_two_nodes s7",
        ("collective_mismatch", (1,)),
        HARD,
        nested=("2026-11-25-h100-s7/call4-logs.tar.gz", "keep/fsdp2_skip_two_nodes-*/*.tar.gz"),
    ),
    *(
        Case(
            f"h100/{run} 2026-11-26",
            truth,
            HARD,
            bundles=tuple(f"bench/results/2026-11-26-h100-fr-captures/{run}-node{n}.tar.gz" for n in (0, 1)),
        )
        for run, truth in (
            ("pipeline_both_recv-bx1x10ws", ("p2p_deadlock", (0, 1))),
            ("pipeline_missing_send-0iptxnwr", ("rank_behind", (1,))),
            ("pipeline_missing_send-zp5a1pqz", ("rank_behind", (1,))),
        )
    ),
    Case(
        "h100/pipeline_both_recv 2026-11-26 (fixture bundles)",
        ("p2p_deadlock", (0, 1)),
        HARD,
        bundles=tuple(f"tests/fixtures/flight_recorder/h100-pipeline-both-recv/node{n}-bundle.tar.gz" for n in (0, 1)),
    ),
    Case(
        "h100/pipeline_both_recv torch's timeout dumps",
        ("p2p_deadlock", (0, 1)),
        "tests/fixtures/flight_recorder/h100-pipeline-both-recv/README.md",
        dumps=("tests/fixtures/flight_recorder/h100-pipeline-both-recv/timeout-dumps.tar.gz",),
    ),
    Case(
        "h100/gpu_job dtype",
        ("collective_mismatch", (1,)),
        "tests/fixtures/flight_recorder/h100-dtype-mismatch/README.md",
        bundles=("tests/fixtures/flight_recorder/h100-dtype-mismatch/bundle.tar.gz",),
    ),
    Case(
        "gloo/pipeline_both_recv",
        ("p2p_deadlock", (0, 1)),
        "tests/fixtures/flight_recorder/gloo-pipeline-both-recv/README.md",
        bundles=tuple(f"tests/fixtures/flight_recorder/gloo-pipeline-both-recv/node{n}-bundle.tar.gz" for n in (0, 1)),
    ),
    *(
        Case(
            f"gloo/demo {Path(bundle).parent.name} {i}",
            ("collective_mismatch", (2,)),
            f"{Path(bundle).parent.relative_to(REPO)}/README.md (rank 2 skips step 15's all_reduce)",
            bundles=(str(Path(bundle).relative_to(REPO)),),
        )
        for i, bundle in enumerate(sorted(FIXTURES.glob("bundles/demo-cpu-*/*.tar.gz")))
    ),
]


# --------------------------------------------------------------------------
# the dumps of a case, as files named <prefix><rank> in one folder
# --------------------------------------------------------------------------

_RANK = re.compile(r"(\d+)$")


def gather(case: Case, work: Path) -> tuple[Path, list[Path]]:
    """(folder of the case's dumps as nccl_trace_rank_<rank>, the bundles to give analyze as they are)."""
    dumps, loose = work / "dumps", work / "loose"
    dumps.mkdir()
    loose.mkdir()
    bundles = [REPO / b for b in case.bundles]
    if case.nested[0]:
        outer = work / "outer"
        unpack_bundle(str(RESULTS / case.nested[0]), outer)
        bundles += sorted(outer.glob(case.nested[1]))
    sources = [REPO / d for d in case.dumps]
    for index, archive in enumerate([*bundles, *(s for s in sources if s.name.endswith(".tar.gz"))]):
        unpack_bundle(str(archive), loose / str(index))
    files = [f for s in sources if s.is_dir() for f in s.iterdir()]
    files += [s for s in sources if s.is_file() and not s.name.endswith(".tar.gz")]
    files += [f for f in loose.rglob("*") if f.is_file() and (f.parent.name == "fr" or not case.bundles)]
    for f in files:
        match = _RANK.search(f.name)
        if match and "trace" in f.name:
            shutil.copy(f, dumps / f"nccl_trace_rank_{match[1]}")
    return dumps, bundles


def fingerprint(folder: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        digest.update(f.name.encode() + hashlib.sha256(f.read_bytes()).digest())
    return digest.hexdigest()[:16]


# --------------------------------------------------------------------------
# the two analyzers
# --------------------------------------------------------------------------


def ncclwatch(paths: list[Path]) -> dict:  # type: ignore[type-arg]
    began = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "ncclwatch", "analyze", "--json", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = round(time.perf_counter() - began, 2)
    if not proc.stdout.strip():
        return {"verdict": None, "culprits": [], "said": proc.stderr.strip()[-300:], "exit": proc.returncode}
    report = json.loads(proc.stdout)
    return {
        "verdict": report["verdict"],
        "culprits": report["culprit_ranks"],
        "kind": report.get("kind"),
        "headline": report.get("headline"),
        "exit": proc.returncode,
        "wall_s": wall,
    }


_CULPRIT = re.compile(r"Culprit rank (\d+); Error type: (\w+)")
_NOT_ALL = re.compile(r"Not all ranks joining collective, sequence number: (\d+)")
_MISSING = re.compile(r"missing ranks: \{([\d, ]*)\}")
_NO_DUMP = re.compile(r"Missing dump files from ranks \{([\d, ]*)\}")
_RECV = re.compile(r"recv\(s=(\d+) d=(\d+), input_sizes=(\[[^=]*\]), state")
_MISMATCH_KINDS = {"COLLECTIVE_TYPE_MISMATCH", "SIZE_OR_SYNTAX_MISMATCH", "COLLECTIVE_DTYPE_MISMATCH"}


def fr_trace(folder: Path, cap: int | None) -> dict:  # type: ignore[type-arg]
    """What fr_trace said: its first collective error, its p2p mismatches' recvs, or why it gave none."""
    command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", "-p", "nccl_trace_rank_"]
    began = time.perf_counter()
    proc = subprocess.run(
        [*command, *(["--mismatch_cap", str(cap)] if cap else []), str(folder)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = round(time.perf_counter() - began, 2)
    out = proc.stdout + proc.stderr
    first = None
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if m := _CULPRIT.search(line):
            first = {"kind": m[2], "ranks": [int(m[1])], "line": line.strip()[:160]}
            break
        if m := _NOT_ALL.search(line):
            missing = next((_MISSING.search(x) for x in lines[i : i + 40] if _MISSING.search(x)), None)
            ranks = sorted(int(r) for r in missing[1].split(",") if r.strip()) if missing else []
            first = {"kind": "NOT_ALL_RANKS_JOINING", "ranks": ranks, "line": f"{line.strip()}; missing {ranks}"}
            break
    recvs = sorted({(int(m[1]), int(m[2]), m[3]) for m in _RECV.finditer(out)} if "MISMATCH" in out else set())
    no_dump = _NO_DUMP.search(out)
    crashed = "Traceback (most recent call last)" in out
    if first:
        summary = first["line"]
    elif no_dump:
        summary = f"refused: missing dump files from ranks {{{no_dump[1]}}}"
    elif crashed:
        summary = "crashed: " + next((x for x in reversed(lines) if x.strip()), "")[:120]
    elif recvs:
        summary = "p2p MISMATCH only"
    else:
        summary = "no error found"
    if recvs:
        summary += f" (+ p2p MISMATCH, recvs {', '.join(f'{s}->{d} {z}' for s, d, z in recvs[:6])})"
    return {"first": first, "p2p_recvs": recvs, "summary": summary, "exit": proc.returncode, "wall_s": wall}


def fr_right(said: dict, case: Case) -> bool:  # type: ignore[type-arg]
    verdict, culprits = case.truth
    first = said["first"]
    if verdict == "p2p_deadlock":
        # fr_trace lists p2p MISMATCHes on healthy jobs too (a ring's or a pipeline's batched pairs, both healthy
        # controls): only the hung recvs themselves, both ways between the pair, count, and no collective error first
        pair = {(culprits[0], culprits[1], case.recv_sizes), (culprits[1], culprits[0], case.recv_sizes)}
        return first is None and len(culprits) == 2 and pair <= set(map(tuple, said["p2p_recvs"]))
    if first is None or tuple(first["ranks"]) != culprits:
        return False
    kinds = {
        "collective_mismatch": _MISMATCH_KINDS,
        "rank_behind": {"NOT_ALL_RANKS_JOINING"},
        "gpu_compute_hang": {"COLLECTIVE_STATE_MISMATCH"},
    }
    return first["kind"] in kinds.get(verdict, set())


def run_case(case: Case) -> dict:  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory(prefix="fr-compare-") as tmp:
        dumps, bundles = gather(case, Path(tmp))
        ranks = sorted(int(_RANK.search(f.name)[1]) for f in dumps.iterdir())  # type: ignore[index]
        ours = ncclwatch([dumps])
        ours_bundles = ncclwatch(bundles) if bundles else None
        theirs = {"default": fr_trace(dumps, None), f"cap{FR_CAP}": fr_trace(dumps, FR_CAP)}
        truth = case.truth
        return {
            "case": case.name,
            "truth": [truth[0], list(truth[1])],
            "truth_from": case.source,
            "dump_ranks": ranks,
            "dumps_sha": fingerprint(dumps),
            "ncclwatch": ours,
            "ncclwatch_right": (ours["verdict"], tuple(ours["culprits"])) == truth,
            "ncclwatch_bundles": ours_bundles,
            "ncclwatch_bundles_right": (ours_bundles["verdict"], tuple(ours_bundles["culprits"])) == truth
            if ours_bundles
            else None,
            "fr_trace": theirs,
            "fr_trace_right": {k: fr_right(v, case) for k, v in theirs.items()},
        }


def markdown(rows: list[dict]) -> str:  # type: ignore[type-arg]
    mark = {True: "yes", False: "no", None: "-"}
    lines = [
        "| case | truth | dumps of | analyze (dumps) | right | analyze (bundles) | fr_trace | right (default / cap) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ours, bundles = r["ncclwatch"], r["ncclwatch_bundles"]
        said = r["fr_trace"][f"cap{FR_CAP}"]["summary"].replace("|", "/")
        truth = f"{r['truth'][0]} {r['truth'][1]}"
        kind = f" ({ours['kind']})" if ours.get("kind") else ""
        lines.append(
            f"| {r['case']} | {truth} | {r['dump_ranks']} | {ours['verdict']} {ours['culprits']}{kind} | "
            f"{mark[r['ncclwatch_right']]} | "
            f"{(bundles['verdict'] + ' ' + str(bundles['culprits'])) if bundles else '-'}"
            f"{' ' + mark[r['ncclwatch_bundles_right']] if bundles else ''} | {said[:150]} | "
            f"{mark[r['fr_trace_right']['default']]} / {mark[r['fr_trace_right'][f'cap{FR_CAP}']]} |"
        )
    controls = [r for r in rows if r["truth"][0] == "no_hang"]
    rows = [r for r in rows if r["truth"][0] != "no_hang"]
    n = len(rows)
    with_bundles = [r for r in rows if r["ncclwatch_bundles"]]
    ours = sum(r["ncclwatch_right"] for r in rows)
    ours_bundles = sum(r["ncclwatch_bundles_right"] for r in with_bundles)
    default = sum(r["fr_trace_right"]["default"] for r in rows)
    capped = sum(r["fr_trace_right"][f"cap{FR_CAP}"] for r in rows)
    lines += [
        "",
        f"Totals over {n} sets of dumps of a hang ({len(controls)} healthy controls left out): analyze {ours}/{n} "
        f"from the dumps alone ({ours_bundles}/{len(with_bundles)} from the bundles, where the set came as bundles); "
        f"fr_trace {default}/{n} by default, {capped}/{n} with --mismatch_cap {FR_CAP}.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for rows.jsonl and table.md")
    parser.add_argument("--only", nargs="*", help="cases whose name contains one of these")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = captures() + CASES_MORE
    if args.only:
        cases = [c for c in cases if any(o in c.name for o in args.only)]
    rows, seen = [], {}
    for case in cases:
        row = run_case(case)
        if row["dumps_sha"] in seen:  # the same files reached twice (a fixture copied from a results bundle)
            print(f"{case.name}: the same dumps as {seen[row['dumps_sha']]}, left out", flush=True)
            continue
        seen[row["dumps_sha"]] = case.name
        rows.append(row)
        ours, said = row["ncclwatch"], row["fr_trace"][f"cap{FR_CAP}"]["summary"][:90]
        print(
            f"{case.name}: truth {row['truth']} | analyze {ours['verdict']} {ours['culprits']} "
            f"{row['ncclwatch_right']} | fr_trace {row['fr_trace_right']} {said}",
            flush=True,
        )
    with (out / "rows.jsonl").open("w") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows)
    (out / "table.md").write_text(markdown(rows) + "\n")
    print(markdown(rows).splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
