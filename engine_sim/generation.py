"""/v1/chat/completions, /v1/completions and /v1/embeddings: request checks, the decode
loop, and vLLM's JSON and SSE shapes."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import time
from array import array
from collections.abc import Callable

from engine_sim import VLLM_VERSION, replies, tokenizer
from engine_sim.cli import Config
from engine_sim.engine import Engine, EngineDead, QueueFull, Sequence
from engine_sim.errors import (
    ApiError,
    bad_request,
    context_error,
    engine_dead,
    field_error,
    missing_field,
    prompt_too_long,
    queue_full,
    validation_error,
)
from engine_sim.http import Connection, Request
from engine_sim.lora import Adapter

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
DONE = b"data: [DONE]\n\n"


def _int_field(body: dict, name: str, minimum: int = 1) -> int | None:
    """An integer field as vLLM reads it: pydantic parses integer strings, then its own
    validator wants at least ``minimum``."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, str):
        try:
            v = int(v)
        except ValueError:
            msg = "Input should be a valid integer, unable to parse string as an integer"
            raise field_error(name, "int_parsing", msg, v) from None
    if not isinstance(v, int) or isinstance(v, bool):
        raise field_error(name, "int_type", "Input should be a valid integer", v)
    if v < minimum:
        raise validation_error(f"{name} must be at least {minimum}, got {v}.", name, v)
    return v


def priority_of(cfg: Config, body: dict) -> int:
    """The request's `priority` (lower runs earlier); non-zero needs the priority scheduler."""
    p = body.get("priority", 0)
    if p is None:
        return 0
    if not isinstance(p, int) or isinstance(p, bool):
        raise bad_request("priority: Input should be a valid integer", "priority")
    if p != 0 and cfg.scheduling_policy != "priority":
        raise context_error(f"Got priority {p} but Priority scheduling is not enabled.")
    return p


# Sampling parameters pydantic reads as floats: a string that is no number is a 400.
FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


def check_floats(body: dict) -> None:
    for name in FLOAT_FIELDS:
        v = body.get(name)
        if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)):
            continue
        if isinstance(v, str):
            try:
                float(v)
                continue
            except ValueError:
                msg = "Input should be a valid number, unable to parse string as a number"
                raise field_error(name, "float_parsing", msg, v) from None
        raise field_error(name, "float_type", "Input should be a valid number", v)


def check_common(body: dict) -> None:
    """Checks shared by chat and completions (vLLM's pydantic validators)."""
    check_floats(body)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad_request("stream: Input should be a valid boolean", "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request(
                "stream_options: Input should be a valid dictionary", "stream_options"
            )
        if not body.get("stream"):
            raise validation_error(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
    n = body.get("n", 1)
    if n not in (1, None):
        raise bad_request("n: the simulator generates one choice per request (n=1)", "n")


def stop_list(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise bad_request("stop: Input should be a valid string or list of strings", "stop")


def budget(cfg: Config, prompt_tokens: int, max_tokens: int | None, key: str = "max_tokens") -> int:
    """max_tokens (sent as ``key``) after vLLM's context checks: too long prompts fail, the
    rest is clamped."""
    limit = cfg.max_model_len
    if prompt_tokens >= limit:
        raise prompt_too_long(limit, prompt_tokens)
    if max_tokens is not None and max_tokens > limit:
        raise validation_error(
            f"{key}={max_tokens} cannot be greater than max_model_len={limit}. "
            "Please request fewer output tokens.",
            key,
            max_tokens,
        )
    room = limit - prompt_tokens
    return room if max_tokens is None else min(max_tokens, room)


def usage(cfg: Config, seq: Sequence, reasoning: int, stream: bool, chat: bool = True) -> dict:
    """The final usage object as vLLM 0.32 dumps it: the details' extra fields differ
    between chat and completions and between whole answers and a stream's usage chunk."""
    u: dict = {
        "prompt_tokens": seq.prompt_tokens,
        "total_tokens": seq.prompt_tokens + seq.generated,
        "completion_tokens": seq.generated,
    }
    if cfg.prompt_tokens_details:
        u["prompt_tokens_details"] = _prompt_details(seq, stream, chat)
    elif not stream:
        u["prompt_tokens_details"] = None
    if cfg.reasoning_details:
        u["completion_tokens_details"] = {"reasoning_tokens": min(reasoning, seq.generated)}
    elif not stream:
        u["completion_tokens_details"] = None
    return u


def _prompt_details(seq: Sequence, stream: bool, chat: bool) -> dict:
    d: dict = {"cached_tokens": seq.cached_tokens}
    if chat:
        d["created_cache_tokens"] = seq.created_tokens
    elif not stream:
        d["created_cache_tokens"] = None
    if not stream:
        d["multimodal_tokens"] = None
    return d


def running_usage(cfg: Config, prompt: int, k: int, chat: bool = True) -> bytes:
    """``,"usage":{…}`` of a chunk under continuous_usage_stats (k tokens so far); only
    chat's carries completion_tokens_details."""
    details = b"" if cfg.reasoning_details or not chat else b',"completion_tokens_details":null'
    return b',"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d%b}' % (
        prompt,
        prompt + k,
        k,
        details,
    )


# Fields vLLM 0.32 dumps as null on every answer (pydantic models without exclude_none).
CHAT_NULLS = dict.fromkeys(
    ("prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params")
    + ("ec_transfer_params", "metrics")
)
COMPLETION_NULLS = dict.fromkeys(("kv_transfer_params", "ec_transfer_params", "metrics"))


class Generator:
    """Runs generation requests against the engine and renders vLLM's responses."""

    def __init__(self, cfg: Config, engine: Engine, on_done: Callable[[], None]) -> None:
        self.cfg = cfg
        self.engine = engine
        self.on_done = on_done
        self.fingerprint = f"vllm-{VLLM_VERSION}-{tokenizer.seed_of(cfg.model):08x}"

    # --- the decode loop -----------------------------------------------------------------

    async def run(
        self,
        conn: Connection,
        seq: Sequence,
        n: int,
        on_start: Callable[[], None] | None,
        on_token: Callable[[int], bytes] | None,
    ) -> None:
        """Admit, prefill, then release `n` tokens at the engine's pace.

        `on_start` runs once prefill is done (when vLLM sends its first byte); `on_token(i)`
        returns the bytes to stream for token i. Raises EngineDead if the engine dies.
        """
        eng = self.engine
        await eng.admit(seq)
        seq.finish_reason = "abort"
        try:
            read = eng.activate_lora(seq)
            loop = asyncio.get_running_loop()
            delay = read + eng.prefill_delay(seq)
            if delay > 0:
                await asyncio.sleep(delay)
            eng.cache_prompt(seq)
            due = loop.time()
            pause_after = eng.pause_after if on_token is not None else ()
            for i in range(n):
                if i:
                    step = eng.token_delay()
                    if step:
                        due += step
                        wait = due - loop.time()
                        if wait > 0.0005:  # below timer resolution: let the deficit accrue
                            conn.flush()
                            await asyncio.sleep(wait)
                if eng.hung:
                    conn.flush()
                    await eng.pause_if_hung()
                if eng.held:
                    conn.flush()
                    await eng.wait_if_held()
                    due = loop.time()  # the pace starts at the release, no catching up
                if i in pause_after:
                    conn.flush()
                    await eng.wait_for_release(seq.release_mark)
                    due = loop.time()
                if eng.dead:
                    seq.finish_reason = "error"
                    raise EngineDead()
                if seq.preempted:
                    # Preempted (priority scheduling): the stream pauses, the sequence
                    # waits for a slot, then recomputes prompt + generated and goes on.
                    conn.flush()
                    try:
                        await eng.resume(seq)
                        read = eng.activate_lora(seq)
                    except EngineDead:
                        seq.finish_reason = "error"
                        raise
                    seq.finish_reason = "abort"
                    delay = read + eng.prefill_delay(seq)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    due = loop.time()
                    if eng.dead:
                        seq.finish_reason = "error"
                        raise EngineDead()
                if i == 0:
                    eng.on_first_token(seq)
                    if on_start is not None:
                        on_start()
                eng.on_token(seq)
                if on_token is not None:
                    seq.release_mark = eng.releases
                    conn.write_chunk(on_token(i))
                    if conn._drain is not None:
                        conn.flush()
                        await conn.drain()
            if n == 0:  # pooling: prefill only, no generated token
                eng.on_first_token(seq)
            seq.finish_reason = "done"
        finally:
            eng.release(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = "stop" if reason == "tool_calls" else reason
        self.engine.on_finish(seq)
        self.on_done()

    def _abort(self, seq: Sequence) -> None:
        if seq.finish_reason in ("abort", "error"):
            self.engine.on_finish(seq)

    async def _admit_errors(self, coro) -> None:
        try:
            await coro
        except QueueFull:
            raise queue_full(self.cfg.max_num_queued) from None
        except EngineDead:
            raise engine_dead() from None

    # --- chat ----------------------------------------------------------------------------

    def _chat_prompt(self, body: dict) -> str:
        msgs = body.get("messages")
        if msgs is None:
            raise missing_field("messages", body)
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise bad_request(
                "messages: Field required (a non-empty list of message objects)", "messages"
            )
        for m in msgs:
            if not isinstance(m.get("role"), str):
                raise bad_request("messages: every message needs a string 'role'", "messages")
            c = m.get("content")
            if c is not None and not isinstance(c, (str, list)):
                raise bad_request(
                    "messages: content must be a string or a list of parts", "messages"
                )
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise bad_request("tools: Input should be a valid list", "tools")
        add_generation = body.get("add_generation_prompt", True) is not False
        continue_final = body.get("continue_final_message") is True
        if add_generation and continue_final:
            raise bad_request(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        return tokenizer.chat_prompt(msgs, tools, add_generation, continue_final)

    def _chat_tool(self, body: dict) -> dict | None:
        tools = body.get("tools") or []
        if not tools:
            return None
        choice = body.get("tool_choice", "auto")
        if choice == "auto" and not self.cfg.auto_tool_choice:
            raise context_error(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set"
            )
        return replies.pick_tool(tools, choice, body.get("messages"))

    def _reasoning_tokens(self, body: dict) -> int:
        if not self.cfg.reasoning:
            return 0
        kwargs = body.get("chat_template_kwargs") or {}
        if kwargs.get("enable_thinking") is False:
            return 0
        return max(0, self.cfg.sim.sim_reasoning_tokens)

    def lora_of(self, model: object) -> Adapter | None:
        """The LoRA adapter a request's ``model`` names (None for the base): taken when the
        request arrives, so unloading the name later does not stop the request."""
        return self.engine.adapters.get(model)

    def _plan(
        self,
        body: dict,
        prompt_text: str,
        n_prompt: int,
        max_key: tuple[str, ...],
        reasoning: int = 0,
        tool: dict | None = None,
    ) -> replies.Reply:
        max_tokens, sent = None, max_key[-1]
        for key in max_key:
            if max_tokens is None:
                max_tokens, sent = _int_field(body, key), key
        limit = budget(self.cfg, n_prompt, max_tokens, sent)
        s = self.cfg.sim
        seed = tokenizer.seed_of(prompt_text)
        adapter = self.lora_of(body.get("model"))
        if adapter is not None:
            seed ^= tokenizer.seed_of(adapter.path)  # an adapter answers the prompt its own way
        natural = replies.natural_length(seed, s.sim_output_tokens_min, s.sim_output_tokens_max)
        if body.get("ignore_eos"):
            natural = limit
        natural = max(natural, _int_field(body, "min_tokens", 0) or 0)
        return replies.plan(
            seed,
            max_tokens=limit,
            natural=natural,
            reasoning_tokens=reasoning,
            tool=tool,
            stop=stop_list(body),
        )

    def _stream_opts(self, body: dict) -> tuple[bool, bool]:
        return self.usage_opts(body.get("stream_options") or {})

    def usage_opts(self, so: dict) -> tuple[bool, bool]:
        """(final usage chunk, running usage on every chunk) for these stream_options; the
        --sim-no-* knobs model engines that ignore them."""
        s = self.cfg.sim
        force = self.cfg.force_include_usage
        include = (bool(so.get("include_usage")) or force) and not s.sim_no_include_usage
        continuous = (
            include
            and (bool(so.get("continuous_usage_stats")) or force)
            and not s.sim_no_continuous_usage
        )
        return include, continuous

    async def chat(self, req: Request, conn: Connection, body: dict, model: str, rid: str) -> None:
        check_common(body)
        prompt = self._chat_prompt(body)
        tool = self._chat_tool(body)
        ids = tokenizer.encode(prompt)
        reasoning = self._reasoning_tokens(body)
        reply = self._plan(
            body, prompt, len(ids), ("max_completion_tokens", "max_tokens"), reasoning, tool
        )
        seq = Sequence(len(ids), priority_of(self.cfg, body))
        seq.prompt_ids, seq.lora = ids, self.lora_of(model)
        cid = "chatcmpl-" + rid
        headers = [("x-request-id", rid)]
        if body.get("stream"):
            await self._chat_stream(conn, body, model, cid, seq, reply, headers)
        else:
            await self._chat_full(conn, model, cid, seq, reply, headers)

    async def _chat_full(
        self,
        conn: Connection,
        model: str,
        cid: str,
        seq: Sequence,
        reply: replies.Reply,
        headers: list,
    ) -> None:
        try:
            await self._admit_errors(self.run(conn, seq, len(reply), None, None))
        except BaseException:
            self._abort(seq)
            raise
        msg: dict = {
            "role": "assistant",
            "content": "".join(reply.content) if (reply.content or not reply.tool) else None,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if reply.tool is not None:
            msg["tool_calls"] = [
                {
                    "id": reply.tool.id,
                    "type": "function",
                    "function": {"name": reply.tool.name, "arguments": "".join(reply.tool.args)},
                }
            ]
        msg["reasoning"] = "".join(reply.reasoning) if reply.reasoning else None
        self._finish(seq, reply.finish_reason)
        conn.send(
            200,
            _dumps(
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": msg,
                            "logprobs": None,
                            "finish_reason": reply.finish_reason,
                            "stop_reason": reply.stop_reason,
                            "token_ids": None,
                            "routed_experts": None,
                        }
                    ],
                    "service_tier": None,
                    "system_fingerprint": self.fingerprint,
                    "usage": usage(self.cfg, seq, len(reply.reasoning), False),
                    **CHAT_NULLS,
                }
            ).encode(),
            extra=headers,
        )

    def _chat_deltas(self, reply: replies.Reply) -> list[bytes]:
        """The delta object of each generated token, in order, as JSON bytes."""
        out = [b'{"reasoning":%b}' % _dumps(t).encode() for t in reply.reasoning]
        out += [b'{"content":%b}' % _dumps(t).encode() for t in reply.content]
        if reply.tool is not None:
            t = reply.tool
            out.append(
                b'{"tool_calls":[{"index":0,"id":"%b","type":"function","function":{"name":%b,'
                b'"arguments":""}}]}' % (t.id.encode(), _dumps(t.name).encode())
            )
            out += [
                b'{"tool_calls":[{"index":0,"function":{"arguments":%b}}]}' % _dumps(a).encode()
                for a in t.args
            ]
        return out

    async def _chat_stream(
        self,
        conn: Connection,
        body: dict,
        model: str,
        cid: str,
        seq: Sequence,
        reply: replies.Reply,
        headers: list,
    ) -> None:
        include, continuous = self._stream_opts(body)
        head = (
            b'data: {"id":"%b","object":"chat.completion.chunk","created":%d,"model":%b,"choices":'
            % (cid.encode(), int(time.time()), _dumps(model).encode())
        )
        deltas = self._chat_deltas(reply)
        p = seq.prompt_tokens
        merged = _finish_on_last_token(reply) and bool(deltas)
        ending = self._ending(include)

        def usage_of(k: int) -> bytes:
            return running_usage(self.cfg, p, k) if continuous else b""

        def frame(delta: bytes, k: int) -> bytes:
            if merged and k == len(deltas):
                return head + b'[{"index":0,"delta":%b,"logprobs":null,%b]%b%b}\n\n' % (
                    delta,
                    _finish_fields(reply),
                    usage_of(k),
                    ending,
                )
            return (
                head + b'[{"index":0,"delta":%b,"logprobs":null,"finish_reason":null,'
                b'"token_ids":null}]%b}\n\n' % (delta, usage_of(k))
            )

        def on_start() -> None:
            conn.start_stream(200, "text/event-stream; charset=utf-8", headers)
            conn.write_chunk(
                head + b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                b'"finish_reason":null}]%b,"prompt_token_ids":null,"prompt_text":null}\n\n'
                % usage_of(0)
            )

        try:
            await self._admit_errors(
                self.run(conn, seq, len(deltas), on_start, lambda i: frame(deltas[i], i + 1))
            )
        except ApiError as err:
            self._abort(seq)
            if not conn.started:
                raise
            conn.write_chunk(b"data: %b\n\n" % _dumps(err.body()).encode() + DONE)
            conn.end_stream()
            return
        except BaseException:
            self._abort(seq)
            raise
        self._finish(seq, reply.finish_reason)
        fin = b""
        if not merged:
            fin = head + b'[{"index":0,"delta":{"content":""},"logprobs":null,%b]%b%b}\n\n' % (
                _finish_fields(reply),
                usage_of(seq.generated),
                ending,
            )
        tail = b""
        if include:
            tail = head + b'[],"usage":%b,"system_fingerprint":"%b"}\n\n' % (
                _dumps(usage(self.cfg, seq, len(reply.reasoning), True)).encode(),
                self.fingerprint.encode(),
            )
        conn.write_chunk(fin + tail + DONE)
        conn.end_stream()

    def _ending(self, include: bool) -> bytes:
        """What closes the last choice-carrying chunk: vLLM sends system_fingerprint on the
        usage chunk when there is one, else on the chunk that finishes."""
        return b"" if include else b',"system_fingerprint":"%b"' % self.fingerprint.encode()

    # --- completions ----------------------------------------------------------------------

    def _completion_prompt(self, body: dict) -> tuple[str, list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            return prompt, tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return tokenizer.decode(prompt), list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1:
            raise bad_request("prompt: the simulator takes one prompt per request", "prompt")
        raise validation_error(
            "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )

    async def completions(
        self, req: Request, conn: Connection, body: dict, model: str, rid: str
    ) -> None:
        check_common(body)
        text, ids = self._completion_prompt(body)
        reply = self._plan(body, text, len(ids), ("max_tokens",))
        seq = Sequence(len(ids), priority_of(self.cfg, body))
        seq.prompt_ids, seq.lora = ids, self.lora_of(model)
        cid = "cmpl-" + rid
        headers = [("x-request-id", rid)]
        if body.get("stream"):
            await self._completion_stream(conn, body, model, cid, seq, reply, headers)
            return
        try:
            await self._admit_errors(self.run(conn, seq, len(reply), None, None))
        except BaseException:
            self._abort(seq)
            raise
        self._finish(seq, reply.finish_reason)
        conn.send(
            200,
            _dumps(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "text": "".join(reply.content),
                            "logprobs": None,
                            "finish_reason": reply.finish_reason,
                            "stop_reason": reply.stop_reason,
                            "token_ids": None,
                            "prompt_logprobs": None,
                            "prompt_token_ids": None,
                            "routed_experts": None,
                        }
                    ],
                    "service_tier": None,
                    "system_fingerprint": self.fingerprint,
                    "usage": usage(self.cfg, seq, 0, False, chat=False),
                    **COMPLETION_NULLS,
                }
            ).encode(),
            extra=headers,
        )

    async def _completion_stream(
        self,
        conn: Connection,
        body: dict,
        model: str,
        cid: str,
        seq: Sequence,
        reply: replies.Reply,
        headers: list,
    ) -> None:
        include, continuous = self._stream_opts(body)
        head = b'data: {"id":"%b","object":"text_completion","created":%d,"model":%b,"choices":' % (
            cid.encode(),
            int(time.time()),
            _dumps(model).encode(),
        )
        texts = [_dumps(t).encode() for t in reply.content]
        p = seq.prompt_tokens
        merged = _finish_on_last_token(reply) and bool(texts)
        ending = self._ending(include)

        def usage_of(k: int) -> bytes:
            return running_usage(self.cfg, p, k, chat=False) if continuous else b""

        def frame(i: int) -> bytes:
            if merged and i == len(texts) - 1:
                return head + b'[{"index":0,"text":%b,"logprobs":null,%b]%b%b}\n\n' % (
                    texts[i],
                    _finish_fields(reply, completion=True),
                    usage_of(i + 1),
                    ending,
                )
            return head + b'[{"index":0,"text":%b,"logprobs":null,%b]%b}\n\n' % (
                texts[i],
                _open_fields(),
                usage_of(i + 1),
            )

        def on_start() -> None:
            conn.start_stream(200, "text/event-stream; charset=utf-8", headers)

        try:
            await self._admit_errors(self.run(conn, seq, len(texts), on_start, frame))
        except ApiError as err:
            self._abort(seq)
            if not conn.started:
                raise
            conn.write_chunk(b"data: %b\n\n" % _dumps(err.body()).encode() + DONE)
            conn.end_stream()
            return
        except BaseException:
            self._abort(seq)
            raise
        self._finish(seq, reply.finish_reason)
        fin = b""
        if not merged:
            fin = head + b'[{"index":0,"text":"","logprobs":null,%b]%b%b}\n\n' % (
                _finish_fields(reply, completion=True),
                usage_of(seq.generated),
                ending,
            )
        tail = b""
        if include:
            tail = head + b'[],"usage":%b,"system_fingerprint":"%b"}\n\n' % (
                _dumps(usage(self.cfg, seq, 0, True, chat=False)).encode(),
                self.fingerprint.encode(),
            )
        conn.write_chunk(fin + tail + DONE)
        conn.end_stream()

    # --- embeddings -----------------------------------------------------------------------

    def _embedding_inputs(self, body: dict) -> list[list[int]]:
        inp = body.get("input")
        if isinstance(inp, str):
            return [tokenizer.encode(inp)]
        if isinstance(inp, list) and inp and all(isinstance(t, int) for t in inp):
            return [list(inp)]
        if isinstance(inp, list) and inp and all(isinstance(x, str) for x in inp):
            return [tokenizer.encode(x) for x in inp]
        if isinstance(inp, list) and inp and all(isinstance(x, list) for x in inp):
            return [list(x) for x in inp]
        raise bad_request(
            "input: Field required (a string, a list of strings or token ids)", "input"
        )

    def vector(self, ids: list[int]) -> list[float]:
        """A unit vector fixed by the token ids: same input, same embedding."""
        rnd = random.Random(hash(tuple(ids)) if ids else 0)
        v = [rnd.gauss(0.0, 1.0) for _ in range(self.cfg.sim.sim_embedding_dim)]
        norm = sum(x * x for x in v) ** 0.5 or 1.0
        return [x / norm for x in v]

    async def embeddings(
        self, req: Request, conn: Connection, body: dict, model: str, rid: str
    ) -> None:
        inputs = self._embedding_inputs(body)
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise bad_request(
                "encoding_format: Input should be 'float' or 'base64'", "encoding_format"
            )
        dims = body.get("dimensions")
        if dims is not None and dims != self.cfg.sim.sim_embedding_dim:
            raise bad_request(
                f'Model "{model}" does not support matryoshka representation, '
                "changing output dimensions will lead to poor results.",
                "dimensions",
            )
        total = 0
        for ids in inputs:
            budget(self.cfg, len(ids), None)
            total += len(ids)
        seq = Sequence(total)
        try:
            await self._admit_errors(self.run(conn, seq, 0, None, None))
        except BaseException:
            self._abort(seq)
            raise
        self._finish(seq, "stop")
        data = []
        for i, ids in enumerate(inputs):
            vec = self.vector(ids)
            emb: object = (
                vec if fmt == "float" else base64.b64encode(array("f", vec).tobytes()).decode()
            )
            data.append({"index": i, "object": "embedding", "embedding": emb})
        conn.send(
            200,
            _dumps(
                {
                    "id": "embd-" + rid,
                    "object": "list",
                    "created": int(time.time()),
                    "model": model,
                    "data": data,
                    "usage": {
                        "prompt_tokens": total,
                        "total_tokens": total,
                        "completion_tokens": 0,
                        "prompt_tokens_details": None,
                    },
                }
            ).encode(),
            extra=[("x-request-id", rid)],
        )


def _finish_on_last_token(reply: replies.Reply) -> bool:
    """vLLM finishes on the chunk of the last token when max_tokens or a stop string inside
    it ended the reply; any other finish gets a chunk of its own."""
    return reply.finish_reason == "length" or reply.stop_in_token


def _finish_fields(reply: replies.Reply, completion: bool = False) -> bytes:
    """The rest of a finishing choice, after its delta/text and logprobs."""
    extra = b',"prompt_token_ids":null' if completion else b""
    return b'"finish_reason":"%b","stop_reason":%b%b,"token_ids":null}' % (
        reply.finish_reason.encode(),
        _dumps(reply.stop_reason).encode(),
        extra,
    )


def _open_fields() -> bytes:
    """The rest of a completions chunk's choice while the reply goes on."""
    return b'"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}'


def new_request_id(req: Request) -> str:
    return req.headers.get("x-request-id") or os.urandom(8).hex()
