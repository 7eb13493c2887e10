"""A client for torch's c10d TCPStore, in pure Python: the sidecars meet where the job already does.

torchrun (static ``--master-addr`` or ``--rdzv-backend c10d``) runs a
TCPStore that every worker reaches at ``MASTER_ADDR:MASTER_PORT``.  PyTorch's
own debug server joins it as one more client under a prefix of its own; the
sidecar does the same without importing torch (hundreds of MB and seconds of
start-up, and analyze-only installs have no torch).

The wire format, from torch/csrc/distributed/c10d (TCPStoreBackend.hpp,
TCPStoreLibUvBackend.cpp), the same for the libuv and the classic server:
a connection first sends ``VALIDATE`` (one byte, 0) and the magic
``0x3C85F7CE`` as a uint32; then each request is one command byte followed
by its arguments, strings and payloads as a uint64 length and the bytes,
integers in the machine's byte order (little-endian on every host torch
ships for).  torch's client puts ``/`` before every key; so does this one, so
a key means the same from both sides.  ``GET`` of a missing key blocks on
the server until someone sets it, so ``get`` asks ``CHECK`` first.

Failure mode: any socket or protocol error raises ``StoreError``; callers
treat the store as unreachable (degraded mode), never as an empty store.
"""

from __future__ import annotations

import asyncio
import struct

VALIDATE, SET, GET, ADD, CHECK = 0, 1, 3, 4, 5
MAGIC = 0x3C85F7CE
READY = 0
MAX_VALUE = 16 << 20  # what a sidecar ever reads; more means a stranger's key or a broken stream


class StoreError(Exception):
    """The store cannot be reached, or answered something we do not understand."""


def _string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _key(key: str) -> bytes:
    return _string(b"/" + key.encode())


class StoreClient:
    """One connection; requests are serialised (the protocol has no request ids)."""

    def __init__(self, host: str, port: int, timeout_s: float = 5.0) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self.sent_bytes = 0
        self.received_bytes = 0

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._writer is None or self._writer.is_closing():
            reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.timeout_s)
            writer.write(struct.pack("<BI", VALIDATE, MAGIC))
            self._reader, self._writer = reader, writer
        assert self._reader is not None
        return self._reader, self._writer

    async def _request(self, payload: bytes, answer: int | None) -> bytes:
        """Send one request; read ``answer`` bytes back, or a length-prefixed value when None."""
        async with self._lock:
            try:
                reader, writer = await self._connect()
                writer.write(payload)
                await asyncio.wait_for(writer.drain(), self.timeout_s)
                self.sent_bytes += len(payload)
                if answer == 0:
                    return b""
                if answer is None:
                    (size,) = struct.unpack("<Q", await asyncio.wait_for(reader.readexactly(8), self.timeout_s))
                    if size > MAX_VALUE:
                        raise StoreError(f"value of {size} bytes: not ours")
                    answer = size
                    self.received_bytes += 8
                data = await asyncio.wait_for(reader.readexactly(answer), self.timeout_s)
                self.received_bytes += len(data)
                return data
            except (OSError, TimeoutError, asyncio.IncompleteReadError, struct.error) as exc:
                await self.close()
                raise StoreError(f"store {self.host}:{self.port}: {type(exc).__name__}: {exc}") from exc

    async def set(self, key: str, value: bytes) -> None:
        await self._request(bytes([SET]) + _key(key) + _string(value), answer=0)

    async def check(self, keys: list[str]) -> bool:
        request = bytes([CHECK]) + struct.pack("<Q", len(keys)) + b"".join(_key(k) for k in keys)
        return (await self._request(request, answer=1))[0] == READY

    async def get(self, key: str) -> bytes | None:
        """The value, or None when no one has set the key (never blocks on a missing key)."""
        if not await self.check([key]):
            return None
        return await self._request(bytes([GET]) + _key(key), answer=None)

    async def add(self, key: str, amount: int) -> int:
        data = await self._request(bytes([ADD]) + _key(key) + struct.pack("<q", amount), answer=8)
        return struct.unpack("<q", data)[0]

    async def close(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except (OSError, TimeoutError):
                pass
