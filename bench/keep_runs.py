"""Pack what a GPU call brings back of bench/job_shapes.py's runs: every run's wrapper output, and the whole folder
(bundles under 2 MB) of each run that was not right.

    python3 bench/keep_runs.py OUT.tar.gz ROWS.jsonl [ROWS.jsonl ...]
"""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

BIGGEST = 2_000_000  # a call brings back few files of at most 16 MiB: leave out the odd large bundle


def main(argv: list[str]) -> int:
    out, *files = argv
    rows = [json.loads(line) for name in files if Path(name).exists() for line in Path(name).read_text().splitlines()]
    with tarfile.open(out, "w:gz") as tar:
        for row in rows:
            work = Path(row.get("work", ""))
            if not work.is_dir():
                continue
            for path in sorted(p for p in work.rglob("*") if p.is_file()):
                if path.suffix == ".stderr" or (not row["right"] and path.stat().st_size < BIGGEST):
                    tar.add(path, arcname=f"{work.name}/{path.relative_to(work)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
