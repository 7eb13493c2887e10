"""The words of ``ncclwatch --help`` and ``ncclwatch analyze --help``, short and ``--help-all``.

Where the help and the docs say the same thing, both take it from one place: the verdicts' meanings from the verdict
catalogue (``hang/verdicts.py``), the options that matter and their one-line summaries from ``WRAP_OPTIONS`` here
(the README's options table is rendered from it: ``tests/launcher/test_docs_agree.py``), defaults from ``Settings``,
and the timing from the constants the live watchdog runs on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from ncclwatch.watchdog.cli_help import paragraph
from ncclwatch.watchdog.hang.report import (
    EXIT_DRAINED,
    EXIT_HANG,
    EXIT_INCONCLUSIVE,
    EXIT_KILLED_ON_HANG,
    EXIT_NO_HANG,
    EXIT_UNREADABLE,
)
from ncclwatch.watchdog.hang.verdicts import (
    CATALOGUE,
    DRAIN_ON_DEFAULT,
    RESTART_ON_DEFAULT_NAMES,
    Verdict,
    VerdictEntry,
)
from ncclwatch.watchdog.provenance import EXIT_MIXED_JOBS


def verdict_lines(entries: Sequence[VerdictEntry]) -> str:
    """One line per verdict: its name, then what it means (the verdict catalogue's words)."""
    width = max(len(entry.verdict.value) for entry in entries) + 2
    return "\n".join(f"  {entry.verdict.value:<{width}}{entry.meaning}" for entry in entries)


def names(verdicts: Iterable[Verdict]) -> str:
    return ", ".join(verdict.value for verdict in verdicts)


# analyze's help lists every verdict it can give; the wrapper's, every hang it pages; each names the other's own.
ANALYZE_VERDICTS = [entry for entry in CATALOGUE.values() if entry.offline]
PAGED_LIVE = [entry for entry in CATALOGUE.values() if entry.live and entry.hang]
LIVE_ONLY = [verdict for verdict, entry in CATALOGUE.items() if not entry.offline]
FROM_FILES_ONLY = [verdict for verdict, entry in CATALOGUE.items() if entry.hang and not entry.live]

# The wrapper's options that matter, in its short --help and the README's options table, with one summary each:
# (flag, metavar, summary).  Every other option is in --help-all.
WRAP_OPTIONS = (
    ("--on-hang", "report|kill|restart", f"after the capture: leave the job, end it (exit {EXIT_KILLED_ON_HANG}), or "
     "restart it where that can help"),
    ("--bundle-dir", "DIR", "where root-cause bundles are written"),
    ("--stall-timeout", "SECONDS", "no progress for this long is a hang (default: learned from the job)"),
    ("--progress-timeout", "SECONDS", "a pause outside collectives is reported after this"),
    ("--job-name", "NAME", "names bundles and pages; the same on every node of a job"),
    ("--upload", "URL", "send each bundle to the cluster's ncclwatch serve"),
    ("--listen", "HOST:PORT", "serve this job's bundles, page and /metrics"),
    ("--config", "FILE", "TOML file of settings (default ./ncclwatch.toml)"),
    ("-v", "", "log the watchdog's reasoning to stderr"),
)  # fmt: skip
WRAP_SHOWN = frozenset(flag for flag, _, _ in WRAP_OPTIONS) | {"--verbose"}


def option_default(flag: str) -> str:
    """`` (default X)`` from ``Settings`` for a setting with a default to show; empty for a switch, None or none."""
    from ncclwatch.watchdog.config import Settings

    field = Settings.model_fields.get(flag.lstrip("-").replace("-", "_"))
    default = None if field is None else field.default
    if default is None or isinstance(default, bool) or not isinstance(default, str | int | float | Path):
        return ""
    return f" (default {default:g})" if isinstance(default, float) else f" (default {default})"


def option_summaries() -> dict[str, str]:
    """Each option that matters: its one-line summary with its default, as the short --help and the README say."""
    return {flag: summary + option_default(flag) for flag, _, summary in WRAP_OPTIONS}


def readme_option_rows() -> list[str]:
    """The README's options table, rendered from the same summaries as the short --help."""
    said = option_summaries()
    return [f"| `{flag}{' ' + metavar if metavar else ''}` | {said[flag]} |".replace("|kill|", "\\|kill\\|")
            for flag, metavar, _ in WRAP_OPTIONS]  # fmt: skip


WRAP_DOCS = "docs/watching.md"
ANALYZE_DOCS = "docs/analyze.md"

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
MORE_HELP = "ncclwatch --help for the options that matter, --help-all for every one; ncclwatch COMMAND --help"

WRAP_EXIT = (
    f"exit status: torchrun's own; {EXIT_KILLED_ON_HANG} when ncclwatch ended the job after a hang (--on-hang "
    f"kill, or restart when a restart cannot help); {EXIT_DRAINED} when it drained the culprit's node (--drain)."
)

WRAP_SUMMARY = f"""\
Run a torchrun job exactly as torchrun would, with a watchdog beside it: when
a collective stops, it names the rank at fault and why within seconds, prints
the verdict here and writes a root-cause bundle to --bundle-dir.  ncclwatch's
options go before torchrun.

{COMMANDS}"""

WRAP_EPILOG = f"""\
example:
  ncclwatch --on-hang kill torchrun --nproc_per_node=8 train.py

{paragraph(WRAP_EXIT)}
The verdicts, the timing and every option: ncclwatch --help-all; {WRAP_DOCS}."""


AFTER_THE_PAGE = paragraph(
    "after the page (--on-hang): report leaves the job running (the default); kill ends it; restart ends the "
    "workers so that torchrun restarts them from the job's last checkpoint, on every node (needs torchrun's "
    "--max-restarts), where a restart can help: --restart-on verdicts (default: "
    f"{', '.join(RESTART_ON_DEFAULT_NAMES)}), and "
    "never twice for the same hang (verdict, operation, line, step).  --drain slurm drains a node whose hardware "
    f"the verdict blames (--drain-on, default: {names(DRAIN_ON_DEFAULT)}) and ends the job with exit {EXIT_DRAINED}; "
    "--on-hang-exec CMD runs your command with the verdict."
)

SETTINGS_EVERYWHERE = """\
every option is also an environment variable NCCLWATCH_<OPTION> and a key in
a TOML file (--config, NCCLWATCH_CONFIG, or ./ncclwatch.toml); the command
line wins over the environment, which wins over the file."""


FROM_FILES_SAID = paragraph(
    f"given by ncclwatch analyze alone, from the files (ncclwatch analyze --help-all): {names(FROM_FILES_ONLY)}; "
    "live, the errors it reads are cited in the evidence of the verdict given, and the --restart-on and --drain-on "
    "defaults hold only verdicts the live watchdog gives",
    "  ",
)


def timing() -> str:
    """When a hang is paged, from the constants the live watchdog runs on (imported here: they weigh, and only
    --help-all says them)."""
    from ncclwatch.watchdog.live.incident import PEEK_EVERY_S
    from ncclwatch.watchdog.live.job import GAP_MEMORY_S, MIN_PROGRESS, PEEK_MULTIPLIER, PEEK_WARMUP_S, STALL_MULTIPLIER
    from ncclwatch.watchdog.live.judging import DEAD_SETTLED_S, STOPPED_SETTLED_S, STREAMED_QUIET_S

    return paragraph(
        f"timing: evidence that proves a hang by itself (ranks at one position with different collectives, a rank "
        f"gone for {DEAD_SETTLED_S:g} s or stopped for {STOPPED_SETTLED_S:g} s while its peers wait) is paged "
        f"within seconds, at any step, step 0 included: the sidecar judges what streams after {STREAMED_QUIET_S:g} s "
        f"of silence and looks quietly at the ranks after {PEEK_WARMUP_S:g} s (once the job has a rhythm, "
        f"{PEEK_MULTIPLIER:g} x its longest gap), then every {PEEK_EVERY_S:g} s.  Silence alone waits for the stall "
        f"timeout, learned: {STALL_MULTIPLIER:g} x the longest gap between progress the job showed in the last "
        f"{GAP_MEMORY_S / 60:g} minutes, at least --stall-timeout-floor; until the job has shown {MIN_PROGRESS} steps, "
        "--warmup-stall-timeout covers start-up and compilation.  A pause with no rank in a collective (checkpoint, "
        "evaluation) is never a collective hang."
    )


def wrap_help() -> str:
    """``ncclwatch --help-all``'s text before the options."""
    return f"""\
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
{FROM_FILES_SAID}

{AFTER_THE_PAGE}

{timing()}

{SETTINGS_EVERYWHERE}

alerts (environment or TOML): NCCLWATCH_PAGERDUTY_ROUTING_KEY, NCCLWATCH_SLACK_WEBHOOK_URL,
NCCLWATCH_WEBHOOK_URL with NCCLWATCH_WEBHOOK_SECRET; one page per hang, resolved when
the job moves again or ends cleanly; undelivered alerts wait in <bundle-dir>/.spool.

examples:
  ncclwatch torchrun --nproc_per_node=8 train.py
  ncclwatch --on-hang kill --bundle-dir /shared/bundles torchrun --nnodes=4 ... train.py
  NCCLWATCH_API_TOKEN=... ncclwatch --listen 0.0.0.0:9464 torchrun ...   # page, API, /metrics

{WRAP_EXIT}
docs: {WRAP_DOCS}
"""


ANALYZE_EXAMPLES = """\
examples:
  ncclwatch analyze ./nccl-logs/ ./fr-dumps/
  ncclwatch analyze slurm-1234.out --json | jq .culprit_ranks
  xclip -o | ncclwatch analyze -                 # an excerpt from an issue thread"""

ANALYZE_EXIT_SHORT = (
    f"exit status: {EXIT_NO_HANG} no hang, {EXIT_HANG} a hang (culprit in the report), {EXIT_INCONCLUSIVE} "
    f"inconclusive, {EXIT_UNREADABLE} no input could be read or used, {EXIT_MIXED_JOBS} inputs of different jobs."
)

ANALYZE_SUMMARY = """\
Say which rank a hung job is waiting on, and why, from the files it left:
NCCL debug files, PyTorch Flight Recorder dumps, NCCL RAS reports, worker
and torchrun logs (one combined file is fine), py-spy dumps, kernel logs and
ncclwatch bundles.  Give files or folders in any mix, "-" for a pasted
excerpt; types are recognised by content."""

ANALYZE_EPILOG = f"""\
{ANALYZE_EXAMPLES}

{paragraph(ANALYZE_EXIT_SHORT)}
The verdicts, every input and option: ncclwatch analyze --help-all; {ANALYZE_DOCS}."""

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
{paragraph(f"live only (ncclwatch --help-all): {names(LIVE_ONLY)}", "  ")}

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

docs: {ANALYZE_DOCS}
"""
ANALYZE_SHOWN = frozenset({"--json", "--entries"})
