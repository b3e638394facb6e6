"""Talking to engines over HTTP: beat scrapes every replica every few seconds, so a probe
must not rebuild the TLS trust store (~24 ms of CPU each) on every call."""

import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deployments import engine

METRICS = (
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{model_name="m"} 2\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{model_name="m"} 0\n'
)


class _Engine(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = METRICS.encode() if self.path == "/metrics" else b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_repeated_probes_build_the_tls_trust_once(
    engine_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = []
    real = ssl.create_default_context

    def counting(*args: object, **kwargs: object) -> ssl.SSLContext:
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", counting)
    engine._trust.cache_clear()
    for _ in range(5):
        assert engine.scrape(engine_url)["running"] == 2
        assert engine.probe_health(engine_url) == 200
    assert len(built) == 1
