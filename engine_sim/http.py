"""A small HTTP/1.1 server on asyncio's Protocol API (keep-alive, pipelining-safe).

Protocol rather than streams because it tells us the moment a client goes away
(`connection_lost`), which is how vLLM aborts a request on disconnect, and because it is
roughly twice as fast per request; the benchmark drives thousands of requests per second
through one process.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import Awaitable, Callable
from http import HTTPStatus

MAX_HEADER = 65536
MAX_BODY = 64 * 1024 * 1024
_REASONS = {s.value: s.phrase for s in HTTPStatus}


class Request:
    """One parsed request: lower-cased header names, raw body bytes."""

    __slots__ = ("method", "path", "query", "headers", "body", "keep_alive")

    def __init__(
        self, method: str, target: str, headers: dict[str, str], body: bytes, keep_alive: bool
    ) -> None:
        self.method = method
        self.path, _, self.query = target.partition("?")
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive


Handler = Callable[[Request, "Connection"], Awaitable[None]]


class Connection(asyncio.Protocol):
    """One client connection; runs one task that serves its requests in order."""

    def __init__(
        self, app: Handler, connections: set[Connection], finish_abandoned: bool = False
    ) -> None:
        self.app = app
        self.connections = connections
        # --sim-finish-abandoned: a request whose client left runs to its end (not vLLM).
        self.finish_abandoned = finish_abandoned
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.task: asyncio.Task | None = None
        self._data: asyncio.Future | None = None
        self._drain: asyncio.Future | None = None
        self.busy = False
        self.keep_alive = True
        self.started = False
        self.pending: list[bytes] = []

    # --- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio only sets this when the listening socket says proto=IPPROTO_TCP; without
            # it a stream's small writes wait for delayed ACKs (40 ms each).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections.add(self)
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self._data is not None and not self._data.done():
            self._data.set_result(None)

    def eof_received(self) -> bool:
        return False  # a half-closed client is gone as far as HTTP/1.1 is concerned

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.connections.discard(self)
        # --sim-finish-abandoned (not vLLM) lets a running request go on to its end: what it
        # writes goes nowhere (send and flush skip a closed connection), and the request loop
        # ends after it (`closed`).
        abandoned_runs_on = self.busy and self.finish_abandoned
        if self.task is not None and not self.task.done() and not abandoned_runs_on:
            self.task.cancel()  # aborts the request being generated, like vLLM does
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def pause_writing(self) -> None:
        self._drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # --- request loop ----------------------------------------------------------------------

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self.closed:
                req = self._parse()
                if req is None:
                    if self.closed:
                        return
                    self._data = loop.create_future()
                    await self._data
                    continue
                self.busy = True
                await self._dispatch(req)
                self.busy = False
                if not self.keep_alive or not req.keep_alive:
                    self.close()
                    return
        except asyncio.CancelledError:
            pass

    async def _dispatch(self, req: Request) -> None:
        self.started = False
        try:
            await self.app(req, self)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not take the server down, only this request
            print(f"ERROR engine_sim: unhandled {type(exc).__name__}: {exc}", file=sys.stderr)
            if not self.started:
                self.send_json(
                    500,
                    {
                        "error": {
                            "message": str(exc),
                            "type": "InternalServerError",
                            "param": None,
                            "code": 500,
                        }
                    },
                )
            else:
                self.close()

    def _parse(self) -> Request | None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEADER:
                self._fail(431, "Request Header Fields Too Large")
            return None
        lines = self.buf[:end].decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ", 2)
        except ValueError:
            self._fail(400, "Bad Request")
            return None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", ""):
            self._fail(411, "Length Required")
            return None
        length = int(headers.get("content-length", "0") or 0)
        if length > MAX_BODY:
            self._fail(413, "Request Entity Too Large")
            return None
        start = end + 4
        if len(self.buf) < start + length:
            if headers.get("expect", "").lower() == "100-continue" and len(self.buf) == start:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            return None
        body = bytes(self.buf[start : start + length])
        del self.buf[: start + length]
        conn = headers.get("connection", "").lower()
        keep = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
        return Request(method, target, headers, body, keep)

    def _fail(self, status: int, text: str) -> None:
        self.keep_alive = False
        self.send_json(status, {"detail": text})
        self.close()

    # --- responses -------------------------------------------------------------------------

    def _head(
        self,
        status: int,
        content_type: str | None,
        extra: list[tuple[str, str]] | None,
        length: int | None,
    ) -> bytes:
        # None: no content type at all (a bare Starlette Response, e.g. the LoRA routes').
        typed = f"content-type: {content_type}\r\n" if content_type else ""
        parts = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nserver: uvicorn\r\n{typed}"]
        if length is None:
            parts.append("transfer-encoding: chunked\r\n")
        else:
            parts.append(f"content-length: {length}\r\n")
        if extra:
            parts.extend(f"{k}: {v}\r\n" for k, v in extra)
        if not self.keep_alive:
            parts.append("connection: close\r\n")
        parts.append("\r\n")
        return "".join(parts).encode("latin-1")

    def send(
        self,
        status: int,
        body: bytes,
        content_type: str | None = "application/json",
        extra: list[tuple[str, str]] | None = None,
    ) -> None:
        if self.closed:
            return
        self.started = True
        self.transport.write(self._head(status, content_type, extra, len(body)) + body)

    def send_json(
        self, status: int, obj: object, extra: list[tuple[str, str]] | None = None
    ) -> None:
        self.send(
            status, json.dumps(obj, separators=(",", ":")).encode(), "application/json", extra
        )

    def start_stream(
        self, status: int, content_type: str, extra: list[tuple[str, str]] | None = None
    ) -> None:
        self.started = True
        self.pending.append(self._head(status, content_type, extra, None))

    def write_chunk(self, data: bytes) -> None:
        """Queue one chunk; it goes out at the next flush() (before any wait, and at the end).

        Coalescing matters when tokens come faster than the timer resolution: one send
        instead of one per token."""
        if data:
            self.pending.append(b"%x\r\n%b\r\n" % (len(data), data))

    def flush(self) -> None:
        if self.pending:
            if not self.closed:
                self.transport.write(b"".join(self.pending))
            self.pending.clear()

    def end_stream(self) -> None:
        self.pending.append(b"0\r\n\r\n")
        self.flush()

    async def drain(self) -> None:
        """Wait while the client reads slower than we write (backpressure)."""
        if self._drain is not None:
            await self._drain

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()


class Server:
    """Owns the listening socket and the live connections."""

    def __init__(self, app: Handler, finish_abandoned: bool = False) -> None:
        self.app = app
        self.finish_abandoned = finish_abandoned
        self.connections: set[Connection] = set()
        self.server: asyncio.base_events.Server | None = None

    async def serve(self, sock: object) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: Connection(self.app, self.connections, self.finish_abandoned),
            sock=sock,
            backlog=2048,
        )

    def stop_listening(self) -> None:
        if self.server is not None:
            self.server.close()

    def busy(self) -> int:
        return sum(1 for c in self.connections if c.busy)

    def close_all(self) -> None:
        for c in list(self.connections):
            c.close()
