"""The ``ncclwatch`` command line."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import sys
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic_core import PydanticUndefined

from ncclwatch.watchdog import __version__
from ncclwatch.watchdog.hang.report import (
    EXIT_DRAINED,
    EXIT_HANG,
    EXIT_INCONCLUSIVE,
    EXIT_KILLED_ON_HANG,
    EXIT_NO_HANG,
    EXIT_UNREADABLE,
)
from ncclwatch.watchdog.hang.state import DEFAULT_WINDOW
from ncclwatch.watchdog.hang.verdicts import (
    CATALOGUE,
    DRAIN_ON_DEFAULT,
    RESTART_ON_DEFAULT_NAMES,
    Verdict,
    VerdictEntry,
)
from ncclwatch.watchdog.provenance import EXIT_MIXED_JOBS

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
dumps, ncclwatch NVML snapshots and bundles (.tar.gz).  File types are
recognised by content; give files or folders (searched recursively, the
bundles in them unpacked) in any mix, "-" for standard input (a pasted
excerpt), gzip/bzip2/xz files as they are.

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
  {EXIT_INCONCLUSIVE}  inconclusive (the report says what would decide it)
  {EXIT_UNREADABLE}  no report: no input could be read (missing, a bundle cut short), or
     none holds anything analyze reads (empty, binary or other files).
     One line on stderr says so.
  {EXIT_MIXED_JOBS}  no report: the inputs hold bundles or run folders of different jobs
     (torchrun's run id, or its store under static rendezvous, in their
     journals).  One line on stderr names each job's files, hosts, pids and
     times; give one job at a time.  Restart rounds of one job are not
     refused: the newest round is judged, the older rounds' files are set
     aside, and the report says so; loose Flight Recorder dumps of two runs
     (told apart by when they enqueued the same collectives) likewise.  NCCL
     logs without a journal are told apart by commId, host and pid: each
     communicator is judged apart, the most severe verdict given and the jobs
     found said.
  An input that cannot be read beside readable ones is said on stderr and
  in the inputs list; the others are judged and the status is the verdict's,
  also when the output's reader stops early (| head).

examples:
  ncclwatch analyze ./nccl-logs/
  ncclwatch analyze ./nccl-logs/ ./fr-dumps/ --json | jq .culprit_ranks
  ncclwatch analyze slurm-1234.out rank*.err.gz
  xclip -o | ncclwatch analyze -                 # an excerpt from an issue thread
  ncclwatch analyze bundle.tar.gz --rank 3 --pg default_pg --stack   # rank 3's newest entries, full frames
"""


def analyze_parser() -> argparse.ArgumentParser:
    analyze = argparse.ArgumentParser(
        prog="ncclwatch analyze", description=ANALYZE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
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
    entries = analyze.add_argument_group(
        "Flight Recorder entries",
        # the parser's formatter keeps descriptions as written: lines broken by hand
        "After the verdict, print the entries of the dumps given, one row each: rank,\n"
        "position (collective or p2p number), process group, op, state (as the\n"
        "verdict read it), input sizes, dtype, the user's call site.  --rank, --pg\n"
        "and --stack imply --entries; the verdict is always judged on every input.",
    )
    entries.add_argument("--entries", action="store_true", help="print the matched entries after the verdict")
    entries.add_argument(
        "--rank",
        action="append",
        type=_rank_list,
        default=[],
        metavar="N[,N...]",
        help="only these global ranks' dumps (repeat, or a comma list: --rank 1,3)",
    )
    entries.add_argument(
        "--pg",
        action="append",
        default=[],
        metavar="NAME_OR_ID",
        help="only this process group, by id (0) or description (default_pg, mesh_tp); repeatable",
    )
    entries.add_argument(
        "--last",
        type=int,
        default=20,
        metavar="N",
        help="the newest N entries of each rank and process group (default 20; 0: all)",
    )
    entries.add_argument("--stack", action="store_true", help="every frame Flight Recorder recorded, under each row")
    return analyze


def _rank_list(text: str) -> list[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rank or a comma list of ranks: {text!r}") from None
    if not ranks or any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"ranks are whole numbers from 0: {text!r}")
    return ranks


UNREADABLE_SAID = 10  # inputs that could not be read, each a line on stderr; past this, a count
ANALYZE_READS = (
    "analyze reads NCCL debug logs, Flight Recorder dumps, NCCL RAS reports, worker or torchrun logs, py-spy dumps "
    "and ncclwatch bundles (ncclwatch analyze --help)"
)


def run_analyze(argv: list[str]) -> int:
    from ncclwatch.watchdog import fr_entries
    from ncclwatch.watchdog.analyze import analyze_with_dumps
    from ncclwatch.watchdog.hang.report import render_text
    from ncclwatch.watchdog.inputs import NO_SUCH_FILE, cannot_read
    from ncclwatch.watchdog.provenance import MixedJobs

    parser = analyze_parser()
    args = parser.parse_args(argv)
    if args.window < 16:
        print("ncclwatch analyze: --window must be at least 16", file=sys.stderr)
        return EXIT_INCONCLUSIVE
    chosen = fr_entries.EntryFilter(
        pgs=tuple(args.pg), ranks=tuple(r for group in args.rank for r in group), last=max(args.last, 0)
    )
    show_entries = args.entries or args.stack or bool(chosen.pgs or chosen.ranks)
    if show_entries and args.json:
        parser.error("--json prints the report alone; --entries, --rank, --pg and --stack print Flight Recorder "
                     "entries as text: give one or the other")  # fmt: skip
    try:
        report, dumps = analyze_with_dumps(args.paths, window=args.window)
    except MixedJobs as mixed:
        print(f"ncclwatch analyze: {mixed}", file=sys.stderr)
        return EXIT_MIXED_JOBS
    unreadable = [item for item in report.inputs if cannot_read(item)]
    for item in unreadable[:UNREADABLE_SAID]:
        said = f"no such file: {item.path}" if item.note == NO_SUCH_FILE else f"{item.path}: {item.note}"
        print(f"ncclwatch analyze: {said}", file=sys.stderr)
    if len(unreadable) > UNREADABLE_SAID:
        print(f"ncclwatch analyze: {len(unreadable) - UNREADABLE_SAID} more could not be read", file=sys.stderr)
    if not any(item.kinds for item in report.inputs):
        if len(unreadable) < len(report.inputs) or not report.inputs:
            print(f"ncclwatch analyze: {nothing_to_judge(report.inputs, args.paths)}", file=sys.stderr)
        return EXIT_UNREADABLE
    if args.json:
        print_out(report.model_dump_json(indent=2))
    else:
        print_out(render_text(report) + "\n" + render_inputs(report.inputs))
    if show_entries:
        rows, said = fr_entries.select(dumps, chosen)
        for line in said:
            print(f"ncclwatch analyze: {line}", file=sys.stderr)
        print_out("\nFlight Recorder entries:\n" + fr_entries.render(rows, stack=args.stack))
    return report.exit_code


def nothing_to_judge(inputs: list, paths: Sequence[str]) -> str:  # list[InputFile], none used
    """One line: what was read (or that nothing was there) and what analyze needs."""
    from collections import Counter

    if not inputs:
        return f"nothing to judge: no files in {', '.join(paths)}; {ANALYZE_READS}"
    from ncclwatch.watchdog.inputs import cannot_read

    read = [item for item in inputs if not cannot_read(item)]
    if len(read) == 1:  # the one input, by name: "x.log is empty", "x.bin: not a recognised format"
        said = _unused(read[0].note or "")
        return f"nothing to judge: {read[0].path}{' is empty' if said == 'empty' else ': ' + said}; {ANALYZE_READS}"
    why = Counter(_unused(item.note or "") for item in read).most_common()
    files = f"{len(read)} file{'s' if len(read) != 1 else ''}"
    return (
        f"nothing to judge: {files} read, none usable ({', '.join(f'{n} {what}' for what, n in why)}); {ANALYZE_READS}"
    )


def _unused(note: str) -> str:
    """Why an input read was of no use, in a word or three (its note says it in full)."""
    if note.startswith("empty file"):
        return "empty"
    if note.startswith("skipped: ncclwatch's own"):
        return "ncclwatch's own output"
    if "not opened" in note:
        return "not a regular file"
    return note.split(";")[0]


def print_out(text: str) -> None:
    """``text`` on stdout; a reader that stops early (``| head``) ends the output quietly.

    The conventional way: on EPIPE stop writing and point stdout at /dev/null, so that the interpreter's last
    flush does not fail again.  The caller exits with the verdict's status, not 141 (128 + SIGPIPE): the verdict
    was complete before the first byte was written, and a script that reads only the head still gets it.
    """
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


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
    "--max-restarts), where a restart can help: --restart-on verdicts (default: "
    f"{', '.join(RESTART_ON_DEFAULT_NAMES)}), and "
    "never twice for the same hang (verdict, operation, line, step).  --drain slurm drains a node whose hardware "
    f"the verdict blames (--drain-on, default: {names(DRAIN_ON_DEFAULT)}) and ends the job with exit {EXIT_DRAINED}; "
    "--on-hang-exec CMD runs your command with the verdict."
)

SUBCOMMANDS = ("analyze", "demo", "serve", "preflight")
USAGE = """\
ncclwatch [OPTIONS] torchrun [TORCHRUN ARGS...]
       ncclwatch [OPTIONS] python -m torch.distributed.run [ARGS...]
       ncclwatch {demo,analyze,serve,preflight} ..."""
COMMANDS = """\
commands:
  [OPTIONS] torchrun ...   the job, run as torchrun runs it, with the watchdog
  demo [--fault FAULT]     a CPU job that hangs on purpose
  analyze PATH...          the verdict from files a job left
  serve [--bundle-dir DIR] the bundles' page, API and /metrics
  preflight                the node's bus bandwidth, kept as a baseline"""

WRAP_HELP = f"""\
Run a torchrun job exactly as torchrun would (same output, exit code and
signals) with a watchdog beside it.  When a collective stops making progress
it names the rank at fault and why within seconds, prints the verdict here,
and writes a root-cause bundle (report.json, report.md, py-spy stacks of
every rank, Flight Recorder dumps, NCCL log tails, /proc, NVML, RAS,
InfiniBand counters) to --bundle-dir.  No change to the training code: the
heartbeat comes from torch's optimizer step hook (or call ncclwatch.beat(step)).

{COMMANDS}

verdicts (live):
{verdict_lines(PAGED_LIVE)}
{paragraph(f"from files only (ncclwatch analyze --help): {names(FROM_FILES_ONLY)}", "  ")}

{AFTER_THE_PAGE}

timing: evidence that proves a hang by itself (ranks at one position with
different collectives, a rank gone for 5 s or stopped for 2 s while its peers
wait) is paged within seconds, at any step, step 0 included: the sidecar
judges what streams after 1 s of silence and looks quietly at the ranks after
3 s (once the job has a rhythm, 1.5 x its longest gap), then every 20 s.
Silence alone waits for the stall timeout, learned: 3 x the longest gap
between progress the job showed in the last 15 minutes, at least
--stall-timeout-floor (default 5 s); until the job has shown 8 steps,
--warmup-stall-timeout (default 300 s) covers start-up and compilation.  A
pause with no rank in a collective (checkpoint, evaluation) is never a
collective hang.

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

MORE_HELP = "ncclwatch --help for everything; ncclwatch COMMAND --help for one command"
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
    add("--run-folder-cap-mib", type=int, metavar="MIB")
    add("--bundles-kept", type=int, metavar="COUNT")
    add("--bundles-max-mib", type=int, metavar="MIB")
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
    add("--upload", metavar="URL")
    add("--upload-token-file", metavar="FILE")
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
        prog="ncclwatch", usage=USAGE, description=WRAP_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"ncclwatch {__version__}")
    add_watch_options(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="torchrun and its arguments")
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_usage(sys.stderr)
        print(f"\n{COMMANDS}\n\n{MORE_HELP}", file=sys.stderr)
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
    from ncclwatch.launcher.process import launch_problem
    from ncclwatch.launcher.run import run_job

    problem = launch_problem(args.command)
    if problem is not None:  # nothing started
        status, why = problem
        print(f"ncclwatch: {why}", file=sys.stderr)
        return status
    _logging(args.verbose)
    script = missing_script(args.command)
    status = run_job(list(args.command), settings, args.job_name or job_name_of(args.command))
    if status != 0 and script is not None:  # after torchrun's own traceback
        print(f"ncclwatch: training script not found: {script} (in {os.getcwd()})", file=sys.stderr)
    return status


NOT_A_PATH = ("-m", "--module", "--no-python", "--no_python")  # torchrun options after which the script is no path


def missing_script(command: Sequence[str]) -> str | None:
    """The training script, when torchrun is given one by path (``train.py``) and it does not exist.

    The script is torchrun's first argument ending in ``.py`` that is no option; with ``-m``/``--module`` or
    ``--no-python`` before it, it is a module or a program, not checked.
    """
    args = list(command[1:])
    if not command[0].rsplit("/", 1)[-1].startswith("torchrun") and "-m" in args:  # python -m torch.distributed.run
        args = args[args.index("-m") + 2 :]
    for arg in args:
        if arg in NOT_A_PATH:
            return None
        if arg.endswith(".py") and not arg.startswith("-"):
            return None if os.path.exists(arg) else arg
    return None


def demo_parser() -> argparse.ArgumentParser:
    from ncclwatch.launcher.demo_job import FAULTS

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
    parser.add_argument(
        "--pause-s", type=float, default=20.0, metavar="SECONDS", help="length of the 'pause' fault (default: 20)"
    )
    add_watch_options(parser)
    return parser


def demo_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command of the demo job."""
    from pathlib import Path

    from ncclwatch.launcher import demo_job

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "--monitor-interval=0.5",
        str(Path(demo_job.__file__)),
        f"--fault={args.fault}",
        f"--steps={args.steps}",
        f"--pause-s={args.pause_s:g}",
    ]


def run_demo(argv: list[str]) -> int:
    from ncclwatch.watchdog.config import ConfigError

    args = demo_parser().parse_args(argv)
    args.on_hang = args.on_hang or os.environ.get("NCCLWATCH_ON_HANG") or "kill"
    try:
        settings = _settings(args)
    except ConfigError as exc:
        print(f"ncclwatch: {exc}", file=sys.stderr)
        return 2
    from ncclwatch.launcher.run import run_job

    command = demo_command(args)
    print(f"ncclwatch demo: {' '.join(command)}", file=sys.stderr, flush=True)
    _logging(args.verbose)
    return run_job(command, settings, args.job_name or f"demo-{args.fault}")


def main(argv: Sequence[str] | None = None) -> int:
    # A crash inside a C extension (NVML, psutil) leaves every thread's Python stack on stderr, beside the job's
    # output: on 4 x H200 a sidecar died of SIGSEGV once and said nothing.
    if not faulthandler.is_enabled():
        with contextlib.suppress(ValueError, OSError):  # a stderr without a file descriptor
            faulthandler.enable()
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "demo":
        return run_demo(args_list[1:])
    if args_list and args_list[0] == "preflight":
        from ncclwatch.watchdog.preflight import main as run_preflight

        return run_preflight(args_list[1:])
    if args_list and args_list[0] == "serve":
        from ncclwatch.watchdog.server.agent import run_serve

        return run_serve(args_list[1:])
    if args_list and args_list[0] == "analyze":
        return run_analyze(args_list[1:])
    return run_wrapped(args_list)
