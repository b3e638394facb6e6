"""The gateway's HTTP/1.1 client for engines: keep-alive connections per engine, each request
sent in one write, responses parsed by httptools (the C parser uvicorn serves with).

It does exactly what the hot path needs and nothing else (no cookies, redirects, proxies,
compression or multidict headers), at a fraction of a general client's CPU per request;
``TOLLGATE_UPSTREAM_CLIENT=aiohttp`` switches back to an aiohttp session with the same
surface (``post`` → ``status``, ``read()``, ``content.iter_any()``, ``close()``), and
bench/gateway_bench.py measures both.

- Connections are reused LIFO and dropped after ``idle_seconds`` (engines' uvicorn closes
  idle keep-alive connections after 5 s); a reused connection that closes before any
  response byte arrives was closed by the engine while idle: the request is sent once more
  on a fresh connection (nothing reached the engine's handler).
- Closing a response before its end closes the connection: the engine sees the client go
  and aborts the request (how a client disconnect reaches the engine).
- Bodies are handed over as they arrive; reading from the engine pauses while more than
  ``HIGH_WATER`` bytes wait for a slow client.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
import time
from collections.abc import AsyncIterator
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

import httptools

CONNECT_TIMEOUT = 5.0
IDLE_SECONDS = 4.0
HIGH_WATER = 256 * 1024


class UpstreamRefused(Exception):
    """The engine could not be reached (refused, unreachable, no answer to connect): nothing
    was sent, so another replica may be tried."""


class UpstreamBroken(ConnectionError):
    """The engine's connection ended in the middle of a response."""


@lru_cache(maxsize=1024)
def _target(url: str) -> tuple[str, str, int, bytes, bytes]:
    """(scheme, host, port, request target, Host header) of an engine URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    default = port == (443 if parts.scheme == "https" else 80)
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    host_header = host if default else f"{host}:{port}"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.scheme, parts.hostname, port, target.encode(), host_header.encode()


def _header_line(name: str, value: str) -> bytes:
    if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
        raise ValueError(f"header {name!r} holds a line break")
    return f"{name}: {value}\r\n".encode("latin-1")


class Response:
    """One engine response; ``content`` is itself (``content.iter_any()`` like aiohttp)."""

    def __init__(self, conn: _Connection, client: EngineClient) -> None:
        self.status = 0
        self.content = self
        self._conn, self._client = conn, client
        self._loop = conn.loop
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._headers: asyncio.Future = self._loop.create_future()
        self._complete = False
        self._error: BaseException | None = None
        self._keep_alive = False
        self._until_close = (
            True  # no Content-Length and not chunked: the body ends with the connection
        )
        self.received_any = False
        self._paused = False

    # --- fed by the connection ----------------------------------------------------------------

    def _header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length" or (
            lowered == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self._until_close = False

    def _headers_done(self, status: int, keep_alive: bool) -> None:
        self.status, self._keep_alive = status, keep_alive
        if not self._headers.done():
            self._headers.set_result(None)

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _finished(self) -> None:
        self._complete = True
        self._wake()

    def _lost(self, exc: BaseException | None) -> None:
        if self._headers.done() and self._until_close and not self._complete:
            self._complete = True  # a body delimited by the end of the connection
        elif not self._complete:
            self._error = UpstreamBroken(f"the engine closed the connection ({exc or 'EOF'})")
            if not self._headers.done():
                self._headers.set_exception(self._error)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- for the caller -------------------------------------------------------------------------

    async def iter_any(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (as many as are there each time)."""
        while True:
            if self._chunks:
                data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    self._conn.transport.resume_reading()
                yield data
                continue
            if self._complete:
                return
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            await self._waiter
            self._waiter = None

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_any()])

    def close(self) -> None:
        """Done with the response: its connection goes back to the pool if the response was
        read to its end, else it is closed (the engine aborts the request)."""
        conn = self._conn
        if conn.response is not self:
            return
        conn.response = None
        if (
            self._complete
            and self._error is None
            and self._keep_alive
            and not conn.closed
            and not self._paused
        ):
            self._client._release(conn)
        else:
            conn.abort()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine, serving one response at a time."""

    def __init__(self, key: tuple[str, int, bool]) -> None:
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.closed = False
        self.idle_since = 0.0

    def start(self, response: Response) -> None:
        self.response = response
        self.parser = httptools.HttpResponseParser(self)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # --- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            self.abort()  # bytes nobody asked for: this connection cannot be trusted any more
            return
        response.received_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response._lost(exc)
            self.abort()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None:
            self.response._lost(exc)

    # --- httptools callbacks ----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.response._header(name, value)

    def on_headers_complete(self) -> None:
        self.response._headers_done(self.parser.get_status_code(), self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        self.response._body(body)

    def on_message_complete(self) -> None:
        self.response._finished()


class EngineClient:
    """Keep-alive connections to engines; ``await client.post(url, data=…, headers=…)``."""

    def __init__(
        self, connect_timeout: float = CONNECT_TIMEOUT, idle_seconds: float = IDLE_SECONDS
    ) -> None:
        self.connect_timeout, self.idle_seconds = connect_timeout, idle_seconds
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._tls: ssl_module.SSLContext | None = None

    async def post(self, url: str, data: bytes, headers: dict[str, str]) -> Response:
        """Send a POST and wait for the response's status line and headers."""
        scheme, host, port, target, host_header = _target(url)
        key = (host, port, scheme == "https")
        request = b"".join(
            [
                b"POST ",
                target,
                b" HTTP/1.1\r\nhost: ",
                host_header,
                b"\r\ncontent-length: %d\r\n" % len(data),
                *[_header_line(name, value) for name, value in headers.items()],
                b"\r\n",
                data,
            ]
        )
        for _ in range(2):
            conn = self._reuse(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key)
            response = Response(conn, self)
            conn.start(response)
            conn.transport.write(request)
            try:
                await response._headers
                return response
            except UpstreamBroken:
                conn.abort()
                if reused and not response.received_any:
                    continue  # the engine closed this idle connection as we sent: once more, fresh
                raise
            except BaseException:
                conn.abort()  # cancelled (client gone): the engine must see us go too
                raise
        raise AssertionError("unreachable")

    def _reuse(self, key: tuple[str, int, bool]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest_ok = time.monotonic() - self.idle_seconds
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since >= oldest_ok:
                return conn
            conn.abort()
        return None

    async def _connect(self, key: tuple[str, int, bool]) -> _Connection:
        host, port, tls = key
        loop = asyncio.get_running_loop()
        ssl_context = None
        if tls:
            if self._tls is None:
                self._tls = ssl_module.create_default_context()
            ssl_context = self._tls
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(key), host, port, ssl=ssl_context
                )
        except (OSError, TimeoutError) as exc:
            raise UpstreamRefused(
                f"cannot connect to {host}:{port}: {exc or exc.__class__.__name__}"
            ) from exc
        return conn

    def _release(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    async def close(self) -> None:
        """Close the idle connections (requests in flight end with their tasks)."""
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()


def make_client(kind: str) -> Any:
    """The upstream client the gateway uses: ``tollgate`` (this module) or ``aiohttp``."""
    if kind == "aiohttp":
        import aiohttp

        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT),
            auto_decompress=False,
        )
    if kind != "tollgate":
        raise ValueError(f"TOLLGATE_UPSTREAM_CLIENT must be tollgate or aiohttp, not {kind!r}")
    return EngineClient()
