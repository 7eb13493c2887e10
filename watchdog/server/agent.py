"""``ncclwatch serve``: the bundle API, page and /metrics over a bundle folder, until SIGTERM or Ctrl-C.

Lifecycle, top to bottom: settings (CLI > ``NCCLWATCH_*`` env > TOML) ->
start listening -> start the alert courier -> print the URL -> wait for
SIGTERM/SIGINT (the handler only sets an event) -> stop, bounded (requests in
flight get 3 s, all of it 10 s).

The alert courier: with alerts configured (the same ``NCCLWATCH_*`` settings
as the jobs), the agent delivers what the node's jobs could not (their
receiver was down when they ended) from the spool (``spool_dir``, default
``<bundle_dir>/.spool``), looking every ``alert_retry_interval`` seconds and
retrying no slower than that.  It shares the spool with running jobs through
file locks (``sinks.delivery``), so an alert goes out once.  A page must not
wait for the next job on the node.

A --bundle-dir that does not exist is created (the agent may start before the
first bundle), and said; one that is not a folder, or cannot be created, is an
error.

Exit status: 0 after SIGTERM/SIGINT; 2 for a bad setting, a bundle folder that
cannot be served or an address that cannot be listened on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from ncclwatch.watchdog.cli_help import add_help_all, formatter, shown_help
from ncclwatch.watchdog.sinks.delivery import spool_dir_for

if TYPE_CHECKING:
    from ncclwatch.watchdog.config import Settings
    from ncclwatch.watchdog.server.intake import Intake
    from ncclwatch.watchdog.server.repeat import Repeat
    from ncclwatch.watchdog.sinks.delivery import Dispatcher

log = logging.getLogger("ncclwatch.server")
DEFAULT_LISTEN = "127.0.0.1:9464"
BUNDLE_DIR_DEFAULT = "ncclwatch-bundles"  # Settings.bundle_dir's, relative to where serve starts
SERVE_DOCS = "docs/server.md"
CLUSTER_OPTIONS = (
    "upload_token_file",
    "upload_spool_days",
    "upload_max_mb",
    "upload_rate",
    "retention_days",
    "retention_gb",
    "index_db",
    "on_repeat",
    "on_repeat_exec",
)
RETENTION_EVERY_S = 3600.0

SERVE_HELP = f"""\
Serve the root-cause bundles of a folder (--bundle-dir, where the watchdog
writes them) to people and to tools:

  /                          a page listing every bundle, newest first
  /bundles/<id>              one bundle: verdict, summary, culprit, operation,
                             a timeline picture (each rank's last operations
                             side by side, the culprit's row and the position
                             where they diverge marked), the per-rank table,
                             the evidence and the files in the bundle
  /api/bundles               the list as JSON (id, job, verdict, culprit_ranks,
                             created, size, error)
  /api/bundles/<id>          the bundle itself (tar.gz)
  /api/bundles/<id>/report   its report.json
  /metrics                   Prometheus metrics (ncclwatch_bundles{{verdict}})
  /healthz                   "ok"

auth: bundles hold stack traces and environments, so the API and the page
require a bearer token and refuse (401) when none is configured.  Set it in
NCCLWATCH_API_TOKEN or give --token-file FILE (its first line); there is no
--token option, so the token never shows in ps.  Tools send
"Authorization: Bearer <token>".  In a browser open /?token=<token> once:
the server sets an HttpOnly, SameSite=Strict cookie (12 hours) and shows
the address without the token.  /healthz is always open; /metrics is open
(it carries job names, ranks, pids, hosts and verdicts, never evidence)
unless --metrics-token.

Listening beyond 127.0.0.1 serves plain HTTP: put it behind TLS (a reverse
proxy, an SSH tunnel) on networks you do not trust.

every option is also an environment variable NCCLWATCH_<OPTION> and a key in
a TOML file (--config, NCCLWATCH_CONFIG, or ./ncclwatch.toml); the command
line wins over the environment, which wins over the file.

examples:
  export NCCLWATCH_API_TOKEN=$(openssl rand -hex 16)
  ncclwatch serve --bundle-dir /shared/ncclwatch-bundles --listen 0.0.0.0:9464
  curl -H "Authorization: Bearer $NCCLWATCH_API_TOKEN" http://node1:9464/api/bundles
  curl -H "Authorization: Bearer $NCCLWATCH_API_TOKEN" http://node1:9464/api/bundles/<id>/report | jq .culprit_ranks
  curl -OJ -H "Authorization: Bearer $NCCLWATCH_API_TOKEN" http://node1:9464/api/bundles/<id>
  curl http://node1:9464/metrics
  browser: http://node1:9464/?token=<token>

alerts: with NCCLWATCH_PAGERDUTY_ROUTING_KEY, NCCLWATCH_SLACK_WEBHOOK_URL or
NCCLWATCH_WEBHOOK_URL set (as for the jobs), serve delivers the alerts the
node's jobs left undelivered in <bundle-dir>/.spool (NCCLWATCH_SPOOL_DIR),
looking every NCCLWATCH_ALERT_RETRY_INTERVAL seconds (default 10).

one server for the cluster: with NCCLWATCH_UPLOAD_TOKEN (or --upload-token-file)
it also takes the bundles every wrapper uploads (ncclwatch --upload URL, the
same token), checks and stores them, and indexes them in SQLite:

  POST /api/upload           a bundle, with the upload token (write-only)
  /incidents[/<key>]         incidents across jobs (?job= ?host= ?verdict= ?since=
                             ?until=), each with its nodes' bundles and the report
  /hosts[/<host>]            per host named as culprit, lost node or slow link:
                             incidents over 7 and 30 days, repeat hosts first
  /api/incidents, /api/hosts the same as JSON; /metrics adds
                             ncclwatch_host_incidents_total{{host,verdict}}

  ncclwatch serve --bundle-dir /srv/ncclwatch --listen 0.0.0.0:9464 \\
      --on-repeat 3/7 --on-repeat-exec 'scontrol update NodeName="$NCCLWATCH_HOST" State=DRAIN Reason=ncclwatch'

--bundle-dir defaults to ./{BUNDLE_DIR_DEFAULT}, in the folder serve starts in
(the systemd unit: /var/lib/ncclwatch-server/bundles); a missing one is
created (the agent may start before any bundle).

exit status: 0 after SIGTERM or Ctrl-C; 2 for a bad setting, a --bundle-dir that
is not a folder or cannot be created, or an address in use.
(default address: {DEFAULT_LISTEN})
docs: {SERVE_DOCS}
"""


SERVE_SUMMARY = """\
Serve the root-cause bundles of a folder (--bundle-dir, where the watchdog
writes them) to people and tools: a page, a JSON API and /metrics.  With an
upload token it is also the cluster's server: every wrapper's --upload sends
its bundles here, indexed as incidents across jobs and hosts.  The page and
the API need a bearer token (NCCLWATCH_API_TOKEN or --token-file)."""

SERVE_EPILOG = f"""\
examples:
  export NCCLWATCH_API_TOKEN=$(openssl rand -hex 16)
  ncclwatch serve --bundle-dir /shared/ncclwatch-bundles --listen 0.0.0.0:9464
  browser: http://node1:9464/?token=<token>

exit status: 0 after SIGTERM or Ctrl-C; 2 for a bad setting, a --bundle-dir that
is not a folder or cannot be created, or an address in use.
The routes, the cluster server and every option: ncclwatch serve --help-all; {SERVE_DOCS}."""

SERVE_SHOWN = frozenset({"--bundle-dir", "--listen", "--token-file", "--upload-token-file", "--config", "--verbose"})


def build_parser(full: bool = False) -> argparse.ArgumentParser:
    """``ncclwatch serve``'s parser; its ``--help`` shows the options that matter, ``--help-all`` (``full``) all."""
    from ncclwatch.watchdog.config import Settings

    fields = Settings.model_fields
    shown = None if full else SERVE_SHOWN
    parser = argparse.ArgumentParser(
        prog="ncclwatch serve",
        description=SERVE_HELP if full else SERVE_SUMMARY,
        epilog=None if full else SERVE_EPILOG,
        formatter_class=formatter,
    )
    add_help_all(parser, None if full else lambda: build_parser(full=True))
    parser.add_argument(
        "--bundle-dir",
        metavar="DIR",
        help=shown_help("--bundle-dir", f"{fields['bundle_dir'].description} (default ./{BUNDLE_DIR_DEFAULT})", shown),
    )
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=shown_help("--listen", f"address to serve on (default {DEFAULT_LISTEN}; port 0 picks one)", shown),
    )
    parser.add_argument(
        "--token-file", metavar="FILE", help=shown_help("--token-file", fields["token_file"].description or "", shown)
    )
    parser.add_argument(
        "--metrics-token",
        action="store_true",
        help=shown_help("--metrics-token", "/metrics requires the token too (default: open)", shown),
    )
    cluster = parser.add_argument_group(
        "one server for the cluster",
        "wrappers upload with --upload URL; the upload token is NCCLWATCH_UPLOAD_TOKEN" if full else None,
    )
    for flag, kind, metavar in (
        ("--upload-token-file", str, "FILE"),
        ("--upload-max-mb", float, "MB"),
        ("--upload-rate", float, "PER_MINUTE"),
        ("--upload-spool-days", float, "DAYS"),
        ("--retention-days", float, "DAYS"),
        ("--retention-gb", float, "GB"),
        ("--index-db", str, "FILE"),
        ("--on-repeat", str, "N/DAYS"),
        ("--on-repeat-exec", str, "CMD"),
    ):
        field = fields[flag[2:].replace("-", "_")]
        said = f" (default: {field.default:g})" if isinstance(field.default, float) else ""
        cluster.add_argument(
            flag, type=kind, metavar=metavar, help=shown_help(flag, f"{field.description}{said}", shown)
        )
    parser.add_argument(
        "--config", metavar="FILE", help=shown_help("--config", "TOML file with any of these settings", shown)
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help=shown_help("--verbose", "log each request (never its query string)", shown),
    )
    return parser


def run_serve(argv: Sequence[str]) -> int:
    from ncclwatch.watchdog.config import ConfigError, load_settings

    args = build_parser().parse_args(list(argv))
    try:
        given = ("bundle_dir", "listen", "token_file", *CLUSTER_OPTIONS)
        settings = load_settings({name: getattr(args, name) for name in given}, args.config)
        token = settings.token()
        upload_tokens = settings.upload_tokens()
        if (settings.on_repeat is None) != (settings.on_repeat_exec is None):
            raise ConfigError("--on-repeat and --on-repeat-exec go together: when, and what to run")
    except ConfigError as exc:
        print(f"ncclwatch serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="ncclwatch %(asctime)s %(message)s"
    )
    problem = bundle_dir_problem(settings.bundle_dir)
    if problem is not None:
        print(f"ncclwatch serve: {problem}", file=sys.stderr)
        return 2
    listen = settings.listen or DEFAULT_LISTEN
    return asyncio.run(serve(settings, listen, token, upload_tokens, metrics_open=not args.metrics_token))


def bundle_dir_problem(bundle_dir: Path) -> str | None:
    """Why the bundle folder cannot be served; a missing one is created, and said.

    The agent may start before any job has written a bundle (or its folder) on the node: it serves the
    empty folder and the jobs fill it.  What is not a folder, or a folder that cannot be made, is an error.
    """
    if bundle_dir.is_dir():
        return None
    if bundle_dir.exists():
        return f"--bundle-dir {bundle_dir} is not a folder"
    try:
        bundle_dir.mkdir(parents=True)
    except OSError as exc:
        return f"cannot create the bundle folder {bundle_dir}: {exc.strerror or exc}"
    print(
        f"ncclwatch serve: created the bundle folder {bundle_dir} (it did not exist); "
        "jobs that run as other users need it writable to them (docs/operations.md)",
        file=sys.stderr,
        flush=True,
    )
    return None


@contextlib.asynccontextmanager
async def alert_courier(settings: Settings) -> AsyncIterator[Dispatcher | None]:
    """Deliver the node's spooled alerts while the agent runs; None when no alert sink is configured."""
    from ncclwatch.watchdog.sinks.delivery import BACKOFF_S, Dispatcher, sinks_from_settings, spool_dir_for

    async with aiohttp.ClientSession() as session:
        sinks = sinks_from_settings(settings, session)
        if not sinks:
            yield None
            return
        every = settings.alert_retry_interval
        dispatcher = Dispatcher(
            sinks, spool_dir_for(settings), rescan_s=every, backoff_s=[min(step, every) for step in BACKOFF_S]
        )
        await dispatcher.start()
        try:
            yield dispatcher
        finally:
            await dispatcher.close()


async def serve(
    settings: Settings, listen: str, token: str | None, upload_tokens: list[str], *, metrics_open: bool
) -> int:
    from prometheus_client import CollectorRegistry

    from ncclwatch.watchdog.server.app import BundleCollector, BundleIndex, make_app, start_server, stop_server
    from ncclwatch.watchdog.server.cluster import HostIncidentsCollector, install
    from ncclwatch.watchdog.server.sdnotify import systemd_lifecycle

    bundle_dir, public_url = settings.bundle_dir, settings.public_url
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BundleCollector(BundleIndex(bundle_dir)))
    app = make_app(bundle_dir, token=token, registry=registry, metrics_open=metrics_open)
    try:
        intake, repeat = await asyncio.to_thread(cluster_parts, settings, upload_tokens)
    except (OSError, sqlite3.Error) as exc:
        print(f"ncclwatch serve: cannot open the incident index: {exc}", file=sys.stderr)
        return 2
    install(app, intake, repeat)
    registry.register(HostIncidentsCollector(intake.index))
    try:
        runner, bound = await start_server(app, listen)
    except OSError as exc:
        print(f"ncclwatch serve: cannot listen on {listen}: {exc.strerror or exc}", file=sys.stderr)
        intake.index.close()
        return 2
    keeper = asyncio.create_task(retention(settings, intake, repeat), name="ncclwatch-retention")
    print(f"ncclwatch serve: http://{bound}/ (bundles in {bundle_dir})", flush=True)
    if public_url:
        print(f"ncclwatch serve: public URL {public_url}", flush=True)
    if token is None:
        print(
            "ncclwatch serve: no token configured: the page and the API answer 401 until NCCLWATCH_API_TOKEN or "
            "--token-file is set (/healthz and /metrics still answer)",
            file=sys.stderr,
            flush=True,
        )
    async with alert_courier(settings) as courier:
        if courier is not None:
            print(
                f"ncclwatch serve: delivering spooled alerts from {spool_dir_for(settings)} "
                f"(every {settings.alert_retry_interval:g} s)",
                flush=True,
            )
        # Type=notify: READY=1 once bound, watchdog pings while serving, STOPPING=1 on the way out.
        await systemd_lifecycle(stop, status_text=f"serving http://{bound}/")
    print("ncclwatch serve: stopping", file=sys.stderr, flush=True)
    keeper.cancel()
    await stop_server(runner)
    await asyncio.gather(keeper, return_exceptions=True)
    intake.index.close()
    return 0


def cluster_parts(settings: Settings, upload_tokens: list[str]) -> tuple[Intake, Repeat | None]:
    """The index (opened), the intake and --on-repeat; leftovers of uploads cut short are removed.  Blocking."""
    from ncclwatch.watchdog.server.incidents import IncidentIndex
    from ncclwatch.watchdog.server.intake import Intake, RateLimit
    from ncclwatch.watchdog.server.repeat import Repeat

    index = IncidentIndex(settings.index_db or settings.bundle_dir / ".incidents.sqlite")
    intake = Intake(
        settings.bundle_dir, index, upload_tokens, int(settings.upload_max_mb * 1e6), RateLimit(settings.upload_rate)
    )
    for leftover in intake.incoming().iterdir():
        leftover.unlink(missing_ok=True)
    threshold = settings.repeat_threshold()
    repeat = None
    if threshold is not None and settings.on_repeat_exec is not None:
        repeat = Repeat(index, *threshold, command=settings.on_repeat_exec, timeout_s=settings.hook_timeout)
    return intake, repeat


async def retention(settings: Settings, intake: Intake, repeat: Repeat | None) -> None:
    """At start and every hour: uploaded bundles past --retention-days or over --retention-gb go; hosts re-arm."""
    from ncclwatch.watchdog.server.intake import prune

    while True:
        try:
            removed = await asyncio.to_thread(
                prune,
                settings.bundle_dir,
                intake.index,
                max_age_s=settings.retention_days * 86400,
                max_bytes=int(settings.retention_gb * 1e9),
                now=time.time(),
            )
            if removed:
                log.warning("retention: removed %d bundle(s), the oldest %s", len(removed), removed[0])
            if repeat is not None:
                await repeat.recheck()
        except Exception:  # a full disk or a locked index must not end the server
            log.exception("retention failed; tried again in %.0f s", RETENTION_EVERY_S)
        await asyncio.sleep(RETENTION_EVERY_S)
