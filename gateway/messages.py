"""The Anthropic Messages API dialect: ``/v1/messages`` and ``/v1/messages/count_tokens``.

These requests take the same way as chat (gateway/exchange.py: admission, queue, forwarding
to vLLM's own ``/v1/messages``, settling); what differs is how they look to the client:

- errors are Anthropic's ``{"type":"error","error":{"type","message"}}``: ``AnthropicSend``
  rewrites every error response (Tollgate's own and the engine's) on its way out, so the
  anthropic SDK raises its usual exceptions. A busy deployment (Tollgate's 503) is
  Anthropic's 529 ``overloaded_error``;
- streams are Anthropic's typed events (``event: …`` + ``data: …``), passed through as they
  are. Usage is in ``message_start`` (input tokens) and ``message_delta`` (output tokens, at
  the end); until then the tokens delivered are the content deltas handed to the client.

Anthropic counts input as ``input_tokens`` + ``cache_read_input_tokens`` +
``cache_creation_input_tokens``; all of it is the prompt billed, the cache reads as cached
(gateway/usage.py reads it).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.relay import StreamState
from gateway.usage import MESSAGES

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
OVERLOADED = 529  # Anthropic's status for "busy, retry later"


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(status: int, body: bytes) -> tuple[int, bytes]:
    """An error response (OpenAI-shaped, Tollgate's or an engine's) as Anthropic answers it."""
    if status == 503:
        status = OVERLOADED
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not message:
        message = "The request failed."
    return status, orjson.dumps(
        {"type": "error", "error": {"type": error_type(status), "message": message}}
    )


class AnthropicSend:
    """An ASGI ``send`` that rewrites error responses into Anthropic's shape.

    Error responses (Tollgate's ``respond``, an engine's whole error) are one start message
    and one body message: the start is held until its body arrives."""

    __slots__ = ("send", "held")

    def __init__(self, send: Any) -> None:
        self.send = send
        self.held: dict | None = None

    async def __call__(self, message: dict) -> None:
        if self.held is not None:
            start, self.held = self.held, None
            status, body = anthropic_error(start["status"], message.get("body", b""))
            headers = [(n, v) for n, v in start["headers"] if n != b"content-length"]
            await self.send({**start, "status": status, "headers": headers})
            await self.send({**message, "body": body})
            return
        if message["type"] == "http.response.start" and message["status"] >= 400:
            self.held = message
            return
        await self.send(message)


def stream_error(message: str) -> bytes:
    """An error inside a stream that already began (Anthropic's ``error`` event)."""
    body = orjson.dumps({"type": "error", "error": {"type": "api_error", "message": message}})
    return b"event: error\ndata: " + body + b"\n\n"


_DELTA = b"event: content_block_delta\n"
_EMPTY_DELTAS = (b'"text":""', b'"thinking":""', b'"partial_json":""', b'"signature_delta"')


def transform_event(frame: bytes, st: StreamState) -> bytes | None:
    """One Messages SSE event, passed on unchanged; usage and delivered tokens noted."""
    if st.outcome.ttft_ms is None:
        st.outcome.ttft_ms = st.elapsed_ms()
    if frame.startswith(_DELTA):
        # One delta is one token; an empty one or a thinking block's signature is none.
        if not any(empty in frame for empty in _EMPTY_DELTAS):
            st.content_frames += 1
        return frame + b"\n\n"
    name, _, data = frame.partition(b"\n")
    name = name.removeprefix(b"event:").strip()
    if name == b"content_block_start":
        if b'"type":"tool_use"' in data:
            st.content_frames += 1  # the tool's name
    elif name in (b"message_start", b"message_delta"):
        _note_usage(data, st, final=name == b"message_delta")
    elif name == b"error":
        st.outcome.status = "error"
        return stream_error(_engine_message(data))
    return frame + b"\n\n"


def _parsed(data: bytes) -> dict:
    try:
        obj = orjson.loads(data.removeprefix(b"data:"))
    except orjson.JSONDecodeError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _note_usage(data: bytes, st: StreamState, final: bool) -> None:
    obj = _parsed(data)
    usage = obj.get("usage") if final else (obj.get("message") or {}).get("usage")
    if not isinstance(usage, dict):
        return
    output = MESSAGES.read(usage, st.outcome)  # the relay sets what was delivered
    if final and output is not None:
        st.saw_usage = True
        st.pending_completion = output


def _engine_message(data: bytes) -> str:
    error = _parsed(data).get("error")
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) and message else "The engine failed while answering."
