"""Freeing the part of a file another process still writes: punched holes.

NCCL opens its debug file once and writes each line at its own offset, so a
file cannot be rotated by rename (NCCL would go on writing the renamed file)
nor truncated (its next line would land past a gap it does not know of).  A
hole punched with ``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)``
behind the reader frees the blocks and keeps every offset valid: the size
stays, the freed range reads back as zeros.  ext4, xfs, btrfs and tmpfs
support it (measured here on ext4 and tmpfs, BENCHMARKS.md); NFS before 4.2,
overlayfs on old kernels and FUSE often do not, and ``punch_problem`` says so
before anything relies on it.  Python 3.11 has ``os.posix_fallocate`` (which
only allocates) and no punch: libc's ``fallocate`` is called through ctypes.

A reader that starts at the beginning of such a file (``ncclwatch analyze``,
a sidecar started again) must not read the zeros as text: ``retained_start``
says where the kept bytes after the first hole begin, at a line start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import tempfile
from pathlib import Path

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    _fallocate.restype = ctypes.c_int


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free ``length`` bytes at ``offset`` of the file open (for writing) as ``fd``; its size is kept.

    Raises ``OSError`` (``EOPNOTSUPP`` where the filesystem cannot).
    """
    if _fallocate is None:
        raise OSError(errno.ENOSYS, "this C library has no fallocate")
    if _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def punch_problem(folder: Path) -> str | None:
    """Why holes cannot free space in ``folder`` (None: they do), tried on a file of our own there."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ncclwatch-punch-") as probe:
            block = os.fstat(probe.fileno()).st_blksize
            probe.write(b"\n" * (4 * block))
            probe.flush()
            os.fsync(probe.fileno())
            before = os.fstat(probe.fileno()).st_blocks
            punch_hole(probe.fileno(), 0, 2 * block)
            after = os.fstat(probe.fileno()).st_blocks
    except OSError as exc:
        return f"cannot punch holes in {folder} ({exc.strerror or exc})"
    return None if after < before else f"punched holes free nothing in {folder}"


def _keeps_position(probe):  # type: ignore[no-untyped-def]
    """``lseek(SEEK_DATA/SEEK_HOLE)`` moves the descriptor's offset, under a buffered reader that believes it knows
    where it is (``BufferedReader.seek`` within its buffer never asks the kernel): put it back."""

    @functools.wraps(probe)
    def kept(fd: int, *args: int) -> int:
        position = os.lseek(fd, 0, os.SEEK_CUR)
        try:
            return probe(fd, *args)
        finally:
            os.lseek(fd, position, os.SEEK_SET)

    return kept


@_keeps_position
def retained_start(fd: int) -> int:
    """Where a reader from the start should begin: 0 for a file without holes, else the first line start after
    the first hole (the bytes before the hole are a kept head, whose operations would misalign with the tail's;
    the bytes from the hole's end to the next newline are the rest of a line whose start was freed)."""
    size = os.fstat(fd).st_size
    try:
        hole = os.lseek(fd, 0, os.SEEK_HOLE)
    except OSError:
        return 0  # no SEEK_HOLE here: read as before
    if hole >= size:
        return 0
    try:
        data = os.lseek(fd, hole, os.SEEK_DATA)
    except OSError:
        return size  # nothing but holes from there (ENXIO)
    return line_start_from(fd, data, size)


@_keeps_position
def data_after(fd: int, offset: int) -> int:
    """``offset``, or where data resumes when ``offset`` lies in a hole (the file's size when none follows)."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return os.fstat(fd).st_size
        return offset  # no SEEK_DATA (EINVAL): no holes known


@_keeps_position
def hole_after(fd: int, offset: int) -> int:
    """Where the data from ``offset`` ends: the next hole, or the end of the file."""
    try:
        return os.lseek(fd, offset, os.SEEK_HOLE)
    except OSError:
        return os.fstat(fd).st_size  # ENXIO at the end, or no SEEK_HOLE: no holes known


def line_start_from(fd: int, offset: int, size: int, chunk: int = 1 << 16) -> int:
    """The offset just after the first newline at or after ``offset`` (the file's size when none follows)."""
    position = offset
    while position < size:
        data = os.pread(fd, chunk, position)
        if not data:
            break
        newline = data.find(b"\n")
        if newline >= 0:
            return position + newline + 1
        position += len(data)
    return size


def last_line_end(fd: int, start: int, stop: int, chunk: int = 1 << 16) -> int:
    """The offset just after the last newline in [start, stop) (``start`` when there is none)."""
    position = stop
    while position > start:
        begin = max(start, position - chunk)
        newline = os.pread(fd, position - begin, begin).rfind(b"\n")
        if newline >= 0:
            return begin + newline + 1
        position = begin
    return start


def disk_bytes(root: Path) -> int:
    """Space the files under ``root`` take on disk (``st_blocks``, as ``du`` counts it; holes are free)."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:
                continue  # gone between listing and stat
    return total
