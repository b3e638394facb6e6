"""The relay's wire format, shared by the control plane (deployments/relay.py) and the agent.

Keys, all under the node's own ``<prefix>:node:<name>`` (the only keys its ACL user may
touch):

- ``…:rpc``: a list of requests, pushed by the control plane, popped by the agent. Each is
  JSON: ``id``, ``method``, ``path`` (with its query), ``headers``, ``body`` (base64 or
  null) and ``deadline`` (epoch seconds: a request the agent pops later is dropped, so a
  node that comes back never replays stale work). A request whose body is a stream (an
  uploaded adapter's archive, up to gigabytes: never one message) has ``body_key``
  instead of ``body``, and ``length`` (bytes) when the sender knew it: the agent then sends
  Docker that ``Content-Length``, else a chunked body.
- ``…:body:<id>``: that stream, pushed by the control plane after the request (LPUSH; the
  agent BRPOPs, so it is FIFO) as the agent feeds it to Docker: ``{"data": base64}`` chunks
  of ``BODY_CHUNK_BYTES``, then ``{"end": true}`` — or ``{"error": "…"}`` when reading the
  source failed, and the agent aborts the call. The control plane keeps at most
  ``BODY_WINDOW_CHUNKS`` waiting and gives up when the agent takes none for the request's
  wait; the agent gives up when none comes for ``BODY_CHUNK_WAIT_SECONDS``. Either way
  Docker's connection is closed mid-body, so it never waits for the rest.
- ``…:reply:<id>``: the answer, a list of JSON messages: ``{"status", "headers"}``, then
  ``{"data": base64}`` chunks as Docker sends them (a pull's progress streams), then
  ``{"end": true}`` — or ``{"error": "…"}`` at any point.
- ``…:facts``: the agent's report on its box (GPUs, available memory), JSON with a TTL;
  its presence is the agent's heartbeat.
"""

import base64

REPLY_TTL_SECONDS = 300
BODY_CHUNK_BYTES = 1 << 20
# At most this many chunks wait in Redis per request (~11 MiB with base64): memory for
# the control plane's Redis, not the size of an upload, bounds what is in flight.
BODY_WINDOW_CHUNKS = 8
BODY_CHUNK_WAIT_SECONDS = 30.0
# Headers that describe one HTTP hop, not the message: each side sets its own.
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
)


def rpc_key(base: str) -> str:
    return f"{base}:rpc"


def reply_key(base: str, request_id: str) -> str:
    return f"{base}:reply:{request_id}"


def body_key(base: str, request_id: str) -> str:
    return f"{base}:body:{request_id}"


def facts_key(base: str) -> str:
    return f"{base}:facts"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def end_to_end(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
