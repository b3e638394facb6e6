"""Alert test helpers: a real webhook receiver on 127.0.0.1, the receiver recipe from the
docs (the code a receiver runs is the documented one), and Celery in eager mode."""

import functools
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from config.celery import app as celery_app

RECIPE_PAGE = Path(__file__).resolve().parents[2] / "docs" / "admins" / "alerts.md"


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def eager_tasks() -> Iterator[None]:
    """Queued tasks run in the test's process (no message reaches a shared broker); a
    countdown is ignored in eager mode, which the delivery's own due time makes harmless."""
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = False


@functools.cache
def recipe() -> dict[str, Any]:
    """The receiver recipe of docs/admins/alerts.md, executed: its names, as a receiver's
    program would have them."""
    text = RECIPE_PAGE.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    code = next(b for b in blocks if "def verify_tollgate_webhook" in b)
    namespace: dict[str, Any] = {"__name__": "receiver_recipe"}
    exec(compile(code, str(RECIPE_PAGE), "exec"), namespace)  # noqa: S102 - our own docs
    return namespace


@dataclass
class Delivery:
    """One request the receiver got."""

    headers: dict[str, str]
    body: bytes
    answered: int
    refused: str = ""  # why the receiver's check refused it (with ``secret`` set)


@dataclass
class Receiver:
    """A webhook receiver on 127.0.0.1: records each POST and answers with the next code of
    ``answers`` (200 once they run out). With ``secret`` set it first checks each request
    with the documented recipe, as a real receiver would, and answers 400 to a refused one."""

    url: str = ""
    secret: str = ""
    deliveries: list[Delivery] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)
    lock: threading.Condition = field(default_factory=threading.Condition)

    def wait_for(self, count: int, timeout: float = 10.0) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        with self.lock:
            while len(self.deliveries) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"the receiver got {len(self.deliveries)} deliveries, not {count}"
                    )
                self.lock.wait(left)
            return list(self.deliveries)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    state = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers, refused = dict(self.headers.items()), ""
            if state.secret:
                try:
                    recipe()["verify_tollgate_webhook"](state.secret, headers, body)
                except recipe()["InvalidWebhook"] as exc:
                    refused = str(exc)
            with state.lock:
                code = 400 if refused else (state.answers.pop(0) if state.answers else 200)
                state.deliveries.append(Delivery(headers, body, code, refused))
                state.lock.notify_all()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(refused.encode() or (b"ok" if code < 300 else b"receiver says no"))

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/tollgate"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def free_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (the receiver is down)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/down"


@pytest.fixture
def price(public_model: Any) -> Any:
    """1 USD per 1M tokens (input, cached and output), in force since long before the
    tests' clocks (November 2026)."""
    from datetime import UTC, datetime
    from decimal import Decimal

    import time_machine

    from metering import services

    with time_machine.travel(datetime(2026, 10, 1, tzinfo=UTC), tick=False):
        one = Decimal("1")
        return services.set_price(None, public_model, one, one, one)


@pytest.fixture
def web(db: None) -> Any:
    """A browser-like client with a console session for the user."""
    from django.test import Client

    def make(user: Any) -> Client:
        client = Client()
        client.force_login(user)
        return client

    return make
