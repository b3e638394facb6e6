"""/v1/responses as vLLM serves it (OpenAI's Responses API on a non-harmony model).

What vLLM does, and so what this does:
- The request becomes chat messages (`instructions` as a system message, then the stored
  conversation of `previous_response_id`, then `input`, whose `function_call` /
  `function_call_output` items become assistant tool calls and tool messages) and goes through
  the same chat template as /v1/chat/completions: its prompt tokens are what /tokenize counts
  for those messages and tools.
- A stream starts with `response.created` and `response.in_progress` at once (before prefill),
  then one typed event per generated token, the `*.done` events of each output item, and
  `response.completed` with the whole response and its usage. Frames carry `event:` lines and
  a `sequence_number`; there is no `[DONE]`.
- Responses are kept (and `previous_response_id`, `GET /v1/responses/{id}`, `.../cancel` and
  `background` work) only when the server runs with `VLLM_ENABLE_RESPONSES_API_STORE=1`, and
  only in this process's memory. Without it `store: true` is silently ignored and every id is
  unknown (404). vLLM serves no DELETE and no `/input_items`.
- The ids of the items streamed are not those of `response.completed`'s output (vLLM builds
  the final response again from the whole text): streamed items have bare uuids and a
  `call_<uuid>` call id, the final ones `msg_` / `rs_` / `fc_` ids and the tool parser's
  `chatcmpl-tool-` call id.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from urllib.parse import parse_qs

from engine_sim import replies, tokenizer
from engine_sim.cli import Config
from engine_sim.engine import Engine, Sequence
from engine_sim.errors import ApiError, bad_request, prompt_too_long, validation_error
from engine_sim.generation import Generator, _dumps, priority_of
from engine_sim.http import Connection, Request

SSE = "text/event-stream; charset=utf-8"
IN_FLIGHT = ("queued", "in_progress")


def not_found(response_id: str) -> ApiError:
    return ApiError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id"
    )


def _uid() -> str:
    return uuid.uuid4().hex  # vLLM's random_uuid()


# --- the request as chat messages (vLLM's construct_input_messages) ------------------------


def _item_message(item: dict) -> dict:
    """One input item as a chat message; plain messages pass through as they are."""
    kind = item.get("type")
    if kind == "function_call":
        return {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                }
            ],
        }
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if kind == "reasoning":
        parts = item.get("summary") or item.get("content") or []
        text = parts[0].get("text", "") if len(parts) == 1 and isinstance(parts[0], dict) else ""
        return {"role": "assistant", "reasoning": text}
    if (
        kind == "message"
        and item.get("role") == "assistant"
        and item.get("id")
        and item.get("status")
    ):
        content = item.get("content") or [{}]
        return {"role": "assistant", "content": content[0].get("text", "")}
    return item


def input_messages(
    body: dict, prev_messages: list[dict] | None, prev_output: list[dict] | None
) -> list[dict]:
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    messages += prev_messages or []
    for item in prev_output or []:
        # Only the text of earlier messages is carried; reasoning and function calls are not.
        if item.get("type") == "message":
            messages += [
                {"role": "assistant", "content": part.get("text", "")} for part in item["content"]
            ]
    inp = body["input"]
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    else:
        messages += [_item_message(item) for item in inp]
    return messages


def chat_tools(body: dict) -> list[dict] | None:
    """The tools as the chat template sees them (none at all with tool_choice "none")."""
    tools = body.get("tools") or []
    if body.get("tool_choice", "auto") == "none":
        return None
    return [{"type": "function", "function": t} for t in tools]


def _echo_tool_choice(body: dict) -> object:
    """vLLM's check_tool_usage: without tools, "auto" becomes "none"."""
    choice = body.get("tool_choice", "auto")
    return "none" if not body.get("tools") and choice == "auto" else choice


def _check(body: dict) -> None:
    """vLLM's request validation for the fields the simulator reads."""
    inp = body.get("input")
    if isinstance(inp, list):
        if not all(isinstance(i, dict) for i in inp):
            raise bad_request("input: Input should be a valid list of input items", "input")
    elif not isinstance(inp, str):
        raise bad_request("input: Field required (a string or a list of input items)", "input")
    for name in ("stream", "store", "background"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"{name}: Input should be a valid boolean", name)
    for name in ("instructions", "previous_response_id"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad_request(f"{name}: Input should be a valid string", name)
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list)
        or not all(
            isinstance(t, dict) and (t.get("type") != "function" or isinstance(t.get("name"), str))
            for t in tools
        )
    ):
        raise bad_request(
            "tools: Input should be a valid list of tools (function tools need a name)", "tools"
        )
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", "required") and not isinstance(choice, dict):
        raise bad_request(
            "tool_choice: Input should be 'none', 'auto', 'required' or a tool", "tool_choice"
        )
    if not body.get("tools") and choice == "required":
        raise validation_error(
            "Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice"
        )
    if not body.get("tools") and isinstance(choice, dict) and choice.get("type") == "function":
        raise validation_error(
            "Tool choice 'function' not found in 'tools' parameter.", "tool_choice"
        )
    if body.get("background") and body.get("store") is False:
        raise bad_request("background can only be used when `store` is true", "background")
    if body.get("prompt") is not None:
        raise bad_request("prompt template is not supported", "prompt")
    mot = body.get("max_output_tokens")
    if mot is not None and (not isinstance(mot, int) or isinstance(mot, bool)):
        raise bad_request("max_output_tokens: Input should be a valid integer", "max_output_tokens")


def _echo_tool(tool: dict) -> dict:
    if tool.get("type") != "function":
        return tool
    return {
        "name": tool["name"],
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
        "type": "function",
        "description": tool.get("description"),
    }


# --- one request ---------------------------------------------------------------------------


class Turn:
    """One /v1/responses request: its prompt, its token plan and how to render it."""

    def __init__(
        self, cfg: Config, gen: Generator, body: dict, model: str, messages: list[dict]
    ) -> None:
        self.cfg, self.body, self.model, self.messages = cfg, body, model, messages
        rid = body.get("request_id")
        self.id = rid if isinstance(rid, str) and rid else "resp_" + _uid()
        self.created = int(time.time())
        prompt = tokenizer.chat_prompt(messages, chat_tools(body))
        ids = tokenizer.encode(prompt)
        limit = cfg.max_model_len
        if len(ids) >= limit:
            raise prompt_too_long(limit, len(ids))
        mot = body.get("max_output_tokens")
        if mot is not None and mot < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {mot}.", "BadRequestError")
        # No error for a budget beyond the context, unlike chat: it is cut to what is left.
        self.max_tokens = min(mot, limit - len(ids)) if mot else limit - len(ids)
        self.reply = gen._plan(
            {"max_tokens": self.max_tokens, "model": body.get("model")},
            prompt,
            len(ids),
            ("max_tokens",),
            gen._reasoning_tokens({}),
            self._tool(),
        )
        self.seq = Sequence(len(ids), priority_of(cfg, body))
        self.seq.prompt_ids, self.seq.lora = ids, gen.lora_of(body.get("model"))

    def _tool(self) -> dict | None:
        choice = self.body.get("tool_choice", "auto")
        tools = [t for t in self.body.get("tools") or [] if t.get("type") == "function"]
        if isinstance(choice, dict):
            if choice.get("type") != "function":
                return None
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        elif choice == "auto" and not self.cfg.auto_tool_choice:
            return None  # vLLM parses no tool calls then: the model answers in text
        return replies.pick_tool(
            [{"type": "function", "function": t} for t in tools], choice, self.messages
        )

    @property
    def status(self) -> str:
        return "incomplete" if self.reply.finish_reason == "length" else "completed"

    def usage(self) -> dict:
        seq = self.seq
        return {
            "input_tokens": seq.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": seq.cached_tokens,
                "cache_write_tokens": seq.created_tokens,
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": seq.generated,
            "output_tokens_details": {
                "reasoning_tokens": min(len(self.reply.reasoning), seq.generated),
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": seq.prompt_tokens + seq.generated,
        }

    def output(self) -> list[dict]:
        """The output items of the finished response (vLLM's _make_response_output_items)."""
        r = self.reply
        out: list[dict] = []
        if r.reasoning:
            out.append(
                {
                    "id": "rs_" + _uid(),
                    "summary": [],
                    "type": "reasoning",
                    "content": [{"text": "".join(r.reasoning), "type": "reasoning_text"}],
                    "encrypted_content": None,
                    "status": None,
                }
            )
        text = "".join(r.content)
        if text:
            out.append(
                {
                    "id": "msg_" + _uid(),
                    "content": [
                        {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
                    ],
                    "role": "assistant",
                    "status": "completed",
                    "type": "message",
                    "phase": None,
                }
            )
        if r.tool is not None:
            out.append(
                {
                    "arguments": "".join(r.tool.args),
                    "call_id": r.tool.id,
                    "name": r.tool.name,
                    "type": "function_call",
                    "id": "fc_" + _uid(),
                    "status": "completed",
                }
            )
        return out

    def response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        """The Response object, every field vLLM's ResponsesResponse dumps."""
        b = self.body
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": b.get("instructions"),
            "metadata": b.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True) is not False,
            "temperature": b.get("temperature") if b.get("temperature") is not None else 1.0,
            "tool_choice": _echo_tool_choice(b),
            "tools": [_echo_tool(t) for t in b.get("tools") or []],
            "top_p": b.get("top_p") if b.get("top_p") is not None else 1.0,
            "background": bool(b.get("background")),
            "max_output_tokens": self.max_tokens,
            "max_tool_calls": b.get("max_tool_calls"),
            "previous_response_id": b.get("previous_response_id"),
            "prompt": None,
            "reasoning": b.get("reasoning"),
            "service_tier": b.get("service_tier") or "auto",
            "status": status,
            "text": b.get("text"),
            "top_logprobs": None,
            "truncation": b.get("truncation") or "disabled",
            "usage": usage,
            "user": b.get("user"),
            "presence_penalty": float(b.get("presence_penalty") or 0.0),
            "frequency_penalty": float(b.get("frequency_penalty") or 0.0),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def final(self) -> dict:
        return self.response(self.status, self.output(), self.usage())


# --- streaming -------------------------------------------------------------------------------


class StreamEvents:
    """The typed events of one streamed response, in vLLM's order for a non-harmony model:
    (reasoning item)? (message item)? (function_call item)?, each opened on its first token
    and closed with its `.done` events when the next one starts or the reply ends."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.n = 0  # sequence_number of the next event
        self.index = 0  # output_index of the open item
        self.kind: str | None = None  # "reasoning", "text" or "tool": the open item
        self.item_id = ""
        self.call_id = ""
        self.text: list[str] = []
        r = turn.reply
        self.tokens: list[tuple[str, str]] = [("reasoning", t) for t in r.reasoning] + [
            ("text", t) for t in r.content
        ]
        if r.tool is not None:
            self.tokens += [("tool", r.tool.name)] + [("args", a) for a in r.tool.args]

    def _frame(self, kind: str, payload: dict) -> bytes:
        payload["sequence_number"] = self.n
        payload["type"] = kind
        self.n += 1
        return b"event: %b\ndata: %b\n\n" % (kind.encode(), _dumps(payload).encode())

    def start(self) -> list[bytes]:
        initial = self.turn.response("in_progress", [], None)
        return [
            self._frame("response.created", {"response": initial}),
            self._frame("response.in_progress", {"response": initial}),
        ]

    def token(self, i: int) -> list[bytes]:
        kind, text = self.tokens[i]
        out: list[bytes] = []
        if kind == "reasoning":
            if self.kind is None:
                out += self._open("reasoning")
            out.append(self._frame("response.reasoning_text.delta", self._at(delta=text)))
        elif kind == "text":
            if self.kind != "text":
                out += self._close() + self._open("text")
            out.append(self._frame("response.output_text.delta", self._at(delta=text, logprobs=[])))
        elif kind == "tool":
            return self._close() + self._open("tool")  # the name token: no arguments yet
        else:
            out.append(
                self._frame(
                    "response.function_call_arguments.delta",
                    {"delta": text, "item_id": self.item_id, "output_index": self.index},
                )
            )
        self.text.append(text)
        return out

    def _at(self, **fields: object) -> dict:
        return {"content_index": 0, **fields, "item_id": self.item_id, "output_index": self.index}

    def _open(self, kind: str) -> list[bytes]:
        self.kind, self.item_id, self.text = kind, _uid(), []
        if kind == "tool":
            self.call_id = "call_" + _uid()
            t = self.turn.reply.tool
            item = {
                "arguments": "",
                "call_id": self.call_id,
                "name": t.name,
                "type": "function_call",
                "id": self.item_id,
                "status": "in_progress",
            }
            return [
                self._frame(
                    "response.output_item.added", {"item": item, "output_index": self.index}
                )
            ]
        if kind == "reasoning":
            item = {
                "id": self.item_id,
                "summary": [],
                "type": "reasoning",
                "content": None,
                "encrypted_content": None,
                "status": "in_progress",
            }
            part = {"text": "", "type": "reasoning_text"}
        else:
            item = {
                "id": self.item_id,
                "content": [],
                "role": "assistant",
                "status": "in_progress",
                "type": "message",
                "phase": None,
            }
            part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        return [
            self._frame("response.output_item.added", {"item": item, "output_index": self.index}),
            self._frame("response.content_part.added", self._at(part=part)),
        ]

    def _close(self) -> list[bytes]:
        """The `.done` events of the open item; the next item gets the next output_index."""
        kind, text = self.kind, "".join(self.text)
        if kind is None:
            return []
        self.kind = None
        index = self.index
        self.index += 1
        if kind == "tool":
            t = self.turn.reply.tool
            item = {
                "arguments": text,
                "call_id": self.call_id,
                "name": t.name,
                "type": "function_call",
                "id": self.item_id,
                "status": "completed",
            }
            return [
                self._frame(
                    "response.function_call_arguments.done",
                    {
                        "arguments": text,
                        "item_id": self.item_id,
                        "name": t.name,
                        "output_index": index,
                    },
                ),
                self._frame("response.output_item.done", {"item": item, "output_index": index}),
            ]
        at = {"content_index": 0, "item_id": self.item_id, "output_index": index}
        if kind == "reasoning":
            part = {"text": text, "type": "reasoning_text"}
            item = {
                "id": self.item_id,
                "summary": [],
                "type": "reasoning",
                "content": [part],
                "encrypted_content": None,
                "status": "completed",
            }
            return [
                self._frame("response.reasoning_text.done", {**at, "text": text}),
                self._frame("response.content_part.done", {**at, "part": part}),
                self._frame("response.output_item.done", {"item": item, "output_index": index}),
            ]
        part = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
        item = {
            "id": self.item_id,
            "content": [part],
            "role": "assistant",
            "status": "completed",
            "type": "message",
            "phase": None,
        }
        return [
            self._frame("response.output_text.done", {**at, "logprobs": [], "text": text}),
            self._frame("response.content_part.done", {**at, "part": part}),
            self._frame("response.output_item.done", {"item": item, "output_index": index}),
        ]

    def finish(self, final: dict) -> list[bytes]:
        return self._close() + [self._frame("response.completed", {"response": final})]


class EventLog:
    """The events of a background stream, kept so clients can follow or replay them
    (`GET /v1/responses/{id}?stream=true&starting_after=N`)."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []  # frame i has sequence_number i
        self.done = False
        self._changed = asyncio.Event()

    def extend(self, frames: list[bytes]) -> None:
        self.frames += frames
        self._changed.set()

    def close(self) -> None:
        self.done = True
        self._changed.set()

    async def follow(self, conn: Connection, start: int) -> None:
        conn.start_stream(200, SSE)
        i = start
        while True:
            self._changed.clear()
            for frame in self.frames[i:]:
                conn.write_chunk(frame)
            i = max(i, len(self.frames))
            conn.flush()
            if self.done:
                conn.end_stream()
                return
            await self._changed.wait()


class NullSink:
    """Where a background request's decode loop 'writes': its output goes to an EventLog or
    to the stored response, not to a client connection."""

    _drain = None

    def write_chunk(self, data: bytes) -> None:
        pass

    def flush(self) -> None:
        pass

    async def drain(self) -> None:
        pass


# --- the endpoints -----------------------------------------------------------------------------


class Responses:
    """POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel."""

    def __init__(self, cfg: Config, engine: Engine, gen: Generator) -> None:
        self.cfg, self.engine, self.gen = cfg, engine, gen
        # Like vLLM's: process memory only, never evicted, gone with the process.
        self.store: dict[str, dict] = {}
        self.messages: dict[str, list[dict]] = {}
        self.logs: dict[str, EventLog] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    async def create(
        self, req: Request, conn: Connection, body: dict, model: str, rid: str
    ) -> None:
        _check(body)
        store = body.get("store", True) is not False and self.cfg.responses_store
        if body.get("background") and not store:
            raise ApiError(
                400,
                "This vLLM engine does not support `store=True` and therefore does not "
                "support the background mode. To enable these features, set the environment "
                "variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                "invalid_request_error",
                "background",
            )
        prev_id = body.get("previous_response_id")
        prev = None
        if prev_id is not None:
            prev = self.store.get(prev_id)
            if prev is None:
                raise not_found(prev_id)
        messages = input_messages(
            body, self.messages.get(prev_id) if prev else None, prev["output"] if prev else None
        )
        turn = Turn(self.cfg, self.gen, body, model, messages)
        if store:
            self.messages[turn.id] = messages
        if body.get("background"):
            await self._background(conn, turn)
        elif body.get("stream"):
            await self._stream(conn, turn, store)
        else:
            await self._full(conn, turn, store)

    def _keep(self, turn: Turn, response: dict) -> None:
        # A response cancelled meanwhile stays cancelled.
        if self.store.get(turn.id, {}).get("status") != "cancelled":
            self.store[turn.id] = response

    async def _generate(
        self, sink: object, turn: Turn, on_token: Callable[[int], bytes] | None
    ) -> None:
        try:
            await self.gen._admit_errors(
                self.gen.run(sink, turn.seq, len(turn.reply), None, on_token)
            )
        except BaseException:
            self.gen._abort(turn.seq)
            raise
        self.gen._finish(turn.seq, turn.reply.finish_reason)

    async def _full(self, conn: Connection, turn: Turn, store: bool) -> None:
        await self._generate(conn, turn, None)
        final = turn.final()
        if store:
            self._keep(turn, final)
        conn.send_json(200, final)

    async def _stream(self, conn: Connection, turn: Turn, store: bool) -> None:
        events = StreamEvents(turn)
        conn.start_stream(200, SSE)
        conn.write_chunk(b"".join(events.start()))
        conn.flush()
        try:
            await self._generate(conn, turn, lambda i: b"".join(events.token(i)))
        except ApiError:
            # vLLM has no error event here: the exception ends its SSE generator and the
            # connection drops mid-stream.
            conn.flush()
            conn.close()
            return
        final = turn.final()
        if store:
            self._keep(turn, final)
        conn.write_chunk(b"".join(events.finish(final)))
        conn.end_stream()

    async def _background(self, conn: Connection, turn: Turn) -> None:
        queued = turn.response("queued", [], None)
        self.store[turn.id] = queued
        log = EventLog() if turn.body.get("stream") else None
        if log is not None:
            self.logs[turn.id] = log
        task = asyncio.get_running_loop().create_task(self._run_background(turn, log))
        self.tasks[turn.id] = task
        task.add_done_callback(lambda _: self.tasks.pop(turn.id, None))
        if log is None:
            conn.send_json(200, queued)
        else:
            await log.follow(conn, 0)  # the client may go away; the request goes on

    async def _run_background(self, turn: Turn, log: EventLog | None) -> None:
        events = StreamEvents(turn)
        on_token = None
        if log is not None:
            log.extend(events.start())
            on_token = lambda i: log.extend(events.token(i)) or b""  # noqa: E731
        try:
            await self._generate(NullSink(), turn, on_token)
            final = turn.final()
            self._keep(turn, final)
            if log is not None:
                log.extend(events.finish(final))
        except ApiError:
            stored = self.store[turn.id]
            if stored["status"] not in ("completed", "cancelled"):
                stored["status"] = "failed"
        finally:
            if log is not None:
                log.close()

    async def retrieve(self, req: Request, conn: Connection, response_id: str) -> None:
        response = self.store.get(response_id)
        if response is None:
            raise not_found(response_id)
        query = parse_qs(req.query)
        if query.get("stream", ["false"])[-1].lower() not in ("true", "1", "yes", "on"):
            conn.send_json(200, response)
            return
        after = query.get("starting_after", [None])[-1]
        try:
            start = 0 if after is None else int(after) + 1
        except ValueError:
            raise bad_request(
                "starting_after: Input should be a valid integer", "starting_after"
            ) from None
        log = self.logs.get(response_id)
        if log is None:
            # Only background streams keep their events; vLLM raises on the first read of the
            # event stream, after the 200 head has gone out, so the connection just drops.
            conn.start_stream(200, SSE)
            conn.flush()
            conn.close()
            return
        await log.follow(conn, start)

    async def cancel(self, req: Request, conn: Connection, response_id: str) -> None:
        response = self.store.get(response_id)
        if response is None:
            raise not_found(response_id)
        if response["status"] not in IN_FLIGHT:
            raise ApiError(
                400, "Cannot cancel a synchronous response.", "invalid_request_error", "response_id"
            )
        response["status"] = "cancelled"
        task = self.tasks.get(response_id)
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        conn.send_json(200, response)
