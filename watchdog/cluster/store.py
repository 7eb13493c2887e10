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
a key means the same from both sides.

Missing keys differ by backend: the libuv server (torch's default since
2.4) answers ``GET`` and ``MULTI_GET`` of a missing key with an empty value,
the classic server throws and closes the connection.  So ``get`` asks
``CHECK`` first, ``peek`` reads one key in one request on both (a
``COMPARE_SET`` whose expected value no one ever sets: the server answers
the current value, or the expected one when the key is missing, and changes
nothing), and ``multi_get`` reads many keys in one request where the server
answers missing keys with empty values (found out once per connection).

Failure mode: any socket or protocol error raises ``StoreError``; callers
treat the store as unreachable (degraded mode), never as an empty store.
"""

from __future__ import annotations

import asyncio
import struct

# QueryType in torch/csrc/distributed/c10d/TCPStoreBackend.hpp
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, GETNUMKEYS, DELETE_KEY, MULTI_GET = 0, 1, 2, 3, 4, 5, 7, 8, 10
MAGIC = 0x3C85F7CE
READY = 0
MAX_VALUE = 16 << 20  # what a sidecar ever reads; more means a stranger's key or a broken stream
ABSENT = b"\x00ncclwatch:absent\x00"  # the expected value of a peek: never set by anyone


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
        self.requests = 0
        self.sparse_reads: bool | None = None  # missing keys read as empty (libuv); None: not asked yet

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._writer is None or self._writer.is_closing():
            reader, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(struct.pack("<BI", VALIDATE, MAGIC))
            self._reader, self._writer = reader, writer
        assert self._reader is not None
        return self._reader, self._writer

    async def _request(self, payload: bytes, answer: int | None, values: int = 1) -> bytes | list[bytes]:
        """Send one request; read ``answer`` bytes back, or ``values`` length-prefixed values when None.

        One ``asyncio.timeout`` around the exchange, not ``wait_for`` per read: on Python 3.11 ``wait_for``
        can swallow a cancellation that lands as the read completes, and the sidecar's stop would wait forever
        on a loop cancelled mid-request (seen in the cluster benchmark: 15 of 20 cancels ignored).
        """
        async with self._lock:
            try:
                async with asyncio.timeout(self.timeout_s):
                    reader, writer = await self._connect()
                    writer.write(payload)
                    await writer.drain()
                    self.sent_bytes += len(payload)
                    self.requests += 1
                    if answer == 0:
                        return b""
                    if answer is not None:
                        data = await reader.readexactly(answer)
                        self.received_bytes += len(data)
                        return data
                    found = []
                    for _ in range(values):
                        (size,) = struct.unpack("<Q", await reader.readexactly(8))
                        if size > MAX_VALUE:
                            raise StoreError(f"value of {size} bytes: not ours")
                        found.append(await reader.readexactly(size))
                        self.received_bytes += 8 + size
                    return found
            except (OSError, TimeoutError, asyncio.IncompleteReadError, struct.error) as exc:
                await self.close()
                raise StoreError(f"store {self.host}:{self.port}: {type(exc).__name__}: {exc}") from exc

    def local_address(self) -> str | None:
        """The address this host reaches the store from: where the other nodes can reach this one."""
        if self._writer is None:
            return None
        sockname = self._writer.get_extra_info("sockname")
        return sockname[0] if sockname else None

    async def _value(self, payload: bytes) -> bytes:
        [value] = await self._request(payload, answer=None)
        return value

    async def _fixed(self, payload: bytes, size: int) -> bytes:
        data = await self._request(payload, answer=size)
        assert isinstance(data, bytes)
        return data

    async def set(self, key: str, value: bytes) -> None:
        await self._request(bytes([SET]) + _key(key) + _string(value), answer=0)

    async def check(self, keys: list[str]) -> bool:
        request = bytes([CHECK]) + struct.pack("<Q", len(keys)) + b"".join(_key(k) for k in keys)
        return (await self._fixed(request, 1))[0] == READY

    async def get(self, key: str) -> bytes | None:
        """The value, or None when no one has set the key (never blocks on a missing key)."""
        if not await self.check([key]):
            return None
        return await self._value(bytes([GET]) + _key(key))

    async def peek(self, key: str) -> bytes | None:
        """The value, or None: one request on either backend, and the key is left as it was."""
        value = await self.compare_set(key, ABSENT, ABSENT)
        return None if value == ABSENT else value

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set ``desired`` if the value is ``expected`` (b"": the key is missing); the value after, either way.

        A missing key with a non-empty ``expected`` answers ``expected`` and stays missing (both backends)."""
        return await self._value(bytes([COMPARE_SET]) + _key(key) + _string(expected) + _string(desired))

    async def multi_get(self, keys: list[str]) -> list[bytes | None]:
        """Each key's value or None, in one request where the server allows it (libuv), else one per key."""
        if not keys:
            return []
        if self.sparse_reads is None:
            self.sparse_reads = await self._reads_missing_as_empty()
        if not self.sparse_reads:
            return [await self.get(key) for key in keys]
        request = bytes([MULTI_GET]) + struct.pack("<Q", len(keys)) + b"".join(_key(k) for k in keys)
        values = await self._request(request, answer=None, values=len(keys))
        return [value or None for value in values]  # nobody sets an empty value: empty is missing

    async def _reads_missing_as_empty(self) -> bool:
        try:
            await self._value(bytes([GET]) + _key("ncclwatch/never-set"))
        except StoreError:  # the classic server closed the connection: reconnect, read key by key
            return False
        return True

    async def add(self, key: str, amount: int) -> int:
        data = await self._fixed(bytes([ADD]) + _key(key) + struct.pack("<q", amount), 8)
        return struct.unpack("<q", data)[0]

    async def delete(self, key: str) -> bool:
        data = await self._fixed(bytes([DELETE_KEY]) + _key(key), 8)
        return struct.unpack("<q", data)[0] > 0

    async def delete_many(self, keys: list[str]) -> int:
        """Delete every key with one write, the answers read after (in order, as the server serves a connection):
        an incident's evidence keys are one a node, 4,096 round trips one by one.  How many existed."""
        if not keys:
            return 0
        data = await self._fixed(b"".join(bytes([DELETE_KEY]) + _key(k) for k in keys), 8 * len(keys))
        return sum(count > 0 for (count,) in struct.iter_unpack("<q", data))

    async def num_keys(self) -> int:
        return struct.unpack("<q", await self._fixed(bytes([GETNUMKEYS]), 8))[0]

    async def close(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except (OSError, TimeoutError):
                pass
