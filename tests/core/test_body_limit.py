"""Request bodies larger than their route takes never reach Django's temporary files: a body
declared too large is answered 413 before any of it is read, a chunked one is cut off once
it passes the limit; each in the error shape its route's clients read.

The middleware is driven in process with an application that reads a body as Django does;
the last test sends raw HTTP to the real gunicorn server, as curl would."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from core.uploads import FORM_SLACK_BYTES, BodyLimit
from tests.gateway.conftest import start_gateway, stop

CHUNK = 256 * 1024
LIMIT = 1024 * 1024  # the adapter archive limit these tests set


class ReadsLikeDjango:
    """An ASGI app that reads the whole body before answering (as Django's handler does)."""

    def __init__(self) -> None:
        self.called = False
        self.received = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        self.called = True
        while True:
            message = await receive()
            self.received += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(self.received).encode()})


def drive(path: str, total: int, declared: bool) -> tuple[ReadsLikeDjango, dict, int]:
    """Send ``total`` bytes to ``path`` through the middleware in CHUNK pieces; the app, the
    answer (status, headers, body) and how many pieces the server asked for."""
    app = ReadsLikeDjango()
    asked = 0
    headers = [(b"content-length", str(total).encode())] if declared else []
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal asked
        asked += 1
        left = total - (asked - 1) * CHUNK
        return {"type": "http.request", "body": b"x" * min(CHUNK, left), "more_body": left > CHUNK}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(BodyLimit(app)(scope, receive, send))
    answer = {
        "status": sent[0]["status"],
        "headers": dict(sent[0]["headers"]),
        "body": sent[1]["body"],
    }
    return app, answer, asked


@pytest.fixture(autouse=True)
def limits(settings: Any) -> None:
    settings.TOLLGATE_ADAPTER_MAX_BYTES = LIMIT
    settings.TOLLGATE_BATCH_MAX_FILE_BYTES = LIMIT // 2
    settings.TOLLGATE_MAX_BODY_BYTES = LIMIT // 4


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_within_the_limit_reaches_the_application_whole(declared: bool) -> None:
    total = LIMIT + FORM_SLACK_BYTES  # the archive at its limit and the form's fields
    app, answer, _ = drive("/api/v1/adapters/", total, declared)
    assert answer["status"] == 200 and app.received == total


def test_a_body_declared_too_large_is_refused_before_a_byte_is_read() -> None:
    app, answer, asked = drive("/api/v1/adapters/acme/support/upload/", 10 * LIMIT, True)
    assert answer["status"] == 413 and not app.called and asked == 0
    problem = json.loads(answer["body"])
    assert answer["headers"][b"content-type"] == b"application/problem+json"
    assert problem["type"] == "/api/problems/request-too-large" and problem["status"] == 413
    assert problem["detail"] == (
        "The file is larger than the 1.0 MB this takes (TOLLGATE_ADAPTER_MAX_BYTES)."
    )


def test_a_chunked_body_is_cut_off_once_past_the_limit() -> None:
    total = 40 * LIMIT
    app, answer, asked = drive("/api/v1/adapters/", total, declared=False)
    assert answer["status"] == 413 and app.received <= LIMIT + FORM_SLACK_BYTES
    assert asked * CHUNK <= LIMIT + FORM_SLACK_BYTES + CHUNK  # the rest is never read


def test_each_route_answers_in_its_own_clients_terms_and_by_its_own_limit() -> None:
    _, batch, _ = drive("/v1/files", 3 * LIMIT, declared=False)
    assert batch["status"] == 413
    assert json.loads(batch["body"])["error"] == {
        "message": "The file is larger than the 0.5 MB this takes (TOLLGATE_BATCH_MAX_FILE_BYTES).",
        "type": "invalid_request_error",
        "param": "file",
        "code": "file_too_large",
    }
    _, page, _ = drive("/adapters/12/edit/", 3 * LIMIT, declared=True)
    assert page["status"] == 413 and page["headers"][b"content-type"].startswith(b"text/html")
    assert b"The file is larger than the 1.0 MB this takes" in page["body"]
    _, other, _ = drive("/tenants/new/", 3 * LIMIT, declared=True)
    assert other["status"] == 413
    assert b"The request body is larger than the 0.3 MB this takes" in other["body"]
    _, fine, _ = drive("/adapters/new/", LIMIT, declared=True)
    assert fine["status"] == 200


# --- The real server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def web(django_db_setup: None) -> Iterator[tuple[str, int]]:
    env = {
        "TOLLGATE_ADAPTER_MAX_BYTES": str(LIMIT),
        "TOLLGATE_MAX_BODY_BYTES": str(LIMIT // 4),
    }
    proc, url = start_gateway(1, env)
    parts = urlsplit(url)
    yield parts.hostname, parts.port
    stop(proc)


def post_raw(server: tuple[str, int], head: str, body_bytes: int) -> tuple[bytes, int]:
    """Send a request head, then up to ``body_bytes`` of chunked body while the server
    reads it (as curl does); the server's answer and how many body bytes went out."""
    conn = socket.create_connection(server, timeout=30)
    conn.sendall(head.encode())
    chunk = b"%x\r\n%s\r\n" % (CHUNK, b"x" * CHUNK)
    sent, answer, sending, pending = 0, b"", body_bytes > 0, b""
    deadline = time.monotonic() + 60
    conn.setblocking(False)
    try:
        while time.monotonic() < deadline:
            readable, writable, _ = select.select([conn], [conn] if sending else [], [], 1.0)
            if readable:
                try:
                    data = conn.recv(65536)
                except ConnectionResetError:
                    break
                if not data:
                    break  # the server answered and closed
                answer += data
            elif writable:
                try:
                    pending = pending or chunk  # a piece the last send left over first
                    done = conn.send(pending)
                    sent, pending = sent + done, pending[done:]
                except BlockingIOError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    sending = False  # it stopped reading: what it said is still to be read
                sending = sending and sent < body_bytes
    finally:
        conn.close()
    return answer, sent


@pytest.mark.django_db
def test_the_server_answers_413_to_a_declared_or_chunked_body_past_the_limit(
    web: tuple[str, int],
) -> None:
    head = "POST /api/v1/adapters/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    declared, _ = post_raw(web, head + f"Content-Length: {100 * LIMIT}\r\n\r\n", 0)
    assert declared.startswith(b"HTTP/1.1 413"), declared[:200]
    assert b"TOLLGATE_ADAPTER_MAX_BYTES" in declared
    # 64 MiB offered in chunks: the server answers once past the limit and reads no more.
    chunked, sent = post_raw(web, head + "Transfer-Encoding: chunked\r\n\r\n", 64 * LIMIT)
    assert chunked.startswith(b"HTTP/1.1 413"), chunked[:200]
    assert b"/api/problems/request-too-large" in chunked
    assert sent < 32 * LIMIT, f"the server read {sent} bytes before answering"
