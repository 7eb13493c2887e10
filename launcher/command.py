"""What the wrapper reads from the torchrun command line it was given."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def is_torchrun(command: Sequence[str]) -> bool:
    if not command:
        return False
    program = command[0].rsplit("/", 1)[-1]
    if program.startswith("torchrun"):
        return True
    modules = ("torch.distributed.run", "torch.distributed.launch")
    return program.startswith("python") and any(
        list(command[i : i + 2]) == ["-m", m] for i in range(len(command)) for m in modules
    )


def torchrun_log_dir(command: Sequence[str]) -> str | None:
    """torchrun's ``--log-dir``/``--log_dir`` (where ``--redirects``/``--tee`` put worker logs)."""
    for i, arg in enumerate(command):
        for flag in ("--log-dir", "--log_dir"):
            if arg == flag and i + 1 < len(command):
                return command[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def job_name_of(command: Sequence[str]) -> str:
    """The training script's name: the first argument after torchrun's options that looks like one."""
    for arg in command[1:]:
        if arg.endswith(".py"):
            return arg.rsplit("/", 1)[-1].removesuffix(".py")
    return "job"


def max_restarts_of(command: Sequence[str], environ: Mapping[str, str]) -> int:
    """torchrun's ``--max-restarts`` (or ``--max_restarts``, or ``PET_MAX_RESTARTS``); 0, its default, when none.

    Only torchrun's own options count, the ones before the training script.
    An unreadable value counts as 0: torchrun itself refuses it and never starts.
    """
    value = environ.get("PET_MAX_RESTARTS")
    script = next((i for i, arg in enumerate(command) if i > 0 and arg.endswith(".py")), len(command))
    for i, arg in enumerate(command[:script]):
        for flag in ("--max-restarts", "--max_restarts"):
            if arg == flag and i + 1 < len(command):
                value = command[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
    try:
        return max(0, int(value)) if value is not None else 0
    except ValueError:
        return 0
