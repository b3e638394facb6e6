"""OpenAI's Responses API on the gateway: ``POST /v1/responses`` and the kept responses.

A request is admitted, limited, queued and billed like chat (gateway/exchange.py); what is
particular to it lives here:

- ``prepare``: Tollgate keeps responses itself (gateway/response_store.py), so the engine
  never needs its own in-memory store: a ``previous_response_id`` is expanded here into the
  earlier turns' input and output items followed by the new input, and the engine is asked
  not to store (``store: false``) under an id the gateway chose (vLLM's ``request_id``).
  Any replica can therefore serve any turn.
- ``ResponseRelay``: through gateway/relay.py, the engine's typed events pass as they
  arrive; the usage comes from ``response.completed`` (input, cached, output tokens;
  reasoning tokens are output tokens), each ``*.delta`` event delivered is one token if the
  stream is cut before that. A kept response's write is sent to Redis before its final
  event goes out, so the client's next turn finds it on any node.
- ``serve_object``: ``GET``/``DELETE /v1/responses/{id}``, ``…/cancel``, ``…/input_items``.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import orjson
import redis.exceptions

from gateway.errors import error_body
from gateway.relay import StreamState, respond
from gateway.response_store import ResponseStore
from gateway.usage import RESPONSES, Outcome

log = logging.getLogger("tollgate.gateway")

PREFIX = "/v1/responses/"
ID_PREFIXES = {"function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}
# The events that end a response and carry it whole (with its usage).
FINAL_EVENTS = (b"response.completed", b"response.incomplete", b"response.failed")
# The events whose response object echoes previous_response_id.
ECHO_EVENTS = (b"response.created", b"response.in_progress", b"response.queued", *FINAL_EVENTS)
KEPT_STATUSES = ("completed", "incomplete")
NULL_PREVIOUS = b'"previous_response_id":null'


def not_found(response_id: str, param: str | None = None) -> bytes:
    # Identical for an id that never existed, a deleted one and another tenant's.
    label = "Previous response" if param else "Response"
    return error_body(f"{label} with id '{response_id}' not found.", param=param)


# --- Items -------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


def normalise_input(given: str | list[dict]) -> list[dict]:
    """The request's input as the items ``input_items`` lists: every item with an id, and
    messages with content parts (a string input is one user message)."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    items = []
    for item in given:
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if role == "assistant" else "input_text"
                content = [{"type": part, "text": content}]
            item = {
                "id": item.get("id") or new_id("msg_"),
                "type": "message",
                "role": role,
                "content": content,
                "status": item.get("status") or "completed",
            }
        elif not item.get("id"):
            item = {**item, "id": new_id(ID_PREFIXES.get(kind, "item_"))}
        items.append(item)
    return items


def engine_item(item: dict) -> dict:
    """A kept input item as an engine reads it: user, system and developer messages as plain
    chat messages (text parts joined), everything else as it was."""
    if item.get("type") != "message" or item.get("role") == "assistant":
        return item
    content = item.get("content")
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in ("input_text", "text") for p in content
    ):
        content = "".join(str(p.get("text", "")) for p in content)
    return {"role": item.get("role"), "content": content}


def conversation(records: list[dict]) -> list[dict]:
    """The earlier turns (oldest first) as input items: each one's input, then its output."""
    items: list[dict] = []
    for record in records:
        items += [engine_item(i) for i in record["input"]]
        items += record["response"].get("output") or []
    return items


# --- The prompt as the engine builds it (vLLM's construct_input_messages) -------------------


def _chat_message(item: dict) -> dict:
    kind = item.get("type")
    if kind == "function_call":
        call = {"name": item.get("name"), "arguments": item.get("arguments")}
        return {
            "role": "assistant",
            "tool_calls": [{"id": item.get("call_id"), "type": "function", "function": call}],
        }
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if kind == "reasoning":
        parts = item.get("summary") or item.get("content") or []
        one = len(parts) == 1 and isinstance(parts[0], dict)
        return {"role": "assistant", "reasoning": parts[0].get("text", "") if one else ""}
    if (
        kind == "message"
        and item.get("role") == "assistant"
        and item.get("id")
        and item.get("status")
    ):
        content = item.get("content") or [{}]
        return {"role": "assistant", "content": content[0].get("text", "")}
    return item


def chat_messages(engine_payload: dict) -> list[dict]:
    """The chat messages an engine makes of a Responses request (without
    previous_response_id, which the gateway has expanded): what its tokenizer counts."""
    messages = []
    if engine_payload.get("instructions"):
        messages.append({"role": "system", "content": engine_payload["instructions"]})
    given = engine_payload.get("input")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    return messages + [_chat_message(item) for item in given or []]


def chat_tools(engine_payload: dict) -> list[dict] | None:
    """The tools as the engine's chat template sees them (none with tool_choice "none")."""
    tools = engine_payload.get("tools")
    if not tools or engine_payload.get("tool_choice", "auto") == "none":
        return None
    return [{"type": "function", "function": t} for t in tools]


# --- Before forwarding -------------------------------------------------------------------------


@dataclass(slots=True)
class ResponsePlan:
    """What keeping one response needs, decided before it is forwarded."""

    response_id: str
    store: bool
    tenant_id: int
    api_key_id: int
    previous_response_id: str | None = None
    chain: list[str] = field(default_factory=list)  # earlier turns' ids, oldest first
    input_items: list[dict] = field(default_factory=list)

    def record(self, response: dict, raw: bytes | None = None) -> dict:
        """The kept record; ``raw``: the response as the engine's JSON (kept as it is, not
        serialised again)."""
        return {
            "id": self.response_id,
            "tenant_id": self.tenant_id,
            "api_key_id": self.api_key_id,
            "model": response.get("model"),
            "status": response.get("status"),
            "created_at": int(response.get("created_at") or time.time()),
            "previous_response_id": self.previous_response_id,
            "chain": self.chain,
            "input": self.input_items,
            "response": response if raw is None else orjson.Fragment(raw),
        }

    def echo(self, raw: bytes) -> bytes:
        """The engine's response object (or event) with the previous_response_id the client
        sent (the engine saw the expanded conversation instead)."""
        if self.previous_response_id is None:
            return raw
        quoted = orjson.dumps(self.previous_response_id)
        return raw.replace(NULL_PREVIOUS, b'"previous_response_id":' + quoted, 1)


def check(payload: dict) -> tuple[int, bytes] | None:
    """The Responses fields the gateway relies on (the engine checks the rest)."""
    given = payload.get("input")
    if given is None:
        return 400, error_body("Missing required parameter: 'input'.", param="input")
    if not isinstance(given, str) and not (
        isinstance(given, list) and all(isinstance(i, dict) for i in given)
    ):
        return 400, error_body(
            "input must be a string or a list of input items (objects).", param="input"
        )
    for name in ("stream", "store", "background"):
        if payload.get(name) is not None and not isinstance(payload[name], bool):
            return 400, error_body(f"{name} must be a boolean.", param=name)
    previous = payload.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        return 400, error_body(
            "previous_response_id must be a response id.", param="previous_response_id"
        )
    if payload.get("background"):
        return 400, error_body(
            "background=true is not supported by this server: its engines (vLLM) cannot run "
            "responses in the background for a gateway. Send the request without "
            "`background` (streaming if you want to see progress).",
            param="background",
        )
    return None


async def prepare(
    store: ResponseStore, payload: dict, tenant_id: int, api_key_id: int
) -> tuple[dict, ResponsePlan] | tuple[int, bytes]:
    """The engine's request and the plan for keeping its answer, or (status, error)."""
    problem = check(payload)
    if problem:
        return problem
    keep = payload.get("store") is not False
    previous = payload.get("previous_response_id")
    plan = ResponsePlan(new_id("resp_"), keep, tenant_id, api_key_id, previous)
    given = payload["input"]
    engine = dict(payload)
    if previous is not None:
        earlier = await store.get_chained(tenant_id, previous)
        if earlier is None:
            return 404, not_found(previous, "previous_response_id")
        plan.chain = [*earlier["chain"], previous]
        found = await store.get_many(tenant_id, earlier["chain"])
        # A deleted earlier turn takes its items with it; the rest of the chain stands.
        records = [found[i] for i in earlier["chain"] if i in found] + [earlier]
        new = normalise_input(given)
        engine["input"] = conversation(records) + [engine_item(i) for i in new]
        del engine["previous_response_id"]
        if keep:
            plan.input_items = new
    elif keep:
        plan.input_items = normalise_input(given)
    engine["store"] = False  # Tollgate keeps it; the engine's store is one process's memory
    engine["request_id"] = plan.response_id  # vLLM answers under this id
    return engine, plan


# --- Relaying the answer -----------------------------------------------------------------------


async def keep(
    store: ResponseStore, plan: ResponsePlan, response: dict, raw: bytes | None = None
) -> None:
    """Send a finished response's write to Redis (before the answer goes out)."""
    if not plan.store or response.get("status") not in KEPT_STATUSES:
        return
    try:
        await store.start_put(plan.record(response, raw))
    except (redis.exceptions.RedisError, OSError, TimeoutError):
        # The answer was produced and is billed: deliver it; only chaining from it will fail.
        log.error("could not keep response %s: Redis unreachable", plan.response_id)


def error_event(message: str, sequence_number: int) -> bytes:
    """OpenAI's ``error`` event, for a stream the gateway has to end."""
    data = orjson.dumps(
        {
            "type": "error",
            "code": "server_error",
            "message": message,
            "param": None,
            "sequence_number": sequence_number,
        }
    )
    return b"event: error\ndata: " + data + b"\n\n"


def event_kind(frame: bytes) -> tuple[bytes, int]:
    """(event type, where its data starts) of one SSE frame; the data is sliced only where
    it is read (a few events a stream), not for every token's delta."""
    if frame.startswith(b"event:"):
        nl = frame.find(b"\n")
        if nl < 0:
            return frame[6:].strip(), len(frame)
        at = nl + 1
        if frame.startswith(b"data:", at):
            at += 5
        return frame[6:nl].strip(), at
    if frame.startswith(b"data:"):
        try:
            kind = orjson.loads(frame[5:]).get("type", "")
        except (orjson.JSONDecodeError, AttributeError):
            kind = ""
        return str(kind).encode(), 5
    return b"", len(frame)


@dataclass(slots=True)
class ResponseRelay:
    """A Responses answer through gateway/relay.py (the relay Chat and Messages use): the
    typed events pass as they arrive, the previous_response_id is echoed, and a kept
    response's write is sent before its final event (or the whole answer) goes out."""

    plan: ResponsePlan
    store: ResponseStore
    frames: int = 0  # events passed on (the next sequence_number)
    final: dict | None = None  # the final event's response object, not yet kept
    finished: bool = False

    async def answer(self, outcome: Outcome, raw: bytes) -> bytes:
        """A whole (non-streaming) answer: its usage read, kept, the previous id echoed."""
        raw = self.plan.echo(raw)
        try:
            response = orjson.loads(raw)
        except orjson.JSONDecodeError:
            response = None
        if isinstance(response, dict):
            if isinstance(response.get("usage"), dict):
                outcome.completion_tokens = RESPONSES.read(response["usage"], outcome) or 0
            await keep(self.store, self.plan, response, raw)
        return raw

    def attach(self, st: StreamState) -> None:
        """Relay this stream's events; should the gateway itself fail mid-stream, it ends
        with this dialect's error event (gateway/exchange.py sends st.failure())."""
        st.transform = self.transform
        st.error_frames = self.error_frames
        st.unfinished = self.unfinished

    def transform(self, frame: bytes, st: StreamState) -> bytes:
        """One typed event as the client sees it (the same bytes, but for the echoed
        previous_response_id), noting the tokens it delivers."""
        kind, at = event_kind(frame)
        outcome = st.outcome
        if kind.endswith(b".delta"):
            if outcome.ttft_ms is None:
                outcome.ttft_ms = st.elapsed_ms()
            st.content_frames += 1
        elif kind in ECHO_EVENTS:
            frame = self.plan.echo(frame)
            if kind in FINAL_EVENTS:
                self.finished = True
                self._final(frame[at:], st)
                if kind == b"response.failed":
                    outcome.status = "error"
        elif kind == b"error":
            outcome.status = "error"
        self.frames += 1
        return frame + b"\n\n"

    def _final(self, data: bytes, st: StreamState) -> None:
        try:
            response = orjson.loads(data).get("response")
        except (orjson.JSONDecodeError, AttributeError):
            return
        if isinstance(response, dict):
            self.final = response
            st.before_send = self.keep_final  # sent to Redis before this event goes out
            if isinstance(response.get("usage"), dict):
                st.saw_usage = True
                output = RESPONSES.read(response["usage"], st.outcome) or 0
                st.outcome.completion_tokens = st.pending_completion = output

    async def keep_final(self) -> None:
        final, self.final = self.final, None
        if final is not None:
            await keep(self.store, self.plan, final)

    def unfinished(self) -> str | None:
        if self.finished:
            return None
        return "The engine ended the stream before the response was complete."

    def error_frames(self, message: str) -> bytes:
        return error_event(message, self.frames)


# --- Kept responses: GET / DELETE /v1/responses/{id}, …/cancel, …/input_items -------------------


def route(path: str, method: str) -> tuple[str, str] | tuple[None, int]:
    """(action, response id) for a path under /v1/responses/, or (None, 404 or 405)."""
    rest = path[len(PREFIX) :]
    response_id, _, tail = rest.partition("/")
    if not response_id or "/" in tail:
        return None, 404
    allowed = {"": ("GET", "DELETE"), "cancel": ("POST",), "input_items": ("GET",)}.get(tail)
    if allowed is None:
        return None, 404
    if method not in allowed:
        return None, 405
    return f"{method.lower()}_{tail}" if tail else method.lower(), response_id


async def serve_object(
    store: ResponseStore, send: Any, action: str, response_id: str, tenant_id: int, query: bytes
) -> None:
    record = await store.get(tenant_id, response_id)
    if record is None:
        return await respond(send, 404, not_found(response_id))
    if action == "get":
        if parse_qs(query.decode("latin-1")).get("stream", ["false"])[-1].lower() == "true":
            return await respond(
                send,
                400,
                error_body(
                    "stream=true is only available for responses created with background=true.",
                    param="stream",
                ),
            )
        return await respond(send, 200, orjson.dumps(record["response"]))
    if action == "delete":
        await store.delete(tenant_id, response_id)
        return await respond(
            send, 200, orjson.dumps({"id": response_id, "object": "response", "deleted": True})
        )
    if action == "post_cancel":
        return await respond(
            send,
            400,
            error_body(
                "Only responses created with background=true can be cancelled; "
                f"'{response_id}' was not.",
                param="response_id",
            ),
        )
    status, body = input_items(record["input"], query)
    await respond(send, status, body)


def input_items(items: list[dict], query: bytes) -> tuple[int, bytes]:
    """One page of a response's input items (OpenAI's cursor list: ``after``, ``limit`` 1-100,
    default 20, ``order`` ``desc`` by default)."""
    params = parse_qs(query.decode("latin-1"))
    order = params.get("order", ["desc"])[-1]
    if order not in ("asc", "desc"):
        return 400, error_body("order must be 'asc' or 'desc'.", param="order")
    try:
        limit = int(params.get("limit", ["20"])[-1])
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        return 400, error_body("limit must be a whole number from 1 to 100.", param="limit")
    ordered = items if order == "asc" else items[::-1]
    after = params.get("after", [None])[-1]
    if after is not None:
        at = next((n for n, item in enumerate(ordered) if item.get("id") == after), None)
        if at is None:
            return 400, error_body(f"No input item with id '{after}'.", param="after")
        ordered = ordered[at + 1 :]
    page = ordered[:limit]
    return 200, orjson.dumps(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(ordered) > limit,
        }
    )
