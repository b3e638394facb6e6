"""Docker on a joined node, reached through its agent (nodeagent/) over Redis.

A joined node's ``docker_url`` is ``tollgate-node://<name>``: ``runtime.client`` then
returns an ordinary Docker SDK client whose HTTP requests this module's adapter pushes to
the node's request list and whose answers it reads back from the agent's reply list (wire
format: nodeagent/protocol.py). A streamed body (``put_archive``'s file) follows its
request in chunks, as fast as the agent hands them to Docker. Every rule and every database
write stays here on the control plane; the agent only carries requests to its box's Docker
API policy.
"""

import functools
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import docker
import redis
from django.conf import settings
from docker.errors import DockerException
from requests import PreparedRequest, Response
from requests.adapters import BaseAdapter
from requests.structures import CaseInsensitiveDict
from requests.utils import get_encoding_from_headers

from core.keyspace import rkey
from core.redis import get_redis
from nodeagent import protocol

SCHEME = "tollgate-node://"
# The API version the SDK would otherwise ask the (not yet reachable) daemon for at once.
API_VERSION = "1.41"
DEFAULT_WAIT_SECONDS = 60.0
# How often a streamed body's sender looks whether the agent took a chunk: it waits on
# the agent this way between chunks once the window is full, so short.
BODY_POLL_SECONDS = 0.01


class AgentUnavailable(DockerException):
    """The node's agent did not answer in time (down, cut off or revoked)."""


@functools.cache
def _waiting_redis() -> redis.Redis:
    """A client for the blocking pops: the shared one times out reads after 5 s, a reply
    may take as long as the Docker call (Redis ends each pop at its own timeout)."""
    return redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=None)


def is_relayed(docker_url: str) -> bool:
    return docker_url.startswith(SCHEME)


def node_url(name: str) -> str:
    return f"{SCHEME}{name}"


def key_base(name: str) -> str:
    """The keys (and only those) the node's Redis user may touch live under this."""
    return rkey("node", name)


def read_facts(name: str) -> dict[str, Any] | None:
    """The agent's last report on its box, or None when it sent none lately."""
    raw = get_redis().get(protocol.facts_key(key_base(name)))
    return json.loads(raw) if raw else None


def client(docker_url: str) -> docker.DockerClient:
    """A Docker SDK client whose every request goes through the node's agent."""
    name = docker_url.removeprefix(SCHEME)
    dc = docker.DockerClient(base_url="tcp://relay.invalid:2375", version=API_VERSION)
    dc.api.mount("http://relay.invalid:2375", RelayAdapter(name))
    return dc


def _wait_seconds(timeout: object) -> float:
    if isinstance(timeout, tuple):
        timeout = timeout[1]
    return float(timeout) + 5.0 if isinstance(timeout, int | float) else DEFAULT_WAIT_SECONDS


class RelayAdapter(BaseAdapter):
    """A requests transport that carries each request to the node's agent and back."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.base = key_base(name)

    def send(
        self,
        request: PreparedRequest,
        stream: bool = False,
        timeout: object = None,
        verify: object = True,
        cert: object = None,
        proxies: object = None,
    ) -> Response:
        wait = _wait_seconds(timeout)
        request_id = secrets.token_hex(12)
        body = request.body.encode() if isinstance(request.body, str) else request.body
        message = self._message(request, body, request_id, wait)
        get_redis().lpush(protocol.rpc_key(self.base), json.dumps(message))
        reply = RelayBody(self.name, protocol.reply_key(self.base, request_id), wait)
        if "body_key" not in message:
            return _response(request, reply.next_message(), reply)
        # Pushed now, while the agent feeds it to Docker: Docker answers only once it has
        # read the body, so the reply's head cannot come first.
        BodySender(self.name, message["body_key"], reply.key, wait).send(_pieces(body))
        try:
            return _response(request, reply.next_message(), reply)
        finally:
            get_redis().delete(message["body_key"])  # left over if Docker answered early

    def _message(
        self, request: PreparedRequest, body: Any, request_id: str, wait: float
    ) -> dict[str, Any]:
        """The request as the agent reads it; a streamed body is only named (it follows)."""
        message = {
            "id": request_id,
            "method": request.method,
            "path": request.path_url,
            "headers": protocol.end_to_end(dict(request.headers)),
            "body": protocol.b64(body) if isinstance(body, bytes) and body else None,
            "deadline": time.time() + wait,
        }
        if body is not None and not isinstance(body, bytes):
            message["body_key"] = protocol.body_key(self.base, request_id)
            if request.headers.get("Content-Length"):  # requests knows a file's size
                message["length"] = int(request.headers["Content-Length"])
        return message

    def close(self) -> None:
        pass


def _response(request: PreparedRequest, head: dict[str, Any], reply: "RelayBody") -> Response:
    response = Response()
    response.status_code = head["status"]
    response.headers = CaseInsensitiveDict(head.get("headers") or {})
    response.encoding = get_encoding_from_headers(response.headers)
    response.raw = reply
    response.reason = ""
    response.url = request.url or ""
    response.request = request
    reply.chunked = response.headers.get("Transfer-Encoding", "").lower() == "chunked"
    return response


def _pieces(body: Any) -> Iterator[bytes]:
    """A streamed body (a file or an iterable of bytes) in chunks of the protocol's size."""
    if hasattr(body, "read"):
        while piece := body.read(protocol.BODY_CHUNK_BYTES):
            yield piece.encode() if isinstance(piece, str) else piece
        return
    # A generator's pieces may be tiny: gathered, so that one Redis message is ~1 MiB.
    pending = bytearray()
    for piece in body:
        pending += piece.encode() if isinstance(piece, str) else piece
        while len(pending) >= protocol.BODY_CHUNK_BYTES:
            yield bytes(pending[: protocol.BODY_CHUNK_BYTES])
            del pending[: protocol.BODY_CHUNK_BYTES]
    if pending:
        yield bytes(pending)


class BodySender:
    """Pushes a request's streamed body to the node's body list no faster than the agent
    takes it, so Redis never holds more than a few chunks of an upload."""

    def __init__(self, name: str, key: str, reply_key: str, wait: float) -> None:
        self.name, self.key, self.reply_key, self.wait = name, key, reply_key, wait

    def send(self, pieces: Iterator[bytes]) -> None:
        """Push every piece, then the end. A source that fails is the caller's error (raised
        as it is) after the agent was told to abort the call."""
        while (piece := self._next(pieces)) is not None:
            waiting = self._push({"data": protocol.b64(piece)})
            if waiting >= protocol.BODY_WINDOW_CHUNKS and not self._wait_for_room():
                return  # Docker answered before reading it all: its answer says why
        self._push({"end": True})

    def _next(self, pieces: Iterator[bytes]) -> bytes | None:
        try:
            return next(pieces, None)
        except Exception as exc:
            self._push({"error": f"reading the request body failed: {exc}"})
            raise

    def _push(self, message: dict[str, Any]) -> int:
        """Push a message; how many are waiting now."""
        pipe = get_redis().pipeline(transaction=False)
        pipe.lpush(self.key, json.dumps(message))
        pipe.expire(self.key, protocol.REPLY_TTL_SECONDS)
        return pipe.execute()[0]

    def _wait_for_room(self) -> bool:
        """Wait until the agent took a chunk (True) or Docker's answer came (False)."""
        deadline = time.monotonic() + self.wait
        while time.monotonic() < deadline:
            pipe = get_redis().pipeline(transaction=False)
            waiting, answered = pipe.llen(self.key).exists(self.reply_key).execute()
            if answered:
                return False
            if waiting < protocol.BODY_WINDOW_CHUNKS:
                return True
            time.sleep(BODY_POLL_SECONDS)
        self._abort()
        raise AgentUnavailable(
            f"node {self.name}: its agent took none of the request body for {self.wait:g} s"
        )

    def _abort(self) -> None:
        """Leave the agent only an error to pop, should it come back to this call."""
        pipe = get_redis().pipeline(transaction=True)
        pipe.delete(self.key)
        pipe.lpush(self.key, json.dumps({"error": "the control plane gave up sending the body"}))
        pipe.expire(self.key, protocol.REPLY_TTL_SECONDS)
        pipe.execute()


class RelayBody:
    """A response body read from the agent's reply list as it arrives.

    Looks enough like urllib3's response for requests and for the Docker SDK's stream
    reader (``_fp.chunked``, ``_fp.chunk_left``), so ``pull``'s progress streams live."""

    def __init__(self, name: str, key: str, wait: float) -> None:
        self.name, self.key, self.wait = name, key, wait
        self.buffer = b""
        self.finished = False
        self.chunked = False
        self._fp = self

    def next_message(self) -> dict[str, Any]:
        item = _waiting_redis().blpop([self.key], timeout=self.wait)
        if item is None:
            raise AgentUnavailable(
                f"node {self.name}: its agent did not answer within {self.wait:g} s"
            )
        message = json.loads(item[1])
        if "error" in message:
            raise AgentUnavailable(f"node {self.name}: {message['error']}")
        return message

    @property
    def chunk_left(self) -> int:
        return len(self.buffer)

    @property
    def closed(self) -> bool:
        return self.finished and not self.buffer

    def read(self, amt: int | None = None, **_: Any) -> bytes:
        while not self.finished and (amt is None or len(self.buffer) < 1):
            message = self.next_message()
            if message.get("end"):
                self.finished = True
            else:
                self.buffer += protocol.unb64(message["data"])
                if amt is not None:
                    break
        size = len(self.buffer) if amt is None else amt
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def release_conn(self) -> None:
        pass

    def close(self) -> None:
        self.finished, self.buffer = True, b""
