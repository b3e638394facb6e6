"""Docker on a joined node, reached through its agent (nodeagent/) over Redis.

A joined node's ``docker_url`` is ``tollgate-node://<name>``: ``runtime.client`` then
returns an ordinary Docker SDK client whose HTTP requests this module's adapter pushes to
the node's request list and whose answers it reads back from the agent's reply list (wire
format: nodeagent/protocol.py). Every rule and every database write stays here on the
control plane; the agent only carries requests to its box's Docker API policy.
"""

import functools
import json
import secrets
import time
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
        if body is not None and not isinstance(body, bytes):
            raise AgentUnavailable("streamed request bodies are not relayed")
        path = request.path_url
        message = {
            "id": request_id,
            "method": request.method,
            "path": path,
            "headers": protocol.end_to_end(dict(request.headers)),
            "body": protocol.b64(body) if body else None,
            "deadline": time.time() + wait,
        }
        get_redis().lpush(protocol.rpc_key(self.base), json.dumps(message))
        reply = RelayBody(self.name, protocol.reply_key(self.base, request_id), wait)
        head = reply.next_message()
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

    def close(self) -> None:
        pass


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
