"""One pipelined Redis connection per gateway process, for the calls every request makes.

redis-py spends most of its per-call CPU on what the hot path does not need: a pool
checkout under a lock, generic argument encoding, and a timeout per call. The gateway
makes the same few calls per request (admit, settle, checkpoint), so it sends them on one
long-lived connection with many calls in flight at once: Redis answers in order, replies
are parsed by hiredis and resolve the callers' futures first-in, first-out. Calls made in
the same event-loop tick leave in one write.

A hung Redis fails calls closed: a timer aborts the connection when the oldest call has
waited longer than the call timeout, and every call in flight fails with TimeoutError
(the next call reconnects). A lost connection fails them with ConnectionError. Errors
Redis answers with raise ``redis.exceptions.ResponseError``, as redis-py would.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl as ssl_module
import time
from collections import deque
from typing import Any

import hiredis
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.connection import SSLConnection, parse_url

CALL_TIMEOUT = 5.0
CONNECT_TIMEOUT = 2.0


def _bulk(arg: Any) -> bytes:
    if type(arg) is not bytes:
        arg = arg.encode() if type(arg) is str else str(arg).encode()
    return b"$%d\r\n%b\r\n" % (len(arg), arg)


_KEY_CACHE: dict[str, bytes] = {}


def _key(name: str) -> bytes:
    """A key as a RESP bulk string; keys repeat from request to request, so they are kept."""
    try:
        return _KEY_CACHE[name]
    except KeyError:
        if len(_KEY_CACHE) >= 50_000:
            _KEY_CACHE.clear()
        piece = _KEY_CACHE[name] = _bulk(name)
        return piece


def encode(args: tuple) -> bytes:
    """A command in RESP: an array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join([_bulk(arg) for arg in args])


def encode_script_call(
    sha: bytes, keys: list | tuple, args: list | tuple, keep_keys: bool = True
) -> bytes:
    key = _key if keep_keys else _bulk
    return b"".join(
        [
            b"*%d\r\n$7\r\nEVALSHA\r\n" % (3 + len(keys) + len(args)),
            _bulk(sha),
            _bulk(len(keys)),
            *[key(k) for k in keys],
            *[_bulk(a) for a in args],
        ]
    )


class Script:
    """A Lua script called by its SHA1, loaded on first use and again after a Redis restart."""

    def __init__(self, source: str) -> None:
        self.source = source.encode()
        self.sha = hashlib.sha1(self.source).hexdigest().encode()


class _Connection(asyncio.Protocol):
    """One socket to Redis and the calls waiting for its replies, in order."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader()
        self.waiting: deque[tuple[asyncio.Future, float]] = deque()
        self.out: list[bytes] = []
        self.closed = False
        self.timed_out = False
        self._timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiting = self.waiting
        try:
            while (reply := self.reader.gets()) is not False:
                future = waiting.popleft()[0]
                if future.done():
                    continue  # its caller gave up (cancelled); the reply is not needed
                if isinstance(reply, hiredis.ReplyError):
                    future.set_exception(redis.exceptions.ResponseError(str(reply)))
                else:
                    future.set_result(reply)
        except (hiredis.ProtocolError, IndexError):
            self.transport.abort()  # out of step with the server: start over

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self.timed_out:
            error: Exception = TimeoutError(f"Redis did not answer within {self.timeout:g} s")
        else:
            error = ConnectionError(f"lost the connection to Redis ({exc or 'closed'})")
        while self.waiting:
            future = self.waiting.popleft()[0]
            if not future.done():
                future.set_exception(error)

    # --- calls --------------------------------------------------------------------------------

    def send(self, command: bytes) -> asyncio.Future:
        if self.closed:
            raise ConnectionError("the connection to Redis is closed")
        future = self._loop.create_future()
        self.waiting.append((future, time.monotonic()))
        if not self.out:
            self._loop.call_soon(self._flush)
        self.out.append(command)
        if self._timer is None:
            self._timer = self._loop.call_later(self.timeout, self._check)
        return future

    def _flush(self) -> None:
        if self.out and not self.closed:
            self.transport.write(b"".join(self.out))
        self.out = []

    def _check(self) -> None:
        """Abort when the oldest call has waited too long; else look again when it would."""
        self._timer = None
        if not self.waiting or self.closed:
            return
        due = self.waiting[0][1] + self.timeout
        if time.monotonic() >= due:
            self.timed_out = True
            self.transport.abort()
        else:
            self._timer = self._loop.call_later(due - time.monotonic(), self._check)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()


class RedisPipe:
    """A pipelined client: ``await pipe.call("HSET", key, field, value)``, ``await
    pipe.evalsha(script, keys, args)``. Bound to the event loop it first connects on."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        ssl: bool | ssl_module.SSLContext = False,
        path: str | None = None,
        timeout: float = CALL_TIMEOUT,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self.host, self.port, self.db, self.path = host, port, db, path
        self.username, self.password = username, password
        self.ssl = ssl_module.create_default_context() if ssl is True else ssl or None
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._conn: _Connection | None = None
        self._lock: asyncio.Lock | None = None

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisPipe:
        """``redis://[[user]:password@]host[:port][/db]`` or ``rediss://…`` (TLS)."""
        parsed = parse_url(url)
        return cls(
            host=parsed.get("host", "127.0.0.1"),
            port=int(parsed.get("port", 6379)),
            db=int(parsed.get("db", 0)),
            username=parsed.get("username"),
            password=parsed.get("password"),
            ssl=url.startswith("rediss://"),
            path=parsed.get("path"),
            **kwargs,
        )

    @classmethod
    def like(cls, client: aioredis.Redis, **kwargs: Any) -> RedisPipe:
        """A pipe to the same server and database as a redis-py client."""
        pool = client.connection_pool
        kw = pool.connection_kwargs
        return cls(
            host=kw.get("host", "127.0.0.1"),
            port=int(kw.get("port", 6379)),
            db=int(kw.get("db", 0)),
            username=kw.get("username"),
            password=kw.get("password"),
            ssl=issubclass(pool.connection_class, SSLConnection),
            path=kw.get("path"),
            **kwargs,
        )

    async def call(self, *args: Any) -> Any:
        return await self._send(encode(args))

    async def _send(self, command: bytes) -> Any:
        conn = self._conn
        if conn is None or conn.closed:
            conn = await self._connect()
        return await conn.send(command)

    async def send_now(self, command: bytes) -> asyncio.Future:
        """Write ``command`` to Redis before returning (with any calls of this tick queued
        before it) and give back its pending reply: what the caller sends next (to a client)
        leaves after it."""
        conn = self._conn
        if conn is None or conn.closed:
            conn = await self._connect()
        future = conn.send(command)
        conn._flush()
        return future

    async def evalsha(
        self, script: Script, keys: list | tuple, args: list | tuple, keep_keys: bool = True
    ) -> Any:
        """``keep_keys=False`` for keys used once (a new record's): they would only crowd
        the encoded keys kept for the ones every request repeats."""
        try:
            return await self._send(encode_script_call(script.sha, keys, args, keep_keys))
        except redis.exceptions.ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            # Redis restarted (or its script cache was flushed): EVAL loads it again.
            return await self.call(b"EVAL", script.source, len(keys), *keys, *args)

    async def _connect(self) -> _Connection:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._conn is not None and not self._conn.closed:
                return self._conn  # another caller connected while this one waited
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(self.connect_timeout):
                if self.path:
                    _, conn = await loop.create_unix_connection(
                        lambda: _Connection(self.timeout), self.path
                    )
                else:
                    _, conn = await loop.create_connection(
                        lambda: _Connection(self.timeout), self.host, self.port, ssl=self.ssl
                    )
                try:
                    if self.password is not None:
                        auth = (self.username, self.password) if self.username else (self.password,)
                        await conn.send(encode((b"AUTH", *auth)))
                    if self.db:
                        await conn.send(encode((b"SELECT", self.db)))
                except BaseException:
                    conn.close()
                    raise
            self._conn = conn
            return conn

    async def aclose(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
