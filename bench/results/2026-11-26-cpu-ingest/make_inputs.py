"""The extra inputs of the 2026-11-26 ingest A/B (BENCHMARKS.md): python make_inputs.py OUT.

OUT/hang: bench/ingest.py's 4 ranks x 500k lines with no Destroy line and rank 3 stopped 1,000 lines early
(a rank_behind verdict whose citations are looked up in two files); OUT/combined.out: bench/combined_stderr.py's
file at 0.25 GB; OUT/stderr: a rank's log with a training print every 50 lines, two ranks' logs merged 7 lines at
a time, and a log with torchrun's [rank0]: prefix on every line.
"""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(BENCH))
from combined_stderr import write  # noqa: E402
from ingest import write_rank_log  # noqa: E402

out = Path(sys.argv[1])
(out / "hang").mkdir(parents=True, exist_ok=True)
for rank in range(4):
    path = out / "hang" / f"nccl.node1.{700 + rank}.log"
    write_rank_log(path, rank, 4, 500_000)
    lines = path.read_text().splitlines()[:-1]  # no Destroy
    path.write_text("\n".join(lines[: len(lines) - (999 if rank == 3 else 0)]) + "\n")
write(out / "combined.out", 0.25)
(out / "stderr").mkdir(exist_ok=True)
a, b = (out / "stderr" / "a.tmp"), (out / "stderr" / "b.tmp")
write_rank_log(a, 0, 2, 300_000)
write_rank_log(b, 1, 2, 300_000)
la, lb = a.read_text().splitlines(), b.read_text().splitlines()
with open(out / "stderr" / "stderr0.log", "w") as fh:
    for i, line in enumerate(la):
        fh.write(line + "\n" + (f"step {i} loss 0.{i % 97} lr 3e-4\n" if i % 50 == 49 else ""))
with open(out / "stderr" / "merged.log", "w") as fh:
    for i in range(0, max(len(la), len(lb)), 7):
        fh.write("".join(line + "\n" for line in la[i : i + 7] + lb[i : i + 7]))
with open(out / "stderr" / "tee0.log", "w") as fh:
    fh.write("".join("[rank0]:" + line + "\n" for line in la))
a.unlink()
b.unlink()
