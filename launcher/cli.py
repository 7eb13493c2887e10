"""The ``ncclwatch`` command line."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import sys
from collections.abc import Sequence
from typing import Any

from pydantic_core import PydanticUndefined

from ncclwatch.launcher.help_text import (
    ANALYZE_EPILOG,
    ANALYZE_HELP,
    ANALYZE_SHOWN,
    ANALYZE_SUMMARY,
    COMMANDS,
    MORE_HELP,
    SUBCOMMANDS,
    USAGE,
    WRAP_EPILOG,
    WRAP_SHOWN,
    WRAP_SUMMARY,
    option_summaries,
    wrap_help,
)
from ncclwatch.watchdog import __version__
from ncclwatch.watchdog.cli_help import add_help_all, formatter, shown_help
from ncclwatch.watchdog.hang.report import EXIT_INCONCLUSIVE, EXIT_UNREADABLE
from ncclwatch.watchdog.hang.state import DEFAULT_WINDOW
from ncclwatch.watchdog.provenance import EXIT_MIXED_JOBS

__all__ = ["ANALYZE_HELP", "SUBCOMMANDS", "main", "wrap_help"]


def analyze_parser(full: bool = False) -> argparse.ArgumentParser:
    """``ncclwatch analyze``'s parser; its ``--help`` shows the options that matter, ``--help-all`` (``full``) all."""
    shown = None if full else ANALYZE_SHOWN
    analyze = argparse.ArgumentParser(
        prog="ncclwatch analyze",
        description=ANALYZE_HELP if full else ANALYZE_SUMMARY,
        epilog=None if full else ANALYZE_EPILOG,
        formatter_class=formatter,
    )
    add_help_all(analyze, None if full else lambda: analyze_parser(full=True))
    analyze.add_argument(
        "paths", nargs="+", metavar="PATH", help='files or folders (recursive); "-" reads standard input'
    )
    analyze.add_argument("--json", action="store_true", help="print only the report, as JSON, on stdout")
    analyze.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        metavar="N",
        help=shown_help(
            "--window",
            "operations kept per rank and communicator; older ones are folded into a digest "
            f"(default {DEFAULT_WINDOW})",
            shown,
        ),
    )
    entries = analyze.add_argument_group(
        "Flight Recorder entries",
        # the parser's formatter keeps descriptions as written: lines broken by hand
        "After the verdict, print the entries of the dumps given, one row each: rank,\n"
        "position (collective or p2p number), process group, op, state (as the\n"
        "verdict read it), input sizes, dtype, the user's call site.  --rank, --pg\n"
        "and --stack imply --entries; the verdict is always judged on every input."
        if full
        else "--rank N, --pg NAME_OR_ID, --last N and --stack choose them (--help-all).",
    )
    entries.add_argument("--entries", action="store_true", help="print the matched entries after the verdict")
    entries.add_argument(
        "--rank",
        action="append",
        type=_rank_list,
        default=[],
        metavar="N[,N...]",
        help=shown_help("--rank", "only these global ranks' dumps (repeat, or a comma list: --rank 1,3)", shown),
    )
    entries.add_argument(
        "--pg",
        action="append",
        default=[],
        metavar="NAME_OR_ID",
        help=shown_help(
            "--pg", "only this process group, by id (0) or description (default_pg, mesh_tp); repeatable", shown
        ),
    )
    entries.add_argument(
        "--last",
        type=int,
        default=20,
        metavar="N",
        help=shown_help("--last", "the newest N entries of each rank and process group (default 20; 0: all)", shown),
    )
    entries.add_argument(
        "--stack",
        action="store_true",
        help=shown_help("--stack", "every frame Flight Recorder recorded, under each row", shown),
    )
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


DEMO_FAULTS = ("skip", "extra", "python_stuck", "sigstop", "exit", "pause", "uneven", "none")  # no GPU needed


def help_with_default(field: Any) -> str:
    """A setting's description and, when it has one, its default (the option's own default is None: "not given")."""
    default = field.default
    if default is None or default is PydanticUndefined or isinstance(default, bool):
        return field.description or ""
    shown = f"{default:g}" if isinstance(default, float) else str(default)
    return f"{field.description} (default: {shown})"


def add_watch_options(parser: argparse.ArgumentParser, shown: frozenset[str] | None = None) -> None:
    """The watchdog's options; those not in ``shown`` (the short help's) work but are left out of ``--help``."""
    from ncclwatch.watchdog.config import Settings

    fields = Settings.model_fields
    summaries = option_summaries() if shown is not None else {}  # the short help says what the README says

    def add(flag: str, **kw: Any) -> None:
        described = summaries.get(flag) or help_with_default(fields[flag[2:].replace("-", "_")])
        parser.add_argument(flag, default=None, help=shown_help(flag, described, shown), **kw)

    def switch(flag: str, described: str) -> None:
        parser.add_argument(
            flag, action="store_const", const=True, default=None, help=shown_help(flag, described, shown)
        )

    add("--on-hang", choices=("report", "kill", "restart"), metavar="report|kill|restart")
    add("--bundle-dir", metavar="DIR")
    add("--stall-timeout", type=float, metavar="SECONDS")
    add("--progress-timeout", type=float, metavar="SECONDS")
    job_name = summaries.get("--job-name") or "names bundles and pages (default: the training script's name)"
    parser.add_argument("--job-name", metavar="NAME", help=shown_help("--job-name", job_name, shown))
    add("--upload", metavar="URL")
    add("--listen", metavar="HOST:PORT")
    config = summaries.get("--config") or "TOML file with any of these settings (default ./ncclwatch.toml if present)"
    parser.add_argument("--config", metavar="FILE", help=shown_help("--config", config, shown))
    parser.add_argument(
        "-v", "--verbose", action="store_true", help=shown_help("-v", "log the watchdog's reasoning to stderr", shown)
    )
    add("--stall-timeout-floor", type=float, metavar="SECONDS")
    add("--warmup-stall-timeout", type=float, metavar="SECONDS")
    add("--restart-on", metavar="VERDICT,...")
    add("--drain", choices=("none", "slurm"))
    add("--drain-on", metavar="VERDICT,...")
    add("--on-hang-exec", metavar="CMD")
    add("--hook-timeout", type=float, metavar="SECONDS")
    add("--run-dir", metavar="DIR")
    add("--run-folder-cap-mib", type=int, metavar="MIB")
    add("--bundles-kept", type=int, metavar="COUNT")
    add("--bundles-max-mib", type=int, metavar="MIB")
    switch("--keep-run-dir", fields["keep_run_dir"].description or "")
    switch("--preflight", fields["preflight"].description or "")
    add("--evidence-budget", type=float, metavar="SECONDS")
    add("--alert-drain-timeout", type=float, metavar="SECONDS")
    add("--pyspy", metavar="PATH")
    add("--poll-interval", type=float, metavar="SECONDS")
    add("--token-file", metavar="FILE")
    add("--public-url", metavar="URL")
    add("--upload-token-file", metavar="FILE")
    add("--upload-spool-days", type=float, metavar="DAYS")
    add("--metrics-textfile", metavar="FILE.prom")
    add("--perf-interval", type=float, metavar="SECONDS")


def _settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ncclwatch.watchdog.config import Settings, load_settings

    cli = {name: getattr(args, name, None) for name in Settings.model_fields}
    return load_settings(cli, args.config)


def _logging(verbose: bool) -> None:
    import logging

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="ncclwatch %(asctime)s %(message)s")


def wrap_parser(full: bool = False) -> argparse.ArgumentParser:
    """``ncclwatch``'s parser; its ``--help`` shows the options that matter, ``--help-all`` (``full``) every one."""
    parser = argparse.ArgumentParser(
        prog="ncclwatch",
        usage=USAGE,
        description=wrap_help() if full else WRAP_SUMMARY,
        epilog=None if full else WRAP_EPILOG,
        formatter_class=formatter,
    )
    add_help_all(parser, None if full else lambda: wrap_parser(full=True))
    parser.add_argument("--version", action="version", version=f"ncclwatch {__version__}")
    add_watch_options(parser, None if full else WRAP_SHOWN)
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="torchrun and its arguments" if full else argparse.SUPPRESS
    )
    return parser


def run_wrapped(argv: list[str]) -> int:
    from ncclwatch.watchdog.config import ConfigError

    parser = wrap_parser()
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
    misplaced = ours_after_torchrun(args.command, {f for a in parser._actions for f in a.option_strings})
    if misplaced is not None:
        print(
            f"ncclwatch: {misplaced} is an option of ncclwatch, not of torchrun: put it before torchrun "
            f"(ncclwatch {misplaced} ... torchrun ...)",
            file=sys.stderr,
        )
        return 2
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
    script = missing_script(args.command)
    if script is not None:  # nothing started: as python itself says of a missing script, status 2
        print(f"ncclwatch: training script not found: {script} (in {os.getcwd()})", file=sys.stderr)
        return EXIT_NO_SCRIPT
    _logging(args.verbose)
    return run_job(list(args.command), settings, args.job_name or job_name_of(args.command))


EXIT_NO_SCRIPT = 2  # python's own status for a script it cannot open
NOT_A_PATH = ("-m", "--module", "--no-python", "--no_python")  # torchrun options after which the script is no path


def _launcher_args(command: Sequence[str]) -> list[str]:
    """The launcher's arguments: after ``torchrun``, or after ``python -m torch.distributed.run``."""
    args = list(command[1:])
    if not command[0].rsplit("/", 1)[-1].startswith("torchrun") and "-m" in args:  # python -m torch.distributed.run
        args = args[args.index("-m") + 2 :]
    return args


def missing_script(command: Sequence[str]) -> str | None:
    """The training script, when torchrun is given one by path (``train.py``) and it does not exist.

    The script is torchrun's first argument ending in ``.py`` that is no option; with ``-m``/``--module`` or
    ``--no-python`` before it, it is a module or a program, not checked.
    """
    for arg in _launcher_args(command):
        if arg in NOT_A_PATH:
            return None
        if arg.endswith(".py") and not arg.startswith("-"):
            return None if os.path.exists(arg) else arg
    return None


def ours_after_torchrun(command: Sequence[str], ours: set[str]) -> str | None:
    """An ncclwatch option among torchrun's own (before the script), where torchrun would reject it with its usage.

    Only torchrun's part is looked at: what follows the script is the script's, which may well have a --config.
    """
    args = _launcher_args(command)
    at = 0
    while at < len(args) and args[at].startswith("-"):
        flag = args[at].split("=", 1)[0]
        if flag in ours and flag not in TORCHRUN_SHARED:
            return flag
        at += 1 if "=" in args[at] or flag in TORCHRUN_SWITCHES or flag in ours else 2  # past its value
    return None


# Options of torchrun's own that ncclwatch also has: where they stand after torchrun they are torchrun's.
TORCHRUN_SHARED = frozenset({"-h", "--help"})
# torchrun's options that take no value (torch 2.13 ``torch/distributed/run.py``): the next argument is the script.
TORCHRUN_SWITCHES = frozenset(
    {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module",
     "--virtual-local-rank", "--virtual_local_rank"}
)  # fmt: skip


def demo_parser(full: bool = False) -> argparse.ArgumentParser:
    """``ncclwatch demo``'s parser: its own options and the watchdog's (those that matter, or all with ``full``)."""
    from ncclwatch.launcher.demo_job import FAULTS

    faults = "\n".join(f"  {name:<13} {FAULTS[name]}" for name in DEMO_FAULTS)
    parser = argparse.ArgumentParser(
        prog="ncclwatch demo",
        description="Run a small gloo (CPU) job under the watchdog in which the last rank misbehaves at step 15, and "
        "watch it get caught, named and bundled. Unlike a real job, the demo ends the hung job after the capture "
        "(--on-hang kill) unless told otherwise.",
        epilog=f"faults (--fault):\n{faults}\n\n'extra' is caught by gloo itself, which checks sizes and raises."
        + ("" if full else "\nThe watchdog's other options: ncclwatch demo --help-all."),
        formatter_class=formatter,
    )
    add_help_all(parser, None if full else lambda: demo_parser(full=True))
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
    add_watch_options(parser, None if full else DEMO_SHOWN)
    return parser


DEMO_SHOWN = frozenset({"--on-hang", "--bundle-dir", "--verbose", "-v"})


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
