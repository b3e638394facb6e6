"""The relay between the control plane and a joined node's agent, on the real Redis with
the node's own ACL user, against a small HTTP server standing in for the node's Docker
API policy (no Docker needed: what is tested is the channel, not Docker)."""

import hashlib
import json
import secrets
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from core.redis import get_redis
from deployments import credentials, relay, runtime
from nodeagent import protocol
from nodeagent.agent import Agent, Config

NAME = "relay-node"


class FakeDocker(BaseHTTPRequestHandler):
    """Answers like Docker: JSON, a streamed (chunked) pull, and whatever it was sent."""

    seen: list[tuple[str, str, bytes]] = []

    def do_GET(self) -> None:
        self._json(200, {"ServerVersion": "27.0", "path": self.path})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(("POST", self.path, body))
        if self.path.split("?")[0].endswith("/images/create"):
            return self._chunked([b'{"status":"Pulling"}\r\n', b'{"status":"Done"}\r\n'])
        self._json(201, {"Id": "abc", "echo": json.loads(body or b"{}")})

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunked(self, parts: list[bytes]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for part in parts:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.flush()
            time.sleep(0.05)
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    """An agent thread logged in as the node's own Redis user, relaying to FakeDocker."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeDocker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    password = secrets.token_hex(16)
    redis_client = get_redis()
    rules = credentials.acl_rules(NAME, hashlib.sha256(password.encode()).hexdigest())
    redis_client.execute_command("ACL", "SETUSER", credentials.acl_user(NAME), *rules)
    kwargs = redis_client.connection_pool.connection_kwargs
    config = Config.from_env(
        {
            "TOLLGATE_NODE_NAME": NAME,
            "TOLLGATE_CONTROL_PLANE_REDIS": f"redis://{kwargs['host']}:{kwargs['port']}/0",
            "TOLLGATE_DOCKER_URL": f"tcp://127.0.0.1:{server.server_port}",
            "TOLLGATE_AGENT_THREADS": "2",
            "TOLLGATE_AGENT_FACTS_SECONDS": "0.2",
        }
    )
    credential = {
        "redis_user": credentials.acl_user(NAME),
        "redis_password": password,
        "key_base": relay.key_base(NAME),
    }
    running = Agent(config, credential)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    yield running
    running.stop()
    thread.join(timeout=10)
    server.shutdown()
    redis_client.execute_command("ACL", "DELUSER", credentials.acl_user(NAME))


def test_docker_calls_go_through_the_agent_and_back(agent: Agent) -> None:
    dc = relay.client(relay.node_url(NAME))
    assert dc.info()["ServerVersion"] == "27.0"
    created = dc.api.post(dc.api._url("/containers/create"), json={"Image": "x"})
    assert created.status_code == 201 and created.json()["echo"] == {"Image": "x"}
    assert FakeDocker.seen[-1][2] == b'{"Image": "x"}'
    # A streamed answer (a pull's progress) arrives as Docker sends it, event by event.
    events = list(dc.api.pull("tollgate/engine-sim", tag="latest", stream=True, decode=True))
    assert [e.get("status") for e in events] == ["Pulling", "Done"], events
    # Its facts arrive through the same channel.
    assert relay.read_facts(NAME)["available_memory_bytes"] > 0


def test_a_request_past_its_deadline_is_dropped_not_replayed(agent: Agent) -> None:
    """A node that comes back after an outage must not run work queued long ago."""
    base = relay.key_base(NAME)
    stale = {"id": "old", "method": "POST", "path": "/v1.41/containers/create", "headers": {},
             "body": protocol.b64(b'{"Image": "stale"}'), "deadline": time.time() - 1}  # fmt: skip
    before = len(FakeDocker.seen)
    get_redis().lpush(protocol.rpc_key(base), json.dumps(stale))
    time.sleep(1.0)
    assert len(FakeDocker.seen) == before
    assert get_redis().llen(protocol.reply_key(base, "old")) == 0


def test_a_silent_agent_is_an_error_naming_the_node(settings: object) -> None:
    dc = relay.client(relay.node_url("nobody-home"))
    dc.api.timeout = 0.5
    with pytest.raises(runtime.RuntimeFailure) as info:
        runtime.info(dc)
    assert "nobody-home: its agent did not answer within 5.5 s" in str(info.value)
    assert settings.TOLLGATE_REDIS_PREFIX in relay.key_base("nobody-home")
