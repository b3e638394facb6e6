"""Answers to the client: Tollgate's own (``respond``), and engines' — whole responses, and
SSE streams passed through frame by frame.

Streams ask the engine for ``include_usage`` + ``continuous_usage_stats`` so the gateway
knows the tokens delivered after every frame; what the client did not ask for is stripped,
so the client sees exactly the OpenAI shape. Per-frame work is one orjson parse (and a
dump only when a frame has to change). The other dialects pass through the same relay,
plugging their frame handling into ``StreamState`` (gateway/messages.py, and
gateway/responses.py's ``ResponseRelay``, which also reads a whole answer).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from gateway.errors import error_body, normalise_upstream_error
from gateway.upstream import UpstreamRefused
from gateway.usage import CHAT, CHECKPOINT_SECONDS, Outcome, UsageShape

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
JSON_HEADERS = [(b"content-type", b"application/json")]


async def respond(
    send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A whole JSON response of Tollgate's own."""
    await send(
        {"type": "http.response.start", "status": status, "headers": JSON_HEADERS + (headers or [])}
    )
    await send({"type": "http.response.body", "body": body})


def carries_tokens(data: bytes) -> bool:
    """Whether a chat or completion chunk with choices holds generated tokens: a role-only
    chunk, an empty delta or the finishing chunk does not (unless it also carries reasoning
    or a tool call). Inside JSON strings quotes are escaped, so the patterns cannot match
    generated text."""
    if (
        b'"content":""' not in data
        and b'"text":""' not in data
        and b'"delta":{}' not in data
        and b'"content":null' not in data
    ):
        return True
    return (
        b'"reasoning":"' in data or b'"reasoning_content":"' in data or b'"tool_calls":[{' in data
    )


async def _post(session: Any, url: str, body: bytes, headers: dict[str, str]) -> Any:
    """POST to an engine with the gateway's client (gateway.upstream.EngineClient, or an
    aiohttp session): a response whose headers arrived, or UpstreamRefused."""
    try:
        return await session.post(url, data=body, headers=headers)
    except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
        raise UpstreamRefused(str(exc)) from exc


class AdapterGone(Exception):
    """The engine answered 404 for a LoRA adapter the gateway believed it held (a worker
    unloaded it meanwhile); nothing reached the client, so the request may go elsewhere."""


async def forward_whole(
    session: Any,
    url: str,
    body: bytes,
    headers: dict[str, str],
    send: Any,
    extra_headers: list[tuple[bytes, bytes]],
    outcome: Outcome,
    shape: UsageShape = CHAT,
    answer: Callable[[Outcome, bytes], Awaitable[bytes]] | None = None,
    adapter: bool = False,
) -> None:
    """Non-streaming: wait for the engine's answer and pass it on unchanged (``shape``: its
    API's ``usage``; ``answer``: another dialect's reading of a 200 answer, which may also
    change it; ``adapter``: the request names a LoRA adapter, AdapterGone on a 404)."""
    resp = await _post(session, url, body, headers)
    try:
        raw = await resp.read()
    finally:
        resp.close()
    if adapter and resp.status == 404:
        raise AdapterGone(raw[:200])
    outcome.http_status = resp.status
    if resp.status == 200:
        if answer is not None:
            raw = await answer(outcome, raw)
        else:
            try:
                usage = orjson.loads(raw).get("usage")
            except (orjson.JSONDecodeError, AttributeError):
                usage = None
            if isinstance(usage, dict):
                outcome.completion_tokens = shape.read(usage, outcome) or 0
        outcome.status = "ok"
    else:
        raw = normalise_upstream_error(resp.status, raw)
    outcome.started = True
    await respond(send, resp.status, raw, extra_headers)


@dataclass(slots=True)
class StreamState:
    """Per-stream bookkeeping while frames pass through."""

    wants_usage: bool
    wants_continuous: bool
    started_at: float
    outcome: Outcome
    pending_completion: int = 0  # tokens in frames read but not yet sent
    saw_usage: bool = False
    content_frames: int = 0
    checkpoint: Any = None  # async callable(outcome): records delivered tokens for crash recovery
    last_checkpoint: float = 0.0
    transform: Any = None  # callable(frame, st) for another dialect's events (default: OpenAI's)
    error_frames: Any = None  # callable(message) -> the frames that end a stream with an error
    before_send: Any = None  # async callable() a transform sets: run once, before its frame is sent
    unfinished: Any = None  # callable() -> why a stream the engine ended is incomplete, or None
    # Preemptible streams (gateway/preempt.py) keep what the client got, to resume from it;
    # a preemption that comes while a send is under way waits for the send to end.
    sent: list[bytes] | None = None
    sending: bool = False
    preempt: bool = False

    def elapsed_ms(self) -> int:
        return int((time.perf_counter() - self.started_at) * 1000)

    def failure(self, message: str) -> bytes:
        """The frames that end this stream with Tollgate's error ``message``."""
        if self.error_frames is not None:
            return self.error_frames(message)
        return b"data: " + error_body(message, "server_error") + b"\n\ndata: [DONE]\n\n"


USAGE_MARK = b',"usage":'


class Preempted(Exception):
    """The gateway gave this stream's engine slot to a higher class (gateway/preempt.py)."""


def transform_frame(frame: bytes, st: StreamState) -> bytes | None:
    """One SSE frame as the client should see it (None: drop it).

    Engines serialise ``usage`` as the last member of a chunk (vLLM's pydantic models do),
    so the usage object is parsed and stripped by slicing; any other layout takes the
    general path (parse the whole frame)."""
    if not frame.startswith(b"data:"):
        return frame + b"\n\n"  # comments / keep-alives
    data = frame[5:].lstrip()
    if data == b"[DONE]":
        return b"data: [DONE]\n\n"
    if st.outcome.ttft_ms is None:
        st.outcome.ttft_ms = st.elapsed_ms()
    at = data.rfind(USAGE_MARK)
    if at > 0 and data.endswith(b"}") and not data.startswith(b'{"error"'):
        try:
            usage = orjson.loads(data[at + len(USAGE_MARK) : -1])
        except orjson.JSONDecodeError:
            usage = None
        if isinstance(usage, dict):
            st.saw_usage = True
            st.pending_completion = CHAT.read(usage, st.outcome) or 0
            if b'"choices":[]' in data[:at]:  # the final usage-only chunk
                return frame + b"\n\n" if st.wants_usage else None
            if st.wants_continuous:
                return frame + b"\n\n"
            return b"data: " + data[:at] + b"}\n\n"
    elif at < 0 and not data.startswith(b'{"error"'):
        if b'"choices":[{' in data and carries_tokens(data):
            st.content_frames += 1
        return frame + b"\n\n"
    return _transform_parsed(frame, data, st)


def _transform_parsed(frame: bytes, data: bytes, st: StreamState) -> bytes | None:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return frame + b"\n\n"
    if not isinstance(obj, dict):
        return frame + b"\n\n"
    if "error" in obj:
        st.outcome.status = "error"
        error = obj["error"] if isinstance(obj["error"], dict) else {}
        code = error.get("code") if isinstance(error.get("code"), int) else 500
        return b"data: " + normalise_upstream_error(code, orjson.dumps(obj)) + b"\n\n"
    usage = obj.get("usage")
    choices = obj.get("choices")
    if isinstance(usage, dict):
        st.saw_usage = True
        st.pending_completion = CHAT.read(usage, st.outcome) or 0
        if choices == []:  # the final usage-only chunk
            if not st.wants_usage:
                return None
            if not st.wants_continuous:
                return frame + b"\n\n"
        elif not st.wants_continuous:
            del obj["usage"]
            return b"data: " + orjson.dumps(obj) + b"\n\n"
    elif choices and carries_tokens(data):
        st.content_frames += 1
    return frame + b"\n\n"


async def forward_stream(
    session: Any,
    url: str,
    body: bytes,
    headers: dict[str, str],
    send: Any,
    extra_headers: list[tuple[bytes, bytes]],
    st: StreamState,
    max_frame: int,
    adapter: bool = False,
) -> None:
    """Streaming: pass SSE frames through as they arrive, tracking tokens delivered
    (``adapter``: as forward_whole's)."""
    outcome = st.outcome
    resp = await _post(session, url, body, headers)
    try:
        if adapter and resp.status == 404:
            raise AdapterGone(await resp.read())
        outcome.http_status = resp.status
        if resp.status != 200:
            raw = normalise_upstream_error(resp.status, await resp.read())
            outcome.started = True
            await respond(send, resp.status, raw, extra_headers)
            return
        outcome.status = "ok"
        outcome.started = True
        st.sending = True
        await send(
            {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + extra_headers}
        )
        st.sending = False
        await _relay(resp, send, st, max_frame)
    finally:
        resp.close()


async def resume_stream(
    session: Any,
    url: str,
    body: bytes,
    headers: dict[str, str],
    send: Any,
    st: StreamState,
    max_frame: int,
) -> None:
    """The rest of a preempted stream: the client already has its start and first frames,
    so only the engine's further frames follow (``st.transform`` makes them continue the
    client's stream); an engine error ends the stream with an error event."""
    resp = await _post(session, url, body, headers)
    try:
        if resp.status != 200:
            st.outcome.status = "error"
            raw = normalise_upstream_error(resp.status, await resp.read())
            failed = b"data: " + raw + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": failed, "more_body": False})
            return
        await _relay(resp, send, st, max_frame)
    finally:
        resp.close()


async def _relay(resp: Any, send: Any, st: StreamState, max_frame: int) -> None:
    outcome = st.outcome
    transform = st.transform or transform_frame
    buffer = b""
    failure = None
    async for chunk in resp.content.iter_any():
        buffer += chunk
        out = []
        while (end := buffer.find(b"\n\n")) >= 0:
            frame, buffer = buffer[:end], buffer[end + 2 :]
            if frame:
                shown = transform(frame, st)
                if shown is not None:
                    out.append(shown)
        if len(buffer) > max_frame:
            failure = "The engine sent an oversized event."
        if st.before_send is not None:
            before_send, st.before_send = st.before_send, None
            await before_send()
        if out:
            body = b"".join(out)
            if st.sent is None:
                await send({"type": "http.response.body", "body": body, "more_body": True})
            else:  # preemptible: marks its sends (gateway/preempt.py), others pay nothing
                st.sending = True
                await send({"type": "http.response.body", "body": body, "more_body": True})
                st.sending = False
                st.sent.append(body)
                if st.preempt and failure is None:
                    raise Preempted
        # Only tokens in frames handed to the client count as delivered.
        outcome.completion_tokens = st.pending_completion if st.saw_usage else st.content_frames
        if failure:
            break
        if st.checkpoint is not None and outcome.completion_tokens:
            now = time.monotonic()
            if now - st.last_checkpoint >= CHECKPOINT_SECONDS:
                st.last_checkpoint = now
                st.sending = True  # not cancelled inside a Redis call: preempted after it
                await st.checkpoint(outcome)
                st.sending = False
                if st.preempt:
                    raise Preempted
    st.sending = True  # done: a preemption now changes nothing
    if failure is None and st.unfinished is not None:
        failure = st.unfinished()
    if failure is not None:
        outcome.status = "error"
        await send({"type": "http.response.body", "body": st.failure(failure), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
