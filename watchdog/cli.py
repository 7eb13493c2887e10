"""The ``ncclwatch`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__
from .report import EXIT_HANG, EXIT_INCONCLUSIVE, EXIT_NO_HANG
from .state import DEFAULT_WINDOW

ANALYZE_HELP = f"""\
Say which rank a hung job is waiting on, and why, from the files it left:
NCCL debug files (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL,
NCCL_DEBUG_FILE=dir/%h.%p), PyTorch Flight Recorder dumps (pickle or JSON),
NCCL RAS reports (text or JSON), worker and torchrun logs, py-spy JSON
dumps and ncclwatch NVML snapshots.  File types are recognised by content;
give files or folders (searched recursively) in any mix.

verdicts:
  collective_mismatch   ranks issued different operations at the same position
  rank_behind           some ranks never entered the collective the others wait in
  process_dead          a rank exited without shutting NCCL down
  stuck_in_collective   every rank issued it, it never completed
  no_hang               the job ended cleanly, or nothing is pending
  inconclusive          not enough evidence (the report says what is missing)

exit status:
  {EXIT_NO_HANG}  no hang
  {EXIT_HANG}  a hang verdict (culprit in the report)
  {EXIT_INCONCLUSIVE}  inconclusive, or no usable input

examples:
  ncclwatch analyze ./nccl-logs/
  ncclwatch analyze ./nccl-logs/ ./fr-dumps/ --json | jq .culprit_ranks
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ncclwatch",
        description="Hang watchdog for distributed PyTorch training on NVIDIA GPUs.",
    )
    parser.add_argument("--version", action="version", version=f"ncclwatch {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    analyze = commands.add_parser(
        "analyze",
        help="give the verdict on a hung job from its files",
        description=ANALYZE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    analyze.add_argument("paths", nargs="+", metavar="PATH", help="files or folders (recursive)")
    analyze.add_argument("--json", action="store_true", help="print only the report, as JSON, on stdout")
    analyze.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        metavar="N",
        help=f"operations kept per rank and communicator; older ones are folded into a digest (default {DEFAULT_WINDOW})",
    )
    return parser


def run_analyze(args: argparse.Namespace) -> int:
    from .analyze import analyze_paths
    from .report import render_text

    if args.window < 16:
        print("ncclwatch analyze: --window must be at least 16", file=sys.stderr)
        return EXIT_INCONCLUSIVE
    report = analyze_paths(args.paths, window=args.window)
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        print(render_text(report))
        unread = [i for i in report.inputs if i.note and not i.kinds]
        if unread:
            print(f"\n{len(unread)} input file(s) not used (--json lists them)", file=sys.stderr)
    return report.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "analyze":
        return run_analyze(args)
    parser.print_help()
    return EXIT_INCONCLUSIVE
