"""What a bundle may carry: credentials never, and of the environment only what diagnosis needs.

Bundles are downloaded, attached to tickets and uploaded to servers, so
everything the evidence writes that can hold a secret passes through here
(pure functions, no I/O):

- ``redact_env``: the workers' environment.  A name on the allowlist
  (``NCCL_*``, ``TORCH_*``, ``CUDA_*``, the launcher's and scheduler's
  variables, ...) keeps its value, scanned by value like any text; any other
  name is listed with ``<withheld: not needed for diagnosis>``, so on-call
  still sees it was set.  A name that looks secret (``KEY``, ``TOKEN``,
  ``SECRET``, ``PASSWORD``, ... or one of ncclwatch's own secret settings) is
  ``<redacted: secret variable>`` even on the allowlist.
- ``redact_argv``: a command line, argument by argument: the value of a
  secret-named flag (``--password X``, ``--token=X``, ``--api-key X``), and
  each argument scanned by value.
- ``redact_text`` / ``redact_bytes``: any text (log tails, a cmdline, a
  value), by value: passwords in URLs, known token formats (GitHub, AWS,
  Google, Slack, ``sk-`` keys, Hugging Face, JWTs, PagerDuty routing keys),
  private key blocks, ``Authorization`` headers, secret URL parameters,
  secret-named flags and assignments (``DB_PASSWORD=...``, ``"token": "..."``).
  ``redact_bytes`` keeps bytes that are not UTF-8 as they were.

A secret is replaced whole by ``<redacted: KIND>`` (never a prefix or a hash
of it); what surrounds it (the flag, the variable's name, the URL's scheme,
user and host) stays, since that is what diagnosis reads.  Redacting is
idempotent: a marker is never redacted again.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

from pydantic import SecretStr

from ncclwatch.watchdog.config import ENV_PREFIX, Settings

WITHHELD = "<withheld: not needed for diagnosis>"


def marker(kind: str) -> str:
    return f"<redacted: {kind}>"


# ---------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------

# Kept with their values (then scanned by value): what a hang's diagnosis reads.
ALLOWED_PREFIXES = (
    "NCCL_",
    "TORCH_",
    "TORCHELASTIC_",
    "TORCHINDUCTOR_",
    "PYTORCH_",
    "CUDA_",
    "CUBLAS_",
    "CUDNN_",
    "NVIDIA_",
    "NVSHMEM_",
    "UCX_",  # UCX transport
    "FI_",  # libfabric (EFA, ...)
    "OFI_NCCL_",  # the aws-ofi-nccl plugin
    "GLOO_",
    "HF_",  # Hugging Face settings; HF_TOKEN and the like are secret by name
    "CONDA_",
    "SLURM_",  # job, step and node ids and lists
    "PMI_",  # MPI launchers: rank, size
    "PMIX_",
    "OMPI_COMM_WORLD_",
    "OMPI_MCA_",
    "MV2_COMM_WORLD_",
    "LOCAL_",  # torchrun: LOCAL_RANK, LOCAL_WORLD_SIZE
    "GROUP_",  # GROUP_RANK, GROUP_WORLD_SIZE
    "ROLE_",  # ROLE_RANK, ROLE_NAME, ROLE_WORLD_SIZE
    "OMP_",
    "TRITON_",
    ENV_PREFIX,  # ncclwatch's own settings, less its secrets (below)
)
ALLOWED_NAMES = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "NODE_RANK",
        "HOSTNAME",
        "PWD",  # relative paths in stacks and logs are relative to it
        "PATH",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONUNBUFFERED",
        "PYTHONFAULTHANDLER",
        "LD_LIBRARY_PATH",
        "LD_PRELOAD",
        "VIRTUAL_ENV",
        "MKL_NUM_THREADS",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
    }
)
# Substrings of names whose values are secrets (case-insensitive), on the allowlist or not.
# PASSWD beside the usual words: it does not contain PASSWORD.
SECRET_MARKERS = (
    "KEY",
    "TOKEN",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "CREDENTIAL",
    "CRED",
    "AUTH",
    "COOKIE",
    "SESSION",
    "PRIVATE",
    "WEBHOOK",
)
# Names with a marker in them that hold no secret and that diagnosis reads.
NOT_SECRET_NAMES = frozenset({"NCCL_IB_PKEY"})  # the InfiniBand partition key index
# ncclwatch's own secret settings, whatever they are called (a webhook URL can carry its token).
NCCLWATCH_SECRETS = frozenset(
    ENV_PREFIX + name.upper()
    for name, info in Settings.model_fields.items()
    if SecretStr in getattr(info.annotation, "__args__", (info.annotation,)) or name.endswith("webhook_url")
)


def secret_variable(name: str) -> bool:
    upper = name.upper()
    if upper in NCCLWATCH_SECRETS:
        return True
    return upper not in NOT_SECRET_NAMES and any(m in upper for m in SECRET_MARKERS)


def allowed_variable(name: str) -> bool:
    return name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Every name of ``env``; values kept only for allowed, non-secret names, and scanned by value."""
    out = {}
    for name, value in env.items():
        if secret_variable(name):
            out[name] = marker("secret variable")
        elif allowed_variable(name):
            out[name] = redact_text(value)
        else:
            out[name] = WITHHELD
    return out


# ---------------------------------------------------------------------------
# Names of flags, assignments and URL parameters
# ---------------------------------------------------------------------------

# Words of a name that make its value a secret: ``--hf-token``, ``DB_PASSWORD``, ``apiKey``; not
# ``--max-tokens`` or ``--tokenizer`` (the word must be whole), nor a bare ``key`` (a TCPStore key is evidence).
SECRET_WORDS = frozenset(
    {
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "secret",
        "secrets",
        "token",
        "credential",
        "credentials",
        "cred",
        "creds",
        "cookie",
        "auth",
        "authorization",
        "session",
        "sessionid",
        "apikey",
        "pat",
        "privatekey",
        "accesskey",
        "secretkey",
    }
)
# ``<word> key`` (``api_key``, ``--access-key``, ``routing_key``): a key of these kinds is a secret.
KEY_QUALIFIERS = frozenset(
    {
        "api",
        "access",
        "private",
        "secret",
        "routing",
        "integration",
        "service",
        "signing",
        "encryption",
        "client",
        "master",
        "license",
        "account",
        "storage",
        "subscription",
        "ssh",
    }
)
# URL parameters that carry signatures of presigned URLs (S3, GCS, Azure SAS) besides the words above.
SECRET_PARAMETERS = frozenset(
    {"sig", "signature", "x-amz-signature", "x-amz-credential", "x-goog-signature", "x-goog-credential", "key"}
)


def _words(name: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)  # camelCase -> camel Case
    return [w for w in re.split(r"[^a-z0-9]+", spaced.lower()) if w]


def secret_name(name: str) -> bool:
    """Whether a flag's, an assignment's or a setting's name says its value is a secret."""
    words = _words(name)
    if words == ["pwd"]:  # the shell's working directory (PWD=/home/...), not a password: ``db_pwd`` is one
        return False
    if any(w in SECRET_WORDS for w in words):
        return True
    return any(w == "key" and i > 0 and words[i - 1] in KEY_QUALIFIERS for i, w in enumerate(words))


# ---------------------------------------------------------------------------
# By value
# ---------------------------------------------------------------------------

_NOT_MARKER = r"(?!<(?:redacted|withheld)\b)"  # a value that is already a marker stays as it is
# A value: quoted, or up to whitespace or a quote (a quote ends it: the text may be JSON or a repr).
# (nor the word of an Authorization scheme: ``auth: Bearer <token>`` is the header's, below)
_VALUE = (
    r"(?![\"']?<(?:redacted|withheld)\b)(?!(?i:bearer|basic|digest|negotiate)\s)(?:\"[^\"\n]*\"|'[^'\n]*'|[^\s\"'`]+)"
)
_NAME = r"[A-Za-z_][A-Za-z0-9_.-]{0,60}"

Rule = tuple[re.Pattern[str], Callable[[re.Match[str]], str]]


def _whole(kind: str) -> Callable[[re.Match[str]], str]:
    return lambda m: marker(kind)


def _group(group: str, kind: str) -> Callable[[re.Match[str]], str]:
    """Replace only the named group ``group`` of the match."""

    def replace(m: re.Match[str]) -> str:
        start, end = m.start(group) - m.start(), m.end(group) - m.start()
        value = m[group]
        quote = value[0] if len(value) > 1 and value[0] in "\"'" and value[-1] == value[0] else ""
        return m[0][:start] + quote + marker(kind) + quote + m[0][end:]

    return replace


def _if_secret_name(kind: str, names: Iterable[str] = ()) -> Callable[[re.Match[str]], str]:
    extra = frozenset(names)

    def replace(m: re.Match[str]) -> str:
        name = m["name"]
        if secret_name(name) or name.lower() in extra:
            return _group("value", kind)(m)
        return m[0]

    return replace


_RULES: list[Rule] = [
    (
        re.compile(r"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----.*?-----END \1PRIVATE KEY-----", re.S),
        _whole("private key"),
    ),
    (re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----[\sA-Za-z0-9+/=\\]*"), _whole("private key")),
    (
        re.compile(r"^(?:[A-Za-z0-9+/=]{16,}\r?\n)+-----END [A-Z0-9 ]*PRIVATE KEY-----", re.M),
        _whole("private key"),
    ),
]
_RULES: list[Rule] = [
    # Webhook URLs: the path is the credential.
    (
        re.compile(r"https?://hooks\.slack(?:-gov)?\.com/(?:services|workflows|triggers)/[A-Za-z0-9/_-]+"),
        _whole("slack webhook url"),
    ),
    (
        re.compile(r"https?://(?:ptb\.|canary\.)?discord(?:app)?\.com/api/webhooks/[0-9]+/[A-Za-z0-9_-]+"),
        _whole("discord webhook url"),
    ),
    (
        re.compile(r"events\.(?:eu\.)?pagerduty\.com/integration/(?P<value>[A-Za-z0-9]{32})\b"),
        _group("value", "pagerduty routing key"),
    ),
    (
        re.compile(r"(?i)\b(?:routing|integration|service)[_ -]?key[\"']?\s*[:=]\s*[\"']?(?P<value>[A-Za-z0-9]{32})\b"),
        _group("value", "pagerduty routing key"),
    ),
    # scheme://user:PASSWORD@host (userinfo holds no / ? # unescaped, RFC 3986)
    (
        re.compile(
            r"\b[A-Za-z][A-Za-z0-9+.-]{0,30}://[^\s:/?#@\"'<>]*:" + _NOT_MARKER + r"(?P<value>[^\s/?#@\"'<>]+)@"
        ),
        _group("value", "password"),
    ),
    # Token formats.
    (
        re.compile(r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{30,}+|github_pat_[A-Za-z0-9_]{40,}+)(?![A-Za-z0-9_])"),
        _whole("github token"),
    ),
    (re.compile(r"(?<![0-9A-Za-z_-])AIza[0-9A-Za-z_-]{35}(?![0-9A-Za-z_-])"), _whole("google api key")),
    (re.compile(r"(?<![A-Za-z0-9-])(?:xox[abposre]|xapp-[0-9])-[A-Za-z0-9-]{10,}+"), _whole("slack token")),
    (
        re.compile(r"(?<![A-Za-z0-9_-])sk-[A-Za-z0-9_-]{20,}+"),
        lambda m: marker("api key") if re.search("[0-9]", m[0]) else m[0],
    ),
    (re.compile(r"(?<![A-Za-z0-9_])[rs]k_(?:live|test)_[A-Za-z0-9]{16,}+"), _whole("api key")),
    (re.compile(r"(?<![A-Za-z0-9_])hf_[A-Za-z0-9]{30,}+(?![A-Za-z0-9_])"), _whole("hugging face token")),
    (re.compile(r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{10,}+\.[A-Za-z0-9_-]{10,}+\.[A-Za-z0-9_-]*+"), _whole("jwt")),
    # Headers: Authorization keeps its scheme; the others are their value to the line's end.
    (
        re.compile(
            r"(?i)\b(?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?(?>(?:(?:bearer|basic|token|digest|negotiate)\s+)?)"
            + _NOT_MARKER
            + r"(?P<value>[^\s\"'`]+)"
        ),
        _group("value", "authorization header"),
    ),
    (
        re.compile(r"(?i)\bbearer\s+" + _NOT_MARKER + r"(?P<value>[A-Za-z0-9._~+/-]{8,}=*)"),
        _group("value", "bearer token"),
    ),
    (
        re.compile(
            r"(?i)\b(?:x-api-key|api-key|x-auth-token|private-token|x-goog-api-key|set-cookie|cookie)\s*:\s*"
            + _NOT_MARKER
            + r"(?P<value>[^\s\"'`][^\r\n\"'`]*)"
        ),
        _group("value", "authorization header"),
    ),
    # ?token=...&X-Amz-Signature=...
    (
        re.compile(r"[?&](?P<name>[A-Za-z0-9_.-]{1,60})=" + _NOT_MARKER + r"(?P<value>[^&#\s\"'<>]+)"),
        _if_secret_name("url parameter", SECRET_PARAMETERS),
    ),
    # --password X, --token=X, -api-key X (a value that is another long option is not one)
    (
        re.compile(r"(?<![\w-])--?(?P<name>[A-Za-z][A-Za-z0-9_-]{0,60})(?:=|[ \t]+(?!--))(?P<value>" + _VALUE + ")"),
        _if_secret_name("secret flag"),
    ),
    # DB_PASSWORD=x, "token": "x", api_key: x
    (
        re.compile(
            r"(?<![\w.-])(?P<quote>[\"']?)(?P<name>" + _NAME + r")(?P=quote)[ \t]*[:=][ \t]*(?P<value>" + _VALUE + ")"
        ),
        _if_secret_name("secret assignment"),
    ),
]

_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|AKPA|ANPA|ANVA|AROA|APKA|ASCA)[A-Z0-9]{16}\b")
# A secret access key: 40 base64 characters, mixed case (a 40-hex commit hash is not one).
_AWS_SECRET = re.compile(r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])")


def _aws_secret(m: re.Match[str]) -> str:
    mixed = re.search("[a-z]", m[0]) and re.search("[A-Z]", m[0])
    return marker("aws secret access key") if mixed else m[0]


def _aws(text: str) -> str:
    """Key ids anywhere; a secret access key on the same line as a key id."""
    out, at = [], 0
    for m in _AWS_KEY_ID.finditer(text):
        if m.start() < at:
            continue  # on a line already done
        start = text.rfind("\n", 0, m.start()) + 1
        end = text.find("\n", m.end())
        end = len(text) if end < 0 else end
        line = _AWS_KEY_ID.sub(marker("aws access key id"), text[start:end])
        out += [text[at:start], _AWS_SECRET.sub(_aws_secret, line)]
        at = end
    return "".join(out) + text[at:]


_PEM = re.compile(r"-----(BEGIN|END) [A-Z0-9 ]*PRIVATE KEY-----")
# A block cut at the tail's end: its body lines (real or escaped newlines), each all base64.
_PEM_REST = re.compile(r"(?:(?:\r?\n|\\n)[A-Za-z0-9+/=]++(?![^\r\n\\]))*+")
_PEM_LINE = re.compile(r"[A-Za-z0-9+/=]+\r?")


def _private_keys(text: str) -> str:
    """A whole block; a block cut at the tail's end (no END); the body before an END whose BEGIN was cut
    off the tail's start.  One pass over the markers: linear however many there are."""
    if "PRIVATE KEY-----" not in text:
        return text
    spans: list[tuple[int, int]] = []
    opened: re.Match[str] | None = None
    for m in _PEM.finditer(text):
        if m[1] == "BEGIN":
            opened = opened or m
        elif opened is not None:
            spans.append((opened.start(), m.end()))
            opened = None
        else:
            start, floor = m.start(), spans[-1][1] if spans else 0
            while start > floor:
                line_start = max(floor, text.rfind("\n", floor, start - 1) + 1)
                if not _PEM_LINE.fullmatch(text, line_start, start - 1):
                    break
                start = line_start
            spans.append((start, m.end()))
    if opened is not None:
        spans.append((opened.start(), _PEM_REST.match(text, opened.end()).end()))
    out, at = [], 0
    for start, end in spans:
        out += [text[at:start], marker("private key")]
        at = end
    return "".join(out) + text[at:]


def redact_text(text: str) -> str:
    """``text`` with every secret found by value replaced by ``<redacted: KIND>``."""
    text = _aws(_private_keys(text))
    for pattern, replace in _RULES:
        text = pattern.sub(replace, text)
    return text


def redact_bytes(data: bytes) -> bytes:
    """``redact_text`` over bytes; what is not UTF-8 (a tail cut mid-character, binary) comes back unchanged."""
    return redact_text(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")


_FLAG = re.compile(r"(--?[A-Za-z][A-Za-z0-9_.-]*)(=.*)?", re.S)


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command line, argument by argument: a secret flag's value (``--token X``, ``--token=X``) whole,
    even with spaces in it; every other argument by value."""
    out: list[str] = []
    value_next = False
    for arg in argv:
        if value_next and not arg.startswith("--"):
            out.append(marker("secret flag"))
            value_next = False
            continue
        value_next = False
        flag = _FLAG.fullmatch(arg)
        if flag and secret_name(flag[1].lstrip("-")):
            if flag[2] is None:
                value_next = True
                out.append(arg)
            else:
                out.append(f"{flag[1]}={marker('secret flag')}")
            continue
        out.append(redact_text(arg))
    return out
