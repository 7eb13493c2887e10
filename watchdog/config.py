"""The watchdog's settings: one flat object, units in the help, every error names its setting.

Precedence, highest first: command line, ``NCCLWATCH_*`` environment
variables, a TOML file (``--config FILE``, ``NCCLWATCH_CONFIG``, or
``./ncclwatch.toml`` when it exists), the defaults below.  Unknown keys in the
file are rejected, so a typo never silently keeps a default.

Errors: ``ConfigError`` (a ``ValueError``) with one line per bad setting,
each naming where the value came from and the expected form.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from ncclwatch.watchdog.hang.verdicts import (
    DRAIN_ON_DEFAULT,
    HANG_VERDICT_NAMES,
    RESTART_ON_DEFAULT_NAMES,
    RESTART_ON_NAMES,
)

ENV_PREFIX = "NCCLWATCH_"
DEFAULT_CONFIG_FILE = Path("ncclwatch.toml")


class ConfigError(ValueError):
    """Bad configuration; the message is ready for the user."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    stall_timeout: float | None = Field(
        None,
        gt=0,
        description="seconds a collective may make no progress before it is a hang; "
        "unset: learned from the job (3 x its longest recent gap between progress, at least stall_timeout_floor)",
    )
    stall_timeout_floor: float = Field(5.0, gt=0, description="seconds; the learned stall timeout is never shorter")
    warmup_stall_timeout: float = Field(
        300.0, gt=0, description="seconds; stall timeout until the job has made 8 steps of progress (start-up, compile)"
    )
    progress_timeout: float = Field(
        1800.0,
        gt=0,
        description="seconds with no progress and no rank inside a collective (checkpoint, evaluation) before a "
        "progress_stalled report",
    )
    bundle_dir: Path = Field(Path("ncclwatch-bundles"), description="where root-cause bundles are written")
    on_hang: Literal["report", "kill", "restart"] = Field(
        "report",
        description="report: capture, alert, leave the job running; kill: capture, then end the job, exit 3; "
        "restart: capture, then end the workers so torchrun restarts them (its --max-restarts), where a restart "
        "can help (--restart-on) and the same hang has not come back after one",
    )
    restart_on: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(RESTART_ON_DEFAULT_NAMES),
        description="verdicts --on-hang restart restarts (comma-separated; rank_behind_blocked: rank_behind where "
        "the culprits are blocked in a read, a sleep or a lock); the others end the job",
    )
    drain: Literal["none", "slurm"] = Field(
        "none",
        description="slurm: when the verdict blames a node's hardware (--drain-on), drain it with scontrol and end "
        "the job with exit 75 for a requeue elsewhere (with --on-hang kill or restart)",
    )
    drain_on: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [v.value for v in DRAIN_ON_DEFAULT],
        description="verdicts that blame the culprit's node (comma-separated)",
    )
    on_hang_exec: str | None = Field(
        None,
        description="shell command run once per hang after the page, on the node that pages: the verdict as JSON on "
        "stdin and in NCCLWATCH_* variables (docs/operations.md)",
    )
    hook_timeout: float = Field(60.0, gt=0, description="seconds --on-hang-exec may run before it is killed")
    run_dir: Path | None = Field(
        None, description="folder for NCCL debug files, heartbeats, dumps (default: a new folder under /var/tmp)"
    )
    run_folder_cap_mib: int = Field(
        256,
        ge=16,
        description="most disk the run folder may take on this node, MiB: NCCL debug files are freed behind the "
        "reader, keeping their last MiB (the bundle's tails), whatever the job's length",
    )
    bundles_kept: int = Field(
        50, ge=1, description="root-cause bundles kept in --bundle-dir on this node; older ones are deleted"
    )
    bundles_max_mib: int = Field(
        2048, ge=1, description="most disk the bundles in --bundle-dir may take on this node, MiB; oldest go first"
    )
    keep_run_dir: bool = Field(
        False,
        description="keep the run folder after the job "
        "(default: removed, after a hang too: the bundle holds its evidence)",
    )
    poll_interval: float = Field(0.25, gt=0, le=10, description="seconds between reads of logs, heartbeats and /proc")
    evidence_budget: float = Field(30.0, gt=0, description="seconds all evidence collection may take")
    pyspy: str | None = Field(None, description="path to py-spy (default: PATH, then next to the Python interpreter)")
    ras_port: int = Field(28028, ge=1, le=65535, description="NCCL RAS port on 127.0.0.1")
    preflight: bool = Field(
        False,
        description="measure this node's bus bandwidth (ncclwatch preflight) before the job starts and keep it as the "
        "baseline; with --on-hang kill, measure again once the hung job has ended and compare",
    )

    # Operations: server, alerts, metrics.
    listen: str | None = Field(
        None,
        description="HOST:PORT for the bundle API, page and /metrics "
        "(serve: default 127.0.0.1:9464; a job: off unless set)",
    )
    api_token: SecretStr | None = Field(None, description="bearer token the API and page require (or --token-file)")
    token_file: Path | None = Field(None, description="file holding the bearer token (first line)")
    public_url: str | None = Field(None, description="base URL alerts link bundles with, e.g. http://node1:9464")
    pagerduty_routing_key: SecretStr | None = Field(
        None, description="PagerDuty Events API v2 routing key (integration key)"
    )
    pagerduty_url: str = Field(
        "https://events.pagerduty.com/v2/enqueue", description="PagerDuty Events API v2 endpoint"
    )
    slack_webhook_url: SecretStr | None = Field(None, description="Slack incoming webhook URL")
    webhook_url: str | None = Field(
        None, description="generic JSON webhook, signed with HMAC-SHA256 when webhook_secret is set"
    )
    webhook_secret: SecretStr | None = Field(None, description="HMAC-SHA256 key for the generic webhook's signature")
    spool_dir: Path | None = Field(
        None, description="undelivered alerts wait here across restarts (default: <bundle_dir>/.spool)"
    )
    alert_drain_timeout: float = Field(
        120.0,
        ge=0,
        description="seconds the wrapper keeps retrying undelivered alerts after the job ends; then they wait in the "
        "spool for the node agent (ncclwatch serve) or the next run",
    )
    alert_retry_interval: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="seconds between ncclwatch serve's looks at the alert spool and retries of a send",
    )
    metrics_textfile: Path | None = Field(
        None, description="also write metrics to this file for node_exporter's textfile collector"
    )

    # One server for the cluster (server/cluster.py): the wrappers upload, ncclwatch serve indexes.
    upload: str | None = Field(
        None,
        description="URL of the cluster's ncclwatch serve to upload each bundle to, e.g. http://ncclwatch:9464; "
        "through the alert spool, so a server that is down never delays a page and gets the bundle later",
    )
    upload_token: SecretStr | None = Field(
        None, description="the upload token: what the wrapper sends with --upload, what serve accepts (write-only)"
    )
    upload_token_file: Path | None = Field(
        None, description="file of upload tokens, one a line (serve accepts each; the wrapper sends the first)"
    )
    upload_spool_days: float = Field(
        7.0, gt=0, description="days an upload waits in the spool for the server before it is given up (failed/)"
    )
    upload_max_mb: float = Field(512.0, gt=0, description="serve: the largest bundle it accepts, in MB")
    upload_rate: float = Field(60.0, gt=0, description="serve: uploads per minute each upload token may make")
    retention_days: float = Field(90.0, gt=0, description="serve: uploaded bundles older than this are removed")
    retention_gb: float = Field(
        100.0, gt=0, description="serve: the oldest uploaded bundles are removed while all of them exceed this, in GB"
    )
    index_db: Path | None = Field(
        None, description="serve: the SQLite index of uploaded bundles (default: <bundle_dir>/.incidents.sqlite)"
    )
    on_repeat: str | None = Field(
        None,
        description="serve: N/DAYS: run --on-repeat-exec when a host is named in incidents of N different jobs "
        "within DAYS days (once per crossing)",
    )
    on_repeat_exec: str | None = Field(
        None,
        description="serve: shell command for --on-repeat; the host in $NCCLWATCH_HOST, the facts as JSON on stdin",
    )

    # Slow, not hung (slowness/findings.py): reported and exported always, paged only when asked.
    perf_interval: float = Field(
        60.0,
        ge=0,
        description="seconds between looks at bandwidth, arrival skew and transports while the job is healthy; each "
        "look asks every rank for one Flight Recorder dump (a background thread in the rank, milliseconds); 0: off",
    )
    page_on_slow: bool = Field(
        False, description="page for a slow collective, a slow link or an InfiniBand port finding"
    )
    page_on_straggler: bool = Field(False, description="page for a rank last by a margin in most recent steps")
    page_on_transport: bool = Field(False, description="page for a node on another NCCL transport than its peers")

    @field_validator("restart_on", "drain_on", mode="before")
    @classmethod
    def _verdicts(cls, value: object, info: ValidationInfo) -> object:
        names = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        known = RESTART_ON_NAMES if info.field_name == "restart_on" else HANG_VERDICT_NAMES
        if isinstance(names, list):
            unknown = [n for n in names if n not in known]
            if unknown:
                raise ValueError(
                    f"unknown verdict(s) {', '.join(map(str, unknown))}; one of {', '.join(sorted(known))}"
                )
        return names

    @field_validator("metrics_textfile")
    @classmethod
    def _prom_suffix(cls, value: Path | None) -> Path | None:
        if value is not None and value.suffix != ".prom":
            raise ValueError("must end in .prom (node_exporter's textfile collector reads only *.prom files)")
        return value

    @field_validator("on_repeat")
    @classmethod
    def _repeat(cls, value: str | None) -> str | None:
        if value is not None:
            _threshold(value)
        return value

    def repeat_threshold(self) -> tuple[int, float] | None:
        """--on-repeat as (jobs, days); None when unset."""
        return _threshold(self.on_repeat) if self.on_repeat is not None else None

    @field_validator("upload")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("expected the server's http:// or https:// URL, e.g. http://ncclwatch:9464")
        return value.rstrip("/") if value is not None else None

    @model_validator(mode="after")
    def _upload_token_given(self) -> Settings:
        if self.upload is not None and self.upload_token is None and self.upload_token_file is None:
            raise ValueError(
                "upload: --upload needs the upload token (NCCLWATCH_UPLOAD_TOKEN or --upload-token-file), the one "
                "the server's ncclwatch serve accepts"
            )
        return self

    def upload_tokens(self) -> list[str]:
        """upload_token, then each line of upload_token_file."""
        tokens = [self.upload_token.get_secret_value()] if self.upload_token is not None else []
        if self.upload_token_file is not None:
            try:
                tokens += self.upload_token_file.read_text().split()
            except OSError as exc:
                raise ConfigError(f"--upload-token-file {self.upload_token_file}: cannot read it ({exc})") from None
        return [t for t in tokens if t]

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is None:
            return None
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError("expected HOST:PORT, e.g. 127.0.0.1:9464")
        return value

    def token(self) -> str | None:
        """The API token: api_token, else the first line of token_file."""
        if self.api_token is not None:
            return self.api_token.get_secret_value() or None
        if self.token_file is not None:
            try:
                return self.token_file.read_text().splitlines()[0].strip() or None
            except (OSError, IndexError) as exc:
                raise ConfigError(f"--token-file {self.token_file}: cannot read a token ({exc})") from None
        return None

    @field_validator(
        "bundle_dir", "run_dir", "token_file", "spool_dir", "metrics_textfile", "upload_token_file", "index_db"
    )
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = _toml_file.get("path")
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        if toml is not None:
            sources += (TomlConfigSettingsSource(settings_cls, toml_file=toml),)
        return sources


def _threshold(text: str) -> tuple[int, float]:
    count, sep, days = text.partition("/")
    try:
        jobs, window = int(count), float(days)
    except ValueError:
        jobs, window = 0, 0.0
    if not sep or jobs < 1 or window <= 0:
        raise ValueError("expected N/DAYS (incidents of N different jobs within DAYS days), e.g. 3/7")
    return jobs, window


# The TOML path is chosen per load; pydantic-settings asks for sources on the class.
_toml_file: dict[str, Path | None] = {"path": None}


def load_settings(
    cli: Mapping[str, Any], config_file: str | None = None, environ: Mapping[str, str] = os.environ
) -> Settings:
    """Settings from the command line (``cli``: only options the user gave), env, file, defaults."""
    path = Path(config_file or environ.get(f"{ENV_PREFIX}CONFIG") or DEFAULT_CONFIG_FILE)
    explicit = bool(config_file or environ.get(f"{ENV_PREFIX}CONFIG"))
    if explicit and not path.is_file():
        raise ConfigError(
            f"config file {path}: not found (from {'--config' if config_file else ENV_PREFIX + 'CONFIG'})"
        )
    _toml_file["path"] = path if path.is_file() else None
    try:
        return Settings(**{k: v for k, v in cli.items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(_explain(exc, path if path.is_file() else None)) from None
    except ValueError as exc:  # a TOML syntax error
        raise ConfigError(f"config file {path}: {exc}") from None
    finally:
        _toml_file["path"] = None


def _explain(exc: ValidationError, toml: Path | None) -> str:
    lines = []
    for error in exc.errors():
        if not error["loc"]:  # a rule across settings: its message names them
            lines.append(str(error["msg"]).removeprefix("Value error, "))
            continue
        name = str(error["loc"][0])
        option = "--" + name.replace("_", "-")
        where = f"{option} / {ENV_PREFIX}{name.upper()}" + (f" / {name} in {toml}" if toml else "")
        if error["type"] == "extra_forbidden":
            lines.append(
                f"unknown setting {name!r} ({'in ' + str(toml) if toml else 'environment'}); see ncclwatch --help"
            )
            continue
        field = Settings.model_fields.get(name)
        expected = f" — {field.description}" if field and field.description else ""
        lines.append(f"{where}: {error['msg']} (got {error.get('input')!r}){expected}")
    return "invalid configuration:\n  " + "\n  ".join(lines)
