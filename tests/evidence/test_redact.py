"""redact.py: each credential pattern fires on a realistic value and stays quiet on look-alikes."""

from __future__ import annotations

import base64
import time

import pytest
from pydantic import SecretStr

from ncclwatch.watchdog.config import ENV_PREFIX, Settings
from ncclwatch.watchdog.evidence.redact import (
    WITHHELD,
    marker,
    redact_argv,
    redact_bytes,
    redact_env,
    redact_text,
    secret_name,
)

# Fake credentials in the real formats, built up so that no scanner takes this file for a leak.
GITHUB = "ghp_" + "x7Kd9QmT2vLp" * 3
GITHUB_FINE = "github_pat_" + "11ABCDEFG0" + "aB3dE5fG7h_" * 7
AWS_ID = "AKIA" + "IOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/" + "bPxRfiCYEXAMPLEKEY"
GOOGLE = "AIza" + "SyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY"
SLACK_TOKEN = "xoxb-" + "1234567890123-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx"
SLACK_HOOK = "https://hooks.slack.com/services/" + "T0AAAAAAA/B0BBBBBBB/" + "c" * 24
OPENAI = "sk-" + "proj-" + "Ab3dEf6hIj9k" * 4
ANTHROPIC = "sk-" + "ant-api03-" + "Zy8xWv7uTs6r" * 7
HF = "hf_" + "QrStUvWxYzAbCdEfGhIjKlMnOpQrStUvWx"
JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9."
    + "eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ."
    + "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
)
PAGERDUTY = "e93facc04764012d7bfb002500d5d1a6"
KEY_BODY = base64.encodebytes(bytes(range(256)) * 2).decode()
PRIVATE_KEY = f"-----BEGIN RSA PRIVATE KEY-----\n{KEY_BODY}-----END RSA PRIVATE KEY-----"

# (text, the secret in it, the marker's kind, what must stay)
FIRES = [
    ("DATABASE_URL=postgres://admin:hunter2-x@db/x", "hunter2-x", "password", "postgres://admin:"),
    ("redis://:s3cr3t@cache:6379/0", "s3cr3t", "password", "@cache:6379/0"),
    ("mongodb+srv://svc:p%40ss@cluster0.example.net/db", "p%40ss", "password", "mongodb+srv://svc:"),
    (f"alerts go to {SLACK_HOOK} now", SLACK_HOOK.rsplit("/", 1)[1], "slack webhook url", "alerts go to "),
    (f"GH_PAT={GITHUB}", GITHUB, "github token", "GH_PAT="),
    (f"clone with {GITHUB_FINE}", GITHUB_FINE, "github token", "clone with "),
    (f"using {AWS_ID}", AWS_ID, "aws access key id", "using "),
    (f"creds {AWS_ID} {AWS_SECRET}", AWS_SECRET, "aws secret access key", "creds "),
    (f"maps key={GOOGLE}", GOOGLE, "google api key", "maps "),
    (f"slack client {SLACK_TOKEN}", SLACK_TOKEN, "slack token", "slack client "),
    (f"OPENAI_API_KEY: {OPENAI}", OPENAI, "api key", "OPENAI_API_KEY"),
    (f"client = Anthropic({ANTHROPIC!r})", ANTHROPIC, "api key", "client = Anthropic("),
    (f"login({HF})", HF, "hugging face token", "login("),
    (f"cookie jar {JWT}", JWT, "jwt", "cookie jar "),
    (f'{{"routing_key": "{PAGERDUTY}"}}', PAGERDUTY, "pagerduty routing key", '{"routing_key": "'),
    (
        f"POST https://events.pagerduty.com/integration/{PAGERDUTY}/enqueue",
        PAGERDUTY,
        "pagerduty routing key",
        "/enqueue",
    ),
    (f"config:\n{PRIVATE_KEY}\nnext line", KEY_BODY.splitlines()[3], "private key", "next line"),
    ("curl -H 'Authorization: Bearer abc.DEF-123_xyz'", "abc.DEF-123_xyz", "authorization header", "Bearer "),
    ("authorization=Basic dXNlcjpwYXNz", "dXNlcjpwYXNz", "authorization header", "Basic "),
    ("sent Bearer Zm9vYmFyYmF6cXV4", "Zm9vYmFyYmF6cXV4", "bearer token", "sent Bearer "),
    ("x-api-key: 0a1b2c3d4e5f", "0a1b2c3d4e5f", "authorization header", "x-api-key: "),
    (
        "GET https://b.s3.amazonaws.com/o?X-Amz-Signature=9f8e7d6c5b4a&X-Amz-Expires=60",
        "9f8e7d6c5b4a",
        "url parameter",
        "X-Amz-Expires=60",
    ),
    ("https://api.example.com/v1?access_token=tok123&page=2", "tok123", "url parameter", "&page=2"),
    ("python train.py --password hunter2 --lr 3e-4", "hunter2", "secret flag", "--lr 3e-4"),
    ("train.py --hf-token=abc123def --batch 8", "abc123def", "secret flag", "--batch 8"),
    ("train.py --api-key k-77x", "k-77x", "secret flag", "--api-key "),
    ("train.py --wandb_api_key 9a9a9a9a", "9a9a9a9a", "secret flag", "--wandb_api_key "),
    ("DB_PASSWORD=pw2 then", "pw2", "secret assignment", "DB_PASSWORD="),
    ("{'secret': 'tell-no-one', 'lr': 0.1}", "tell-no-one", "secret assignment", "'lr': 0.1"),
    ('{"accessToken": "at-5566"}', "at-5566", "secret assignment", '"accessToken": "'),
    ("wandb:\n  api_key: 0123abcd\n  project: x", "0123abcd", "secret assignment", "project: x"),
]


@pytest.mark.parametrize(("text", "secret", "kind", "kept"), FIRES, ids=[f[2] + ":" + f[0][:24] for f in FIRES])
def test_pattern_fires_and_keeps_the_context(text, secret, kind, kept):
    out = redact_text(text)
    assert secret not in out
    assert marker(kind) in out
    assert kept in out
    assert redact_text(out) == out  # a marker is never redacted again


LOOK_ALIKES = [
    "commit 3f2c1a9e8b7d6c5f4e3d2c1b0a9f8e7d6c5b4a39 (HEAD -> main)",  # 40 hex, like an AWS secret's length
    f"commit 3f2c1a9e8b7d6c5f4e3d2c1b0a9f8e7d6c5b4a39 beside {AWS_ID[:4]}-less line",
    "run 123e4567-e89b-12d3-a456-426614174000 started",
    "md5 e93facc04764012d7bfb002500d5d1a6 of the checkpoint",  # 32 hex without a routing-key name
    "host:2:1234 [0] NCCL INFO comm 0x55d4c0a0 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0"
    " commId 0xa1b2c3d4e5f60718 - Init COMPLETE",
    "host:2:1234 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to eth0",
    "host:2:1234 [0] NCCL INFO AllReduce: opCount 1f sendbuff 0x7f3a2b1c4d5e recvbuff 0x7f3a2b1c4d5e count 262144"
    " datatype 7 op 0 root 0 comm 0x55d4c0a0 [nranks=2] stream 0x55d4c1b0",
    "/home/u/.cache/huggingface/hub/models--gpt2/snapshots/607a30d783dfa663caf39e06633721c8d4cfcd7e/hf_model.bin",
    "python train.py --max-tokens 4096 --tokenizer gpt2 --use-auth --nproc-per-node 8 --sort-key loss",
    "num_tokens=1024 tokens_per_s=5.1e4 key_dim=64",
    "[c10d] Timed out waiting for key: rank_3/ready; store key=/torchelastic/agent/barrier",
    "tcp://10.0.0.1:29500 http://host:8080/path@v2 file:///tmp/x",
    "import sklearn # sk-learn; task-scheduler-with-a-rather-long-name-0123456789",
    "MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 RANK=0 WORLD_SIZE=8 TORCHELASTIC_RUN_ID=none",
    "auth:\n  enabled: true",
    "PWD=/work/job OLDPWD=/home/u",
    base64.b64encode(bytes(range(200))).decode(),  # a blob with no key id beside it
]


@pytest.mark.parametrize("text", LOOK_ALIKES)
def test_look_alikes_stay(text):
    assert redact_text(text) == text


def test_aws_secret_only_beside_a_key_id():
    out = redact_text(f"id {AWS_ID}\nother line {AWS_SECRET}\n")
    assert AWS_ID not in out and AWS_SECRET in out


@pytest.mark.parametrize(
    "text",
    [
        PRIVATE_KEY,
        "tail starts inside a key\n" + PRIVATE_KEY.split("\n", 4)[-1],  # BEGIN cut off the tail's start
        "log ends inside a key\n" + PRIVATE_KEY[: len(PRIVATE_KEY) // 2],  # no END yet
        "ENV=" + PRIVATE_KEY.replace("\n", "\\n"),  # a key in a value, newlines escaped
    ],
    ids=["whole", "no BEGIN", "no END", "escaped newlines"],
)
def test_private_key_blocks(text):
    out = redact_text(text)
    assert marker("private key") in out
    assert not any(line in out for line in KEY_BODY.splitlines() if len(line) > 8)


def test_argv_redacts_a_secret_flags_value_whole():
    argv = ["python", "train.py", "--password", "two words", "--token=t0k", "--use-auth", "--nproc", "8"]
    argv += ["--db", "postgres://u:pw@h/d", "-c", f"login('{HF}')"]
    assert redact_argv(argv) == [
        "python",
        "train.py",
        "--password",
        marker("secret flag"),
        f"--token={marker('secret flag')}",
        "--use-auth",  # a flag without a value: the next long option is not its value
        "--nproc",
        "8",
        "--db",
        f"postgres://u:{marker('password')}@h/d",
        "-c",
        f"login('{marker('hugging face token')}')",
    ]


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("--hf-token", True),
        ("api_key", True),
        ("apiKey", True),
        ("SecretAccessKey", True),
        ("GH_PAT", True),
        ("MY_CLOUD_CRED", True),
        ("routing_key", True),
        ("--max-tokens", False),
        ("--tokenizer", False),
        ("key", False),
        ("sort_key", False),
        ("keyboard", False),
        ("DB_PWD", True),
        ("PWD", False),
    ],
)
def test_secret_names_are_whole_words(name, secret):
    assert secret_name(name) is secret


def test_env_allowlist_withholds_the_rest_and_redacts_secret_names():
    env = {
        "NCCL_DEBUG": "INFO",
        "NCCL_SOCKET_IFNAME": "eth0",
        "NCCL_IB_PKEY": "0",  # a partition key index, not a secret
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "MASTER_ADDR": "10.0.0.1",
        "LOCAL_RANK": "1",
        "SLURM_JOB_ID": "4242",
        "OMPI_COMM_WORLD_RANK": "3",
        "FI_PROVIDER": "efa",
        "HF_HOME": "/data/hf",
        "PATH": "/usr/bin",
        "NCCLWATCH_STALL_TIMEOUT": "60",
        "NCCL_NET_PLUGIN": GITHUB,  # a token pasted into an allowed variable
        "DATABASE_URL": "postgres://admin:pw@db/x",
        "HOME": "/root",
        "HF_TOKEN": HF,
        "MY_CLOUD_CRED": AWS_ID,
        "SSH_AUTH_SOCK": "/tmp/agent",
        "NCCL_SECRET_THING": "x",
    }
    out = redact_env(env)
    for name in ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_PKEY", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        assert out[name] == env[name]
    for name in ("CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "LOCAL_RANK", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK"):
        assert out[name] == env[name]
    for name in ("FI_PROVIDER", "HF_HOME", "PATH", "NCCLWATCH_STALL_TIMEOUT"):
        assert out[name] == env[name]
    assert out["NCCL_NET_PLUGIN"] == marker("github token")
    assert out["DATABASE_URL"] == out["HOME"] == WITHHELD
    assert out["HF_TOKEN"] == out["MY_CLOUD_CRED"] == out["SSH_AUTH_SOCK"] == out["NCCL_SECRET_THING"]
    assert out["HF_TOKEN"] == marker("secret variable")
    assert out.keys() == env.keys()  # every name stays listed


def test_every_ncclwatch_secret_setting_is_redacted():
    secrets = [n for n, f in Settings.model_fields.items() if SecretStr in getattr(f.annotation, "__args__", ())]
    assert {"api_token", "slack_webhook_url", "pagerduty_routing_key", "webhook_secret"} <= set(secrets)
    names = [ENV_PREFIX + n.upper() for n in [*secrets, "webhook_url"]]
    out = redact_env(dict.fromkeys(names, "https://example.com/hook/abc"))
    assert set(out.values()) == {marker("secret variable")}


def test_bytes_that_are_not_utf8_survive():
    data = b"\xff\xfe binary \x80 then DB_PASSWORD=pw2 and \xc3"  # ends mid-character, as a cut tail can
    assert (
        redact_bytes(data)
        == b"\xff\xfe binary \x80 then DB_PASSWORD=" + marker("secret assignment").encode() + b" and \xc3"
    )


@pytest.mark.parametrize(
    "unit",
    ["sk-", "eyJ-", "ghp_", "hf_", "-----BEGIN PRIVATE KEY-----", "QUJD" * 20 + "\n", "a=", '"a": ', "--a ", "a://b:"],
)
def test_pathological_input_stays_linear(unit):
    """A tail is 256 KiB; a quadratic pattern would take minutes on one of these."""
    data = (unit * (256 * 1024 // len(unit) + 1)).encode()[: 256 * 1024] + b"\n-----END PRIVATE KEY-----\n"
    started = time.perf_counter()
    redact_bytes(data)
    assert time.perf_counter() - started < 3.0
