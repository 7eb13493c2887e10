"""Worker heartbeats: ``ncclwatch.beat(step)`` and the optimizer hook both land here.

File: ``<NCCLWATCH_RUN_DIR>/hb/<pid>.json``, replaced whole (temporary file
``.<pid>.json.tmp`` in the same folder, then ``os.replace``; no fsync, a
crash of the machine loses nothing the sidecar needs).  One line of JSON
with exactly these keys::

    {"pid": 4242, "rank": 3, "local_rank": 1, "restart": 0, "step": 120,
     "time": 1795301250.123, "beats": 121}

``pid``      the process that beat (file name and content agree).
``rank``     ``RANK`` of the torchrun worker (global rank).
``local_rank`` ``LOCAL_RANK``, or ``null`` if unset or not a number.
``restart``  ``TORCHELASTIC_RESTART_COUNT`` (0 if unset): a restart makes new pids.
``step``     the last step given, or the previous step + 1 for ``beat()``.
``time``     wall clock (unix seconds, float) of the beat that set ``step``;
             not of the write, which can come up to 0.1 s later.
``beats``    calls to ``beat`` in this process so far, written or not.

Rate limit: ``beat`` itself only records (step, count, ``time.monotonic()``;
about 0.2 us); a daemon thread started by the first beat writes the file
at once and then at most every 0.1 s, whenever something changed since its
last write.  So no beat is lost to the rate limit (the one just before a hang
says where the rank stopped; dropping it would put a rank one step behind its
peers), the training thread never waits on the file system (a replace costs
~1.6 ms on ext4 here: rename-over-an-existing-file makes ext4 start writing
the data back), and an ``atexit`` hook writes the last state at a clean exit.

Only a torchrun worker beats: ``NCCLWATCH_RUN_DIR`` and an integer ``RANK``
must be set, and a process started by a worker (which inherits both; e.g.
spawned DataLoader or compile workers) is told apart by
``NCCLWATCH_WORKER_PID``, which the injected ``sitecustomize`` sets to the
worker's own pid.  Anywhere else ``beat`` does nothing, cheaply.  It never
raises: a full disk or a removed run folder must not kill a training job.

This module imports only the standard library: the injected
``sitecustomize`` loads it into every worker.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

_PERIOD_S = 0.1


class _Heart:
    """The per-process beat state, written by ``beat`` and read by the flusher thread."""

    __slots__ = (
        "beat_mono",
        "beats",
        "folder",
        "local_rank",
        "lock",
        "pid",
        "rank",
        "restart",
        "started",
        "step",
        "written_beats",
    )

    def __init__(self) -> None:
        self.started = False
        self.pid = 0
        self.folder = ""
        self.rank = self.restart = self.step = self.beats = self.written_beats = 0
        self.local_rank: int | None = None
        self.beat_mono = 0.0
        # The flusher and the atexit hook both write; unserialized, two
        # writers on the one temporary file could leave a mixed line.
        self.lock = threading.Lock()


_heart = _Heart()


def beat(step: int | None = None) -> None:
    """Record progress: ``step`` (or the previous step + 1), now, this pid.

    Cheap enough to call every iteration; see the module docstring for the
    file, the rate limit and when it does nothing.
    """
    heart = _heart
    try:
        # Stored in this order and read by the flusher in reverse (beats
        # first): a write that races a beat shows that beat's step and time
        # with an older count, and the changed count makes the next pass write again.
        heart.step = heart.step + 1 if step is None else int(step)
        heart.beat_mono = time.monotonic()
        heart.beats += 1
        if not heart.started:
            _start(heart)
    except Exception:  # noqa: BLE001, S110 - a heartbeat must never take the job down
        pass


def _start(heart: _Heart) -> None:
    """Read the environment once; start the flusher if this process is a worker."""
    heart.started = True
    env = os.environ
    run_dir = env.get("NCCLWATCH_RUN_DIR")
    owner = env.get("NCCLWATCH_WORKER_PID")
    rank = env.get("RANK", "")
    if not run_dir or not rank.isdigit() or (owner is not None and owner != str(os.getpid())):
        return
    heart.pid = os.getpid()
    heart.rank = int(rank)
    local_rank = env.get("LOCAL_RANK", "")
    heart.local_rank = int(local_rank) if local_rank.isdigit() else None
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    heart.restart = int(restart) if restart.isdigit() else 0
    heart.folder = os.path.join(run_dir, "hb")
    threading.Thread(target=_flush_forever, args=(heart,), name="ncclwatch-heartbeat", daemon=True).start()
    atexit.register(_flush, heart)


def _flush(heart: _Heart) -> None:
    """Write the state if it changed since the last write.  Runs in the flusher and at exit."""
    # atexit hooks are inherited across fork: in a child, this is the
    # parent's state, and its lock may have been held by a thread that the
    # fork did not copy.  Check the pid before touching the lock.
    if heart.pid != os.getpid():
        return
    with heart.lock:
        _write_changed(heart)


def _write_changed(heart: _Heart) -> None:
    beats = heart.beats
    if beats == heart.written_beats:
        return
    # The beat's monotonic time turned into wall time here, so the hot path
    # never calls time.time() and the file says when the beat happened.
    wall = time.time() - (time.monotonic() - heart.beat_mono)
    local_rank = "null" if heart.local_rank is None else heart.local_rank
    # Every value is an int, a finite float or null: an f-string is valid
    # JSON and several times cheaper than json.dumps.
    line = (
        f'{{"pid": {heart.pid}, "rank": {heart.rank}, "local_rank": {local_rank}, '
        f'"restart": {heart.restart}, "step": {heart.step}, "time": {wall!r}, "beats": {beats}}}\n'
    )
    heart.written_beats = beats
    path = os.path.join(heart.folder, f"{heart.pid}.json")
    tmp = os.path.join(heart.folder, f".{heart.pid}.json.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        pass


def _flush_forever(heart: _Heart) -> None:
    while True:
        try:
            _flush(heart)
        except Exception:  # noqa: BLE001, S110 - keep beating whatever one write did
            pass
        time.sleep(_PERIOD_S)


def _after_fork_in_child() -> None:
    # A forked child is another pid with its own file and no flusher thread
    # (threads do not survive fork).  Resolve the environment again: the
    # child is not the worker NCCLWATCH_WORKER_PID names, unless no
    # sitecustomize set it.
    global _heart
    step = _heart.step
    _heart = _Heart()
    _heart.step = step


os.register_at_fork(after_in_child=_after_fork_in_child)
