"""The relay's wire format, shared by the control plane (deployments/relay.py) and the agent.

Keys, all under the node's own ``<prefix>:node:<name>`` (the only keys its ACL user may
touch):

- ``…:rpc``: a list of requests, pushed by the control plane, popped by the agent. Each is
  JSON: ``id``, ``method``, ``path`` (with its query), ``headers``, ``body`` (base64 or
  null) and ``deadline`` (epoch seconds: a request the agent pops later is dropped, so a
  node that comes back never replays stale work).
- ``…:reply:<id>``: the answer, a list of JSON messages: ``{"status", "headers"}``, then
  ``{"data": base64}`` chunks as Docker sends them (a pull's progress streams), then
  ``{"end": true}`` — or ``{"error": "…"}`` at any point.
- ``…:facts``: the agent's report on its box (GPUs, available memory), JSON with a TTL;
  its presence is the agent's heartbeat.
"""

import base64

REPLY_TTL_SECONDS = 300
# Headers that describe one HTTP hop, not the message: each side sets its own.
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
)


def rpc_key(base: str) -> str:
    return f"{base}:rpc"


def reply_key(base: str, request_id: str) -> str:
    return f"{base}:reply:{request_id}"


def facts_key(base: str) -> str:
    return f"{base}:facts"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def end_to_end(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
