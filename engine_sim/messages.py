"""/v1/messages and /v1/messages/count_tokens: the Anthropic Messages API as vLLM serves it.

vLLM turns the request into a chat completion (the system prompt and system-role messages
become one system message, `tool_use` blocks assistant tool calls, `tool_result` blocks tool
messages, `thinking` blocks reasoning) and converts the chat answer back. So:
- input tokens are the chat template's prompt tokens (what /tokenize counts for the converted
  messages, and what count_tokens answers);
- the id is the chat completion's (`chatcmpl-…`), stop reasons map stop→end_turn,
  length→max_tokens, tool_calls→tool_use, and a stop sequence is reported as end_turn;
- a stream is the chat stream (with include_usage and continuous_usage_stats forced on)
  re-framed: `message_start` when the first chat chunk arrives (after prefill) with the
  running usage's input_tokens, `content_block_*` per block, `message_delta` with the stop
  reason and usage from the final usage chunk, `message_stop` for `[DONE]`; no `ping`.
  On an engine that ignores those stream options `message_start` says 0 input tokens, or no
  `message_delta` comes at all;
- errors are `{"type":"error","error":{"type","message"}}` with vLLM's error type names
  (NotFoundError, BadRequestError, internal_error, ...), except body validation errors,
  which vLLM's validation handler answers in the OpenAI shape on every path.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

from engine_sim import replies, tokenizer
from engine_sim.cli import Config
from engine_sim.engine import Engine, Sequence
from engine_sim.errors import ApiError, bad_request, context_error, missing_field
from engine_sim.generation import Generator, _dumps
from engine_sim.http import Connection, Request

SSE = "text/event-stream; charset=utf-8"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_of(reply: replies.Reply) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) as vLLM's _to_anthropic_stop_reason maps them: a matched
    stop string is a stop_sequence, unless max_tokens or a tool call ended the reply."""
    if reply.finish_reason == "stop" and isinstance(reply.stop_reason, str):
        return "stop_sequence", reply.stop_reason
    return STOP_REASONS[reply.finish_reason], None


BLOCK_TYPES = (
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
)
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "ctx": "user", "msg": "user"}
# Claude Code's per-request attribution header: vLLM drops it so it does not defeat prefix caching.
BILLING_HEADER = "x-anthropic-billing-header"


class AnthropicError(ApiError):
    """An error rendered in Anthropic's shape, keeping vLLM's error type name."""

    def body(self) -> dict:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def anthropic(err: ApiError) -> ApiError:
    """vLLM's translate_error_response; body validation errors keep the OpenAI shape."""
    if err.type == "Bad Request" or isinstance(err, AnthropicError):
        return err
    return AnthropicError(err.status, err.message, err.type, err.param)


# --- validation ---------------------------------------------------------------------------------


def _check_blocks(blocks: object, where: str) -> None:
    if isinstance(blocks, str):
        return
    if not isinstance(blocks, list) or not all(
        isinstance(b, dict) and b.get("type") in BLOCK_TYPES for b in blocks
    ):
        raise bad_request(
            f"{where}: Input should be a string or a list of content blocks "
            f"of type {', '.join(BLOCK_TYPES)}",
            where,
        )


def check(body: dict, create: bool) -> None:
    """The pydantic validation of vLLM's AnthropicMessagesRequest / CountTokensRequest."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad_request("model: Field required", "model")
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise bad_request("messages: Field required", "messages")
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad_request(
                "messages: every message needs a role of user, assistant or system", "messages"
            )
        _check_blocks(m.get("content"), "messages.content")
    if body.get("system") is not None:
        _check_blocks(body["system"], "system")
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list)
        or not all(
            isinstance(t, dict)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("input_schema"), dict)
            for t in tools
        )
    ):
        raise bad_request("tools: every tool needs a name and an input_schema object", "tools")
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in (
            "auto",
            "any",
            "tool",
            "none",
        ):
            raise bad_request(
                "tool_choice: Input should be an object of type auto, any, tool or none",
                "tool_choice",
            )
        if choice["type"] == "tool" and not choice.get("name"):
            raise bad_request("tool_choice.name is required when type is 'tool'", "tool_choice")
    if not create:
        return
    mt = body.get("max_tokens")
    if mt is None:
        raise missing_field("max_tokens", body)
    if not isinstance(mt, int) or isinstance(mt, bool):
        raise bad_request("max_tokens: Field required (an integer)", "max_tokens")
    if mt <= 0:
        raise bad_request("max_tokens must be positive", "max_tokens")
    stops = body.get("stop_sequences")
    if stops is not None and (
        not isinstance(stops, list) or not all(isinstance(x, str) for x in stops)
    ):
        raise bad_request(
            "stop_sequences: Input should be a valid list of strings", "stop_sequences"
        )
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise bad_request("stream: Input should be a valid boolean", "stream")


# --- the request as a chat completion (vLLM's _convert_anthropic_to_openai_request) --------------


def _system(body: dict) -> str:
    parts: list[str] = []
    blocks = [body.get("system")] + [
        m.get("content") for m in body["messages"] if m["role"] == "system"
    ]
    for content in blocks:
        if isinstance(content, str):
            parts.append(content)
            continue
        for b in content or []:
            text = b.get("text")
            if b.get("type") == "text" and text and not text.startswith(BILLING_HEADER):
                parts.append(text)
    return "".join(parts)


def _tool_result_text(content: object) -> str:
    if isinstance(content, list):
        return "\n".join(
            i.get("text", "") for i in content if isinstance(i, dict) and i.get("type") == "text"
        )
    return content if isinstance(content, str) else ""


def _convert_blocks(role: str, blocks: list[dict], msg: dict, out: list[dict]) -> None:
    parts: list[dict] = []
    calls: list[dict] = []
    reasoning: list[str] = []
    for b in blocks:
        kind = b["type"]
        if kind == "text" and b.get("text"):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and b.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": "image"}})
        elif kind == "thinking" and b.get("thinking") is not None:
            reasoning.append(b["thinking"])
        elif kind == "tool_use":
            calls.append(
                {
                    "id": b.get("id") or f"call_{int(time.time())}",
                    "type": "function",
                    "function": {
                        "name": b.get("name") or "",
                        "arguments": json.dumps(b.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            # Tool results become tool messages ahead of what is left of the user message.
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": b.get("tool_use_id") or "",
                    "content": _tool_result_text(b.get("content")),
                }
            )
        elif kind == "tool_result":
            content = b.get("content")
            parts.append(
                {"type": "text", "text": f"Tool result: {str(content) if content else ''}"}
            )
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if parts:
        msg["content"] = (
            parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
        )


def chat_messages(body: dict) -> list[dict]:
    """The chat messages vLLM builds from an Anthropic request."""
    out: list[dict] = []
    system = _system(body)
    if system:
        out.append({"role": "system", "content": system})
    for m in body["messages"]:
        if m["role"] == "system":
            continue
        msg: dict = {"role": m["role"]}
        if isinstance(m.get("content"), str):
            msg["content"] = m["content"]
        else:
            _convert_blocks(m["role"], m.get("content") or [], msg, out)
        if not (m["role"] == "user" and "content" not in msg):
            out.append(msg)
    return out


def chat_tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description"),
                "parameters": {"type": "object", **t["input_schema"]},
            },
        }
        for t in tools
    ]


def chat_tool_choice(body: dict) -> object:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if body.get("tools") else None
    kind = choice["type"]
    if kind == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"any": "required"}.get(kind, kind)


def normalize(body: dict) -> dict:
    """Claude-Code-style roles `ctx` / `msg` count as `user`, as in vLLM."""
    return {**body, "messages": [{**m, "role": ROLES[m["role"]]} for m in body["messages"]]}


# --- streaming -------------------------------------------------------------------------------


def _event(kind: str, payload: dict) -> bytes:
    return b"event: %b\ndata: %b\n\n" % (kind.encode(), _dumps({"type": kind, **payload}).encode())


class Blocks:
    """Content blocks of a streamed message: a new block starts when the kind of token changes
    (thinking, text, tool_use), the open one stops first (a thinking block with its signature)."""

    def __init__(self) -> None:
        self.index = 0  # index of the next block
        self.open: str | None = None
        self.signature = ""

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(
                _event(
                    "content_block_delta",
                    {
                        "delta": {"type": "signature_delta", "signature": self.signature},
                        "index": self.index,
                    },
                )
            )
        out.append(_event("content_block_stop", {"index": self.index}))
        self.open = None
        self.index += 1
        return out

    def start(self, block: dict) -> list[bytes]:
        out = self.stop()
        self.open = block["type"]
        if self.open == "thinking":
            self.signature = uuid.uuid4().hex
        return out + [_event("content_block_start", {"content_block": block, "index": self.index})]

    def delta(self, delta: dict) -> bytes:
        return _event("content_block_delta", {"delta": delta, "index": self.index})


# --- the endpoints -----------------------------------------------------------------------------


class Messages:
    """POST /v1/messages and POST /v1/messages/count_tokens."""

    def __init__(
        self, cfg: Config, engine: Engine, gen: Generator, resolve_model: Callable[[dict], str]
    ) -> None:
        self.cfg, self.engine, self.gen, self.resolve_model = cfg, engine, gen, resolve_model

    async def create(self, req: Request, conn: Connection, body: dict, rid: str) -> None:
        check(body, create=True)
        try:
            await self._create(conn, normalize(body), rid)
        except ApiError as err:
            raise anthropic(err) from None

    async def count_tokens(self, req: Request, conn: Connection, body: dict, rid: str) -> None:
        check(body, create=False)
        body = normalize(body)
        try:
            self.resolve_model(body)
        except ApiError as err:
            raise anthropic(err) from None
        n = tokenizer.count(tokenizer.chat_prompt(chat_messages(body), chat_tools(body)))
        conn.send_json(200, {"input_tokens": n, "context_management": {"original_input_tokens": n}})

    def _chat_body(self, body: dict) -> dict:
        tools = chat_tools(body)
        choice = chat_tool_choice(body)
        if tools and choice == "auto" and not self.cfg.auto_tool_choice:
            raise context_error(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set"
            )
        return {
            "messages": chat_messages(body),
            "tools": tools,
            "tool_choice": choice,
            # vLLM's conversion sends it as max_completion_tokens (its errors name that).
            "max_completion_tokens": body["max_tokens"],
            "stop": body.get("stop_sequences"),
            "chat_template_kwargs": body.get("chat_template_kwargs"),
            "model": body.get("model"),
        }

    async def _create(self, conn: Connection, body: dict, rid: str) -> None:
        model = self.resolve_model(body)
        if self.engine.dead:
            raise AnthropicError(
                500,
                "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                "internal_error",
            )
        chat = self._chat_body(body)
        gen = self.gen
        prompt = gen._chat_prompt(chat)
        tool = gen._chat_tool(chat)
        ids = tokenizer.encode(prompt)
        reply = gen._plan(
            chat,
            prompt,
            len(ids),
            ("max_completion_tokens", "max_tokens"),
            gen._reasoning_tokens(chat),
            tool,
        )
        seq = Sequence(len(ids))
        seq.prompt_ids, seq.lora = ids, gen.lora_of(model)
        if body.get("stream"):
            await self._stream(conn, "chatcmpl-" + rid, model, seq, reply)
        else:
            await self._full(conn, "chatcmpl-" + rid, model, seq, reply)

    def _usage(self, seq: Sequence) -> dict:
        """vLLM's _build_anthropic_usage: with prompt token details on, tokens read from and
        written to the prefix cache are no longer part of input_tokens (Anthropic's meaning)."""
        if not self.cfg.prompt_tokens_details:
            return {"input_tokens": seq.prompt_tokens, "output_tokens": seq.generated}
        return {
            "input_tokens": max(0, seq.prompt_tokens - seq.cached_tokens - seq.created_tokens),
            "output_tokens": seq.generated,
            "cache_creation_input_tokens": seq.created_tokens,
            "cache_read_input_tokens": seq.cached_tokens,
        }

    async def _full(
        self, conn: Connection, mid: str, model: str, seq: Sequence, reply: replies.Reply
    ) -> None:
        try:
            await self.gen._admit_errors(self.gen.run(conn, seq, len(reply), None, None))
        except BaseException:
            self.gen._abort(seq)
            raise
        self.gen._finish(seq, reply.finish_reason)
        content: list[dict] = []
        if reply.reasoning:
            content.append(
                {
                    "type": "thinking",
                    "thinking": "".join(reply.reasoning),
                    "signature": uuid.uuid4().hex,
                }
            )
        text = "".join(reply.content)
        if text:
            content.append({"type": "text", "text": text})
        if reply.tool is not None:
            try:
                args = json.loads("".join(reply.tool.args))
            except ValueError as exc:  # arguments cut by max_tokens: vLLM fails the request
                raise AnthropicError(500, str(exc), "internal_error") from None
            content.append(
                {"type": "tool_use", "id": reply.tool.id, "name": reply.tool.name, "input": args}
            )
        stop_reason, stop_sequence = stop_of(reply)
        answer = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": model,
            "stop_reason": stop_reason,
        }
        if stop_sequence is not None:  # vLLM drops null fields from this answer
            answer["stop_sequence"] = stop_sequence
        conn.send_json(200, {**answer, "usage": self._usage(seq)})

    @staticmethod
    def _token_events(blocks: Blocks, tool: replies.ToolCall | None, kind: str, text: str) -> bytes:
        if kind == "reasoning":
            out = (
                []
                if blocks.open == "thinking"
                else blocks.start({"type": "thinking", "thinking": ""})
            )
            out.append(blocks.delta({"type": "thinking_delta", "thinking": text}))
        elif kind == "text":
            out = [] if blocks.open == "text" else blocks.start({"type": "text", "text": ""})
            out.append(blocks.delta({"type": "text_delta", "text": text}))
        elif kind == "tool":
            out = blocks.start({"type": "tool_use", "id": tool.id, "name": tool.name, "input": {}})
        else:
            out = [blocks.delta({"type": "input_json_delta", "partial_json": text})]
        return b"".join(out)

    async def _stream(
        self, conn: Connection, mid: str, model: str, seq: Sequence, reply: replies.Reply
    ) -> None:
        # vLLM asks its chat stream for usage on every chunk and at the end.
        include, continuous = self.gen.usage_opts(
            {"include_usage": True, "continuous_usage_stats": True}
        )
        tokens = [("reasoning", t) for t in reply.reasoning] + [("text", t) for t in reply.content]
        if reply.tool is not None:
            tokens += [("tool", reply.tool.name)] + [("args", a) for a in reply.tool.args]
        blocks = Blocks()

        def on_start() -> None:
            conn.start_stream(200, SSE)
            conn.write_chunk(
                _event(
                    "message_start",
                    {
                        "message": {
                            "id": mid,
                            "type": "message",
                            "role": "assistant",
                            "content": [],
                            "model": model,
                            "stop_reason": None,
                            "stop_sequence": None,
                            "usage": {
                                "input_tokens": seq.prompt_tokens if continuous else 0,
                                "output_tokens": 0,
                            },
                        }
                    },
                )
            )

        try:
            await self.gen._admit_errors(
                self.gen.run(
                    conn,
                    seq,
                    len(tokens),
                    on_start,
                    lambda i: self._token_events(blocks, reply.tool, *tokens[i]),
                )
            )
        except ApiError as err:
            self.gen._abort(seq)
            if not conn.started:
                raise
            # The chat stream's error frame is not a chunk vLLM's converter can read.
            conn.write_chunk(
                _event("error", {"error": {"type": "internal_error", "message": err.message}})
            )
            conn.end_stream()
            return
        except BaseException:
            self.gen._abort(seq)
            raise
        self.gen._finish(seq, reply.finish_reason)
        tail: list[bytes] = []
        if include:
            tail += blocks.stop()
            tail.append(
                _event(
                    "message_delta",
                    {
                        "delta": dict(
                            zip(("stop_reason", "stop_sequence"), stop_of(reply), strict=True)
                        ),
                        "usage": self._usage(seq),
                    },
                )
            )
        tail.append(_event("message_stop", {}))
        conn.write_chunk(b"".join(tail))
        conn.end_stream()
