"""The ``ncclwatch`` command line."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic_core import PydanticUndefined

from ncclwatch.watchdog import __version__
from ncclwatch.watchdog.hang.report import EXIT_DRAINED, EXIT_HANG, EXIT_INCONCLUSIVE, EXIT_KILLED_ON_HANG, EXIT_NO_HANG
from ncclwatch.watchdog.hang.state import DEFAULT_WINDOW
from ncclwatch.watchdog.hang.verdicts import CATALOGUE, DRAIN_ON_DEFAULT, RESTART_ON_DEFAULT, Verdict, VerdictEntry

HELP_COLUMNS = 78


def verdict_lines(entries: Sequence[VerdictEntry]) -> str:
    """One line per verdict: its name, then what it means (the verdict catalogue's words)."""
    width = max(len(entry.verdict.value) for entry in entries) + 2
    return "\n".join(f"  {entry.verdict.value:<{width}}{entry.meaning}" for entry in entries)


def names(verdicts: Iterable[Verdict]) -> str:
    return ", ".join(verdict.value for verdict in verdicts)


def paragraph(text: str, indent: str = "") -> str:
    """Filled to the help's width; an option's name (``--restart-on``) is never split at its hyphens."""
    return textwrap.fill(
        text,
        HELP_COLUMNS,
        initial_indent=indent,
        subsequent_indent=indent,
        break_on_hyphens=False,
        break_long_words=False,
    )


# analyze's help lists every verdict it can give; the wrapper's, every hang it pages; each names the other's own.
ANALYZE_VERDICTS = [entry for entry in CATALOGUE.values() if entry.offline]
PAGED_LIVE = [entry for entry in CATALOGUE.values() if entry.live and entry.hang]
LIVE_ONLY = [verdict for verdict, entry in CATALOGUE.items() if not entry.offline]
FROM_FILES_ONLY = [verdict for verdict, entry in CATALOGUE.items() if entry.hang and not entry.live]

ANALYZE_HELP = f"""\
Say which rank a hung job is waiting on, and why, from the files it left:
NCCL debug files (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL,
NCCL_DEBUG_FILE=dir/%h.%p), PyTorch Flight Recorder dumps (pickle or JSON),
NCCL RAS reports (text or JSON), worker and torchrun logs, py-spy JSON
dumps and ncclwatch NVML snapshots.  File types are recognised by content;
give files or folders (searched recursively) in any mix, "-" for standard
input (a pasted excerpt), gzip/bzip2/xz files as they are.

What a job leaves is enough: each rank's stderr or one combined file
(torchrun --tee "[defaultN]:", PyTorch "[rankN]:", srun --label "N: "),
PyTorch's watchdog timeouts and "PG status" lines (compared per process
group), TORCH_DISTRIBUTED_DEBUG=DETAIL mismatch reports, NCCL excerpts
without their Init lines, network errors (NET/IB completion errors,
"Connection closed by remote peer").  Every input is listed with what it
was read as and how many of its lines were used.

verdicts:
{verdict_lines(ANALYZE_VERDICTS)}
{paragraph(f"live only (ncclwatch --help): {names(LIVE_ONLY)}", "  ")}

exit status:
  {EXIT_NO_HANG}  no hang
  {EXIT_HANG}  a hang verdict (culprit in the report)
  {EXIT_INCONCLUSIVE}  inconclusive, or no usable input

examples:
  ncclwatch analyze ./nccl-logs/
  ncclwatch analyze ./nccl-logs/ ./fr-dumps/ --json | jq .culprit_ranks
  ncclwatch analyze slurm-1234.out rank*.err.gz
  xclip -o | ncclwatch analyze -                 # an excerpt from an issue thread
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
    analyze.add_argument(
        "paths", nargs="+", metavar="PATH", help='files or folders (recursive); "-" reads standard input'
    )
    analyze.add_argument("--json", action="store_true", help="print only the report, as JSON, on stdout")
    analyze.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        metavar="N",
        help=(
            f"operations kept per rank and communicator; older ones are folded into a digest (default {DEFAULT_WINDOW})"
        ),
    )
    return parser


def run_analyze(args: argparse.Namespace) -> int:
    from ncclwatch.watchdog.analyze import analyze_paths
    from ncclwatch.watchdog.hang.report import render_text

    if args.window < 16:
        print("ncclwatch analyze: --window must be at least 16", file=sys.stderr)
        return EXIT_INCONCLUSIVE
    report = analyze_paths(args.paths, window=args.window)
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        print(render_text(report))
        print(render_inputs(report.inputs))
    return report.exit_code


def render_inputs(inputs: list, shown: int = 40) -> str:  # list[InputFile]
    """Every input: what it was read as and what was used, or why it was not used at all."""
    lines = ["", f"inputs ({len(inputs)}):"]
    unused = [i for i in inputs if not i.kinds]
    for item in [i for i in inputs if i.kinds][:shown] + unused[:shown]:
        what = "+".join(item.kinds) if item.kinds else "not used"
        lines.append(f"  - {item.path}: {what}" + (f" — {item.note}" if item.note else ""))
    hidden = len(inputs) - min(shown, len(inputs) - len(unused)) - min(shown, len(unused))
    if hidden > 0:
        lines.append(f"  ... {hidden} more (--json lists them all)")
    return "\n".join(lines)


AFTER_THE_PAGE = paragraph(
    "after the page (--on-hang): report leaves the job running (the default); kill ends it; restart ends the "
    "workers so that torchrun restarts them from the job's last checkpoint, on every node (needs torchrun's "
    f"--max-restarts), where a restart can help: --restart-on verdicts (default: {names(RESTART_ON_DEFAULT)}), and "
    "never twice for the same hang (verdict, operation, line, step).  --drain slurm drains a node whose hardware "
    f"the verdict blames (--drain-on, default: {names(DRAIN_ON_DEFAULT)}) and ends the job with exit {EXIT_DRAINED}; "
    "--on-hang-exec CMD runs your command with the verdict."
)

WRAP_HELP = f"""\
Run a torchrun job exactly as torchrun would (same output, exit code and
signals) with a watchdog beside it.  When a collective stops making progress
it names the rank at fault and why within seconds, prints the verdict here,
and writes a root-cause bundle (report.json, report.md, py-spy stacks of
every rank, Flight Recorder dumps, NCCL log tails, /proc, NVML, RAS,
InfiniBand counters) to --bundle-dir.  No change to the training code: the
heartbeat comes from torch's optimizer step hook (or call ncclwatch.beat(step)).

usage:
  ncclwatch [OPTIONS] torchrun [TORCHRUN ARGS...]
  ncclwatch [OPTIONS] python -m torch.distributed.run [ARGS...]
  ncclwatch demo [--fault FAULT] [OPTIONS]     a CPU job that hangs on purpose
  ncclwatch analyze PATH...                    the verdict from files a job left
  ncclwatch serve [--bundle-dir DIR]           the bundles' page, API and /metrics

verdicts (live):
{verdict_lines(PAGED_LIVE)}
{paragraph(f"from files only (ncclwatch analyze --help): {names(FROM_FILES_ONLY)}", "  ")}

{AFTER_THE_PAGE}

timing: the stall timeout is learned: 3 x the longest gap between progress the
job showed in the last 15 minutes, at least --stall-timeout-floor
(default 5 s); until the job has shown 8 steps, --warmup-stall-timeout
(default 300 s) covers start-up and compilation.  A pause with no rank in a
collective (checkpoint, evaluation) is never a collective hang.

every option is also an environment variable NCCLWATCH_<OPTION> and a key in
a TOML file (--config, NCCLWATCH_CONFIG, or ./ncclwatch.toml); the command
line wins over the environment, which wins over the file.

alerts (environment or TOML): NCCLWATCH_PAGERDUTY_ROUTING_KEY, NCCLWATCH_SLACK_WEBHOOK_URL,
NCCLWATCH_WEBHOOK_URL with NCCLWATCH_WEBHOOK_SECRET; one page per hang, resolved when
the job moves again or ends cleanly; undelivered alerts wait in <bundle-dir>/.spool.

examples:
  ncclwatch torchrun --nproc_per_node=8 train.py
  ncclwatch --on-hang kill --bundle-dir /shared/bundles torchrun --nnodes=4 ... train.py
  NCCLWATCH_API_TOKEN=... ncclwatch --listen 0.0.0.0:9464 torchrun ...   # page, API, /metrics

exit status: torchrun's own; {EXIT_KILLED_ON_HANG} when ncclwatch ended the job after a hang (--on-hang kill,
or restart when a restart cannot help); {EXIT_DRAINED} when it drained the culprit's node (--drain).
"""

SUBCOMMANDS = ("analyze", "demo", "serve", "preflight")
DEMO_FAULTS = ("skip", "extra", "python_stuck", "sigstop", "exit", "pause", "uneven", "none")  # no GPU needed


def help_with_default(field: Any) -> str:
    """A setting's description and, when it has one, its default (the option's own default is None: "not given")."""
    default = field.default
    if default is None or default is PydanticUndefined or isinstance(default, bool):
        return field.description or ""
    shown = f"{default:g}" if isinstance(default, float) else str(default)
    return f"{field.description} (default: {shown})"


def add_watch_options(parser: argparse.ArgumentParser) -> None:
    from ncclwatch.watchdog.config import Settings

    fields = Settings.model_fields
    add = lambda flag, **kw: parser.add_argument(
        flag, default=None, help=help_with_default(fields[flag[2:].replace("-", "_")]), **kw
    )
    add("--stall-timeout", type=float, metavar="SECONDS")
    add("--stall-timeout-floor", type=float, metavar="SECONDS")
    add("--warmup-stall-timeout", type=float, metavar="SECONDS")
    add("--progress-timeout", type=float, metavar="SECONDS")
    add("--bundle-dir", metavar="DIR")
    add("--on-hang", choices=("report", "kill", "restart"))
    add("--restart-on", metavar="VERDICT,...")
    add("--drain", choices=("none", "slurm"))
    add("--drain-on", metavar="VERDICT,...")
    add("--on-hang-exec", metavar="CMD")
    add("--hook-timeout", type=float, metavar="SECONDS")
    add("--run-dir", metavar="DIR")
    parser.add_argument(
        "--keep-run-dir", action="store_const", const=True, default=None, help=fields["keep_run_dir"].description
    )
    parser.add_argument(
        "--preflight", action="store_const", const=True, default=None, help=fields["preflight"].description
    )
    add("--evidence-budget", type=float, metavar="SECONDS")
    add("--alert-drain-timeout", type=float, metavar="SECONDS")
    add("--pyspy", metavar="PATH")
    add("--poll-interval", type=float, metavar="SECONDS")
    add("--listen", metavar="HOST:PORT")
    add("--token-file", metavar="FILE")
    add("--public-url", metavar="URL")
    add("--metrics-textfile", metavar="FILE.prom")
    add("--perf-interval", type=float, metavar="SECONDS")
    parser.add_argument("--config", metavar="FILE", help="TOML file with any of these settings")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the watchdog's reasoning to stderr")
    parser.add_argument("--job-name", metavar="NAME", help="names bundles (default: the training script's name)")


def _settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ncclwatch.watchdog.config import Settings, load_settings

    cli = {name: getattr(args, name, None) for name in Settings.model_fields}
    return load_settings(cli, args.config)


def _logging(verbose: bool) -> None:
    import logging

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="ncclwatch %(asctime)s %(message)s")


def run_wrapped(argv: list[str]) -> int:
    from ncclwatch.watchdog.config import ConfigError

    parser = argparse.ArgumentParser(
        prog="ncclwatch", description=WRAP_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"ncclwatch {__version__}")
    add_watch_options(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="torchrun and its arguments")
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    from ncclwatch.launcher.command import is_torchrun, job_name_of

    if not is_torchrun(args.command):
        parser.error(
            f"{args.command[0]!r} is not torchrun: give the torchrun command to watch, e.g. "
            f"'ncclwatch torchrun --nproc_per_node=8 train.py', or a subcommand: {', '.join(SUBCOMMANDS)} "
            "(ncclwatch demo runs a CPU job that hangs on purpose; ncclwatch --help says more)"
        )
    try:
        settings = _settings(args)
    except ConfigError as exc:
        print(f"ncclwatch: {exc}", file=sys.stderr)
        return 2
    from ncclwatch.launcher.run import run_job

    _logging(args.verbose)
    return run_job(list(args.command), settings, args.job_name or job_name_of(args.command))


def run_demo(argv: list[str]) -> int:
    from ncclwatch.launcher.demo_job import FAULTS
    from ncclwatch.watchdog.config import ConfigError

    faults = "\n".join(f"  {name:<13} {FAULTS[name]}" for name in DEMO_FAULTS)
    parser = argparse.ArgumentParser(
        prog="ncclwatch demo",
        description="Run a small gloo (CPU) job under the watchdog in which the last rank misbehaves at step 15, and "
        "watch it get caught, named and bundled. Unlike a real job, the demo ends the hung job after the capture "
        "(--on-hang kill) unless told otherwise.",
        epilog=f"faults (--fault):\n{faults}\n\n'extra' is caught by gloo itself, which checks sizes and raises.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--fault",
        default="skip",
        choices=DEMO_FAULTS,
        help="what the misbehaving rank does (default: skip; the list below)",
    )
    parser.add_argument("--nproc", type=int, default=3, help="ranks (default: 3)")
    parser.add_argument("--steps", type=int, default=40, help="steps of a job that does not hang (default: 40)")
    add_watch_options(parser)
    args = parser.parse_args(argv)
    args.on_hang = args.on_hang or os.environ.get("NCCLWATCH_ON_HANG") or "kill"
    try:
        settings = _settings(args)
    except ConfigError as exc:
        print(f"ncclwatch: {exc}", file=sys.stderr)
        return 2
    from pathlib import Path

    from ncclwatch.launcher import demo_job
    from ncclwatch.launcher.run import run_job

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "--monitor-interval=0.5",
        str(Path(demo_job.__file__)),
        f"--fault={args.fault}",
        f"--steps={args.steps}",
    ]
    print(f"ncclwatch demo: {' '.join(command)}", file=sys.stderr, flush=True)
    _logging(args.verbose)
    return run_job(command, settings, args.job_name or f"demo-{args.fault}")


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "demo":
        return run_demo(args_list[1:])
    if args_list and args_list[0] == "preflight":
        from ncclwatch.watchdog.preflight import main as run_preflight

        return run_preflight(args_list[1:])
    if args_list and args_list[0] == "serve":
        from ncclwatch.watchdog.server.agent import run_serve

        return run_serve(args_list[1:])
    if not args_list or args_list[0] not in SUBCOMMANDS:
        return run_wrapped(args_list)
    parser = build_parser()
    args = parser.parse_args(args_list)
    return run_analyze(args)
