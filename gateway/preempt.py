"""Preemption by the gateway, on every engine.

vLLM (0.32, also with ``--scheduling-policy priority``), llama.cpp, SGLang and Ollama keep a
P0 request that finds every slot busy waiting until a P2 reply ends: vLLM's priority policy
orders its queue but preempts only when the KV cache is full, never for a slot
(tests/vllm/test_priority.py). So the gateway preempts: admission
(acquire.lua) gives a P0/P1 request the slot of the youngest preemptible lower-class
request and announces it on a channel; the process serving that request aborts it upstream
(closing the connection, which frees the engine's slot at once) and queues it again at the
head of its class. Once readmitted it is resumed: sent again with what its client already
received (chat: as an assistant message the engine continues, vLLM's
``continue_final_message``; completions: appended to the prompt) and ``max_tokens`` reduced
by it. The client sees one stream: the same id, no second role chunk, usage counting every
token it received against the original prompt. The resumed prompt's extra tokens (the
recompute) are the operator's cost, never billed.

Only chat and completions requests that can be continued exactly are preemptible (one
choice, no tools, no echo, a text prompt); Responses, Messages and pooling requests never
are. A non-streaming request is restarted (its client received nothing yet).
"""

from __future__ import annotations

from typing import Any

import orjson

from core.hot import setting
from gateway.relay import StreamState, transform_frame

ENDPOINTS = frozenset(("chat", "completions"))


def enabled() -> bool:
    return bool(setting("TOLLGATE_ADMISSION_PREEMPT_FCFS"))


# Fields that can make a request impossible to resume exactly. Most requests carry none of
# them, and one set intersection (in C) answers for those: every admission asks.
_MAYBE_NOT = frozenset(("n", "best_of", "tools", "functions", "echo"))


def preemptible(endpoint: str, payload: dict) -> bool:
    """Whether the gateway could preempt this request and resume it exactly (the caller
    knows whether preemption is on and the engines leave it to the gateway)."""
    if endpoint not in ENDPOINTS:
        return False
    if not _MAYBE_NOT.intersection(payload):
        return endpoint == "chat" or isinstance(payload.get("prompt"), str)
    if (payload.get("n") or 1) != 1 or (payload.get("best_of") or 1) != 1:
        return False
    if endpoint == "chat":
        # A half-delivered tool call or reasoning cannot be handed back to the engine.
        return not payload.get("tools") and not payload.get("functions")
    return isinstance(payload.get("prompt"), str) and not payload.get("echo")


def may_be_victim(preemptions: int) -> bool:
    return preemptions < setting("TOLLGATE_ADMISSION_PREEMPT_MAX_TIMES")


def delivered(st: StreamState, endpoint: str) -> tuple[str, bytes | None, int | None]:
    """(text the client received, the stream's id, its created time) from the frames sent."""
    parts: list[str] = []
    ident: bytes | None = None
    created: int | None = None
    for frame in b"".join(st.sent or ()).split(b"\n\n"):
        if not frame.startswith(b"data:"):
            continue
        data = frame[5:].strip()
        if not data.startswith(b"{"):
            continue
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if ident is None and isinstance(obj.get("id"), str):
            ident, created = obj["id"].encode(), obj.get("created")
        for choice in obj.get("choices") or ():
            if endpoint == "chat":
                text = (choice.get("delta") or {}).get("content")
            else:
                text = choice.get("text")
            if isinstance(text, str):
                parts.append(text)
    return "".join(parts), ident, created


def resumed_payload(payload: dict, endpoint: str, text: str, emitted: int) -> dict:
    """The request that continues after ``text`` (``emitted`` tokens) was delivered."""
    out = dict(payload)
    for field in ("max_completion_tokens", "max_tokens"):
        if isinstance(out.get(field), int):
            out[field] = max(out[field] - emitted, 1)
    if isinstance(out.get("min_tokens"), int):
        out["min_tokens"] = max(out["min_tokens"] - emitted, 0)
    if not text:
        return out
    if endpoint == "completions":
        out["prompt"] = payload["prompt"] + text
        return out
    messages = list(payload["messages"])
    last = messages[-1] if messages else {}
    if payload.get("continue_final_message") is True and last.get("role") == "assistant":
        messages[-1] = {**last, "content": (last.get("content") or "") + text}
    else:
        messages.append({"role": "assistant", "content": text})
    out["messages"] = messages
    out["continue_final_message"] = True
    out["add_generation_prompt"] = False
    return out


def resumed_transform(
    st: StreamState,
    endpoint: str,
    ident: bytes | None,
    created: int | None,
    prompt: int | None,
    emitted: int,
) -> Any:
    """How the resumed engine stream's frames become the rest of the client's stream: the
    first stream's id and created time, no second role chunk, and usage that counts the
    original prompt and every token the client got (the continued text the engine read
    again is not the tenant's prompt)."""
    cached = st.outcome.cached_tokens
    state = {"role_dropped": endpoint != "chat" or not st.sent}

    def transform(frame: bytes, st: StreamState) -> bytes | None:
        if not frame.startswith(b"data:"):
            return transform_frame(frame, st)
        data = frame[5:].lstrip()
        if not data.startswith(b"{") or data.startswith(b'{"error"'):
            return transform_frame(frame, st)
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return transform_frame(frame, st)
        choices = obj.get("choices")
        if not state["role_dropped"] and choices:
            delta = choices[0].get("delta") or {}
            if "role" in delta and not delta.get("content"):
                state["role_dropped"] = True
                return None
        if ident is not None and "id" in obj:
            obj["id"] = ident.decode()
        if created is not None and "created" in obj:
            obj["created"] = created
        usage = obj.get("usage")
        if isinstance(usage, dict):
            p = prompt if prompt is not None else int(usage.get("prompt_tokens") or 0)
            c = int(usage.get("completion_tokens") or 0) + emitted
            usage["prompt_tokens"] = p
            usage["total_tokens"] = p + c
            usage["completion_tokens"] = c
            if prompt is not None and isinstance(usage.get("prompt_tokens_details"), dict):
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            del obj["usage"]
            obj["usage"] = usage  # usage stays the last member (relay's fast path)
        return transform_frame(b"data: " + orjson.dumps(obj), st)

    return transform
