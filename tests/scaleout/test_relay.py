"""The relay between the control plane and a joined node's agent, on the real Redis with
the node's own ACL user, against a small HTTP server standing in for the node's Docker
API policy (no Docker needed: what is tested is the channel, not Docker)."""

import hashlib
import io
import json
import random
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from core.redis import get_redis
from deployments import relay, runtime
from nodeagent import protocol
from nodeagent.agent import Agent
from tests.deployments.test_docker import wait_for
from tests.scaleout.agents import agent_thread

NAME = "relay-node"
MIB = 2**20


class FakeDocker(BaseHTTPRequestHandler):
    """Answers like Docker: JSON, a streamed (chunked) pull, and whatever it was sent."""

    seen: list[tuple[str, str, bytes]] = []
    # Bodies of PUTs (archives) as they came: "length" or "chunked" and the bytes, or
    # ("aborted", None) when the connection closed mid-body.
    puts: list[tuple[str, bytes | None]] = []

    def do_GET(self) -> None:
        self._json(200, {"ServerVersion": "27.0", "path": self.path})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(("POST", self.path, body))
        if self.path.split("?")[0].endswith("/images/create"):
            return self._chunked([b'{"status":"Pulling"}\r\n', b'{"status":"Done"}\r\n'])
        self._json(201, {"Id": "abc", "echo": json.loads(body or b"{}")})

    def do_PUT(self) -> None:
        if "refuse" in self.path:  # as the policy refuses an archive: answers, reads no more
            self.close_connection = True
            return self._json(403, {"message": "refused by the policy: the archive"})
        chunked = self.headers.get("Transfer-Encoding", "").lower() == "chunked"
        try:
            body = self._read_chunked() if chunked else self._read(self._length())
        except EOFError:
            self.puts.append(("aborted", None))
            self.close_connection = True
            return
        self.puts.append(("chunked" if chunked else "length", body))
        self._json(200, {"size": len(body)})

    def _length(self) -> int:
        return int(self.headers.get("Content-Length") or 0)

    def _read(self, size: int) -> bytes:
        data = self.rfile.read(size)
        if len(data) < size:
            raise EOFError
        return data

    def _read_chunked(self) -> bytes:
        """A chunked body, decoded (http.server leaves that to the handler)."""
        parts = []
        while True:
            line = self.rfile.readline()
            if not line:
                raise EOFError
            size = int(line.split(b";")[0], 16)
            if size == 0:
                self._read(2)  # the CRLF after the last, empty chunk (no trailers are sent)
                return b"".join(parts)
            parts.append(self._read(size))
            self._read(2)  # the CRLF after each chunk

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
def fake_docker() -> Iterator[str]:
    """FakeDocker's URL, as the agent's TOLLGATE_DOCKER_URL."""
    FakeDocker.puts.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeDocker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"tcp://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture
def agent(fake_docker: str) -> Iterator[Agent]:
    """An agent thread logged in as the node's own Redis user, relaying to FakeDocker."""
    with agent_thread(NAME, fake_docker) as running:
        yield running


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


def archive_url(dc: object) -> str:
    return dc.api._url("/containers/abc/archive")


def fingerprint(data: bytes | None) -> tuple[int, str]:
    """Length and digest: a mismatch of megabytes is read as two short lines."""
    return (len(data), hashlib.sha256(data).hexdigest()) if data is not None else (0, "")


def body_lists() -> list[bytes]:
    return get_redis().keys(protocol.body_key(relay.key_base(NAME), "*"))


def test_an_uploaded_file_reaches_docker_whole_with_its_length(agent: Agent) -> None:
    """More chunks than the relay lets wait in Redis at once: the flow control is used."""
    data = random.randbytes(5 * MIB + 123)
    dc = relay.client(relay.node_url(NAME))
    answer = dc.api.put(archive_url(dc), params={"path": "/cache"}, data=io.BytesIO(data))
    assert answer.status_code == 200 and answer.json() == {"size": len(data)}
    framing, body = FakeDocker.puts[-1]
    assert framing == "length" and fingerprint(body) == fingerprint(data)
    assert body_lists() == []  # nothing of the upload is left in Redis


def test_a_generated_body_reaches_docker_whole_chunked(agent: Agent) -> None:
    data = random.randbytes(3 * MIB + 7)
    pieces = (data[i : i + 100_000] for i in range(0, len(data), 100_000))
    dc = relay.client(relay.node_url(NAME))
    answer = dc.api.put(archive_url(dc), data=pieces)
    assert answer.status_code == 200 and answer.json() == {"size": len(data)}
    framing, body = FakeDocker.puts[-1]
    assert framing == "chunked" and fingerprint(body) == fingerprint(data)


def test_an_upload_refused_before_its_end_gets_the_refusal(agent: Agent) -> None:
    """Docker (its policy) may answer without reading the rest: the caller gets that
    answer at once, not a silence of the agent once the chunks it no longer takes pile up."""
    data = io.BytesIO(bytes(4 * protocol.BODY_WINDOW_CHUNKS * MIB))
    dc = relay.client(relay.node_url(NAME))
    answer = dc.api.put(dc.api._url("/containers/refuse/archive"), data=data, timeout=5)
    assert answer.status_code == 403
    assert answer.json() == {"message": "refused by the policy: the archive"}
    assert body_lists() == []


def test_a_body_whose_source_fails_is_cut_off_and_the_agent_goes_on(fake_docker: str) -> None:
    def failing() -> Iterator[bytes]:
        yield random.randbytes(3 * MIB)
        raise OSError("the upload's disk went away")

    with agent_thread(NAME, fake_docker, threads=1):  # one thread: it must survive the abort
        dc = relay.client(relay.node_url(NAME))
        dc.api.timeout = 5
        with pytest.raises(OSError, match="the upload's disk went away"):
            dc.api.put(archive_url(dc), data=failing())
        # Docker sees its connection close mid-body, so it does not wait for the rest.
        wait_for(lambda: FakeDocker.puts == [("aborted", None)], timeout=10)
        assert dc.info()["ServerVersion"] == "27.0"


def test_an_upload_nobody_takes_stops_after_a_few_chunks_naming_the_node() -> None:
    """Redis holds a few chunks of an upload, never all of it, when no agent reads them."""
    read = []

    def source() -> Iterator[bytes]:
        for _ in range(64):
            read.append(MIB)
            yield bytes(MIB)

    dc = relay.client(relay.node_url("nobody-home"))
    with pytest.raises(relay.AgentUnavailable) as info:
        dc.api.put(archive_url(dc), data=source(), timeout=0.5)
    assert "nobody-home: its agent took none of the request body for 5.5 s" in str(info.value)
    assert sum(read) <= (protocol.BODY_WINDOW_CHUNKS + 1) * MIB
    get_redis().delete(protocol.rpc_key(relay.key_base("nobody-home")))
