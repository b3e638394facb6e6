"""/v1/messages and /v1/messages/count_tokens as vLLM serves them, through the official
`anthropic` SDK and raw HTTP: the message object, the streamed events, tool use, and
Anthropic-shaped errors."""

from __future__ import annotations

import json
import os
import signal

import anthropic
import httpx
import pytest

from tests.engine_sim.conftest import FAST, sse_events, tokenize

MODEL = [
    "Qwen/Qwen3-8B",
    "--served-model-name",
    "qwen3-8b",
    "--max-model-len",
    "4k",
    "--reasoning-parser",
    "qwen3",
    "--sim-reasoning-tokens",
    "3",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
]
SYSTEM = "You are a careful coding agent."
MSGS = [{"role": "user", "content": "Explain tokens."}]
TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    }
]


@pytest.fixture(scope="module")
def sim(module_sims):
    return module_sims(*MODEL, *FAST)


def client(sim) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=sim.url, api_key="x", max_retries=0)


def post(sim, path: str = "/v1/messages", **body) -> httpx.Response:
    return httpx.post(sim.url + path, json={"model": "qwen3-8b", **body}, timeout=30)


def test_create_through_the_sdk(sim):
    m = client(sim).messages.create(model="qwen3-8b", max_tokens=10, system=SYSTEM, messages=MSGS)
    assert m.type == "message" and m.role == "assistant" and m.model == "qwen3-8b"
    assert m.id.startswith("chatcmpl-")  # vLLM answers with the chat completion's id
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking and m.content[0].signature and m.content[1].text
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 10
    counted = client(sim).messages.count_tokens(model="qwen3-8b", system=SYSTEM, messages=MSGS)
    chat = [{"role": "system", "content": SYSTEM}, *MSGS]
    assert m.usage.input_tokens == counted.input_tokens == tokenize(sim, messages=chat)


def test_stream_through_the_sdk(sim):
    # `thinking` is accepted and ignored: reasoning follows the server's --reasoning-parser.
    with client(sim).messages.stream(
        model="qwen3-8b",
        max_tokens=200,
        system=SYSTEM,
        messages=MSGS,
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[-1].text == text and final.content[0].type == "thinking"
    assert final.content[0].signature  # the signature_delta before the thinking block stops
    assert final.stop_reason == "end_turn"
    again = client(sim).messages.create(
        model="qwen3-8b", max_tokens=200, system=SYSTEM, messages=MSGS
    )
    assert final.usage.output_tokens == again.usage.output_tokens
    assert final.usage.input_tokens == again.usage.input_tokens
    assert again.content[1].text == text


def test_stream_events_in_order(sim):
    r = post(sim, max_tokens=9, system=SYSTEM, messages=MSGS, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert all(name == data["type"] for name, data in events)
    names = [n if n != "content_block_delta" else d["delta"]["type"] for n, d in events]
    assert names == (
        ["message_start", "content_block_start"]
        + ["thinking_delta"] * 3
        + ["signature_delta", "content_block_stop", "content_block_start"]
        + ["text_delta"] * 6
        + ["content_block_stop", "message_delta", "message_stop"]
    )  # and no ping
    start = events[0][1]["message"]
    count = post(sim, "/v1/messages/count_tokens", system=SYSTEM, messages=MSGS).json()[
        "input_tokens"
    ]
    assert start["usage"] == {"input_tokens": count, "output_tokens": 0}
    assert (
        start["id"].startswith("chatcmpl-")
        and start["content"] == []
        and start["stop_reason"] is None
    )
    assert [d["index"] for n, d in events if n.startswith("content_block")] == [0] * 6 + [1] * 8
    delta = events[-2][1]
    streamed = sum(
        1
        for n, d in events
        if n == "content_block_delta" and d["delta"]["type"] != "signature_delta"
    )
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": count, "output_tokens": streamed} and streamed == 9


def test_tool_use_round_trip_through_the_sdk(sim):
    c = client(sim)
    first = c.messages.create(
        model="qwen3-8b",
        max_tokens=300,
        system=SYSTEM,
        tools=TOOLS,
        messages=[{"role": "user", "content": "Open README.md"}],
    )
    assert first.stop_reason == "tool_use"
    use = first.content[-1]
    assert use.type == "tool_use" and use.name == "read_file" and isinstance(use.input["path"], str)
    history = [
        {"role": "user", "content": "Open README.md"},
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "# Tollgate"}],
        },
    ]
    second = c.messages.create(
        model="qwen3-8b", max_tokens=300, system=SYSTEM, tools=TOOLS, messages=history
    )
    assert second.stop_reason == "end_turn" and second.content[-1].type == "text"
    counted = c.messages.count_tokens(
        model="qwen3-8b", system=SYSTEM, tools=TOOLS, messages=history
    )
    assert second.usage.input_tokens == counted.input_tokens > first.usage.input_tokens


def test_streamed_tool_use(sim):
    with client(sim).messages.stream(
        model="qwen3-8b",
        max_tokens=300,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "read_file"},
        messages=[{"role": "user", "content": "Open setup.py"}],
    ) as stream:
        partial = "".join(e.partial_json for e in stream if e.type == "input_json")
        final = stream.get_final_message()
    use = final.content[-1]
    assert use.type == "tool_use" and use.id.startswith("chatcmpl-tool-")
    assert json.loads(partial) == use.input and final.stop_reason == "tool_use"


def test_stop_sequence_is_reported_as_stop_sequence(sim):
    full = post(sim, max_tokens=200, messages=MSGS).json()
    text = full["content"][1]["text"]
    word = text.split()[2]
    cut = post(sim, max_tokens=200, messages=MSGS, stop_sequences=[" " + word]).json()
    assert cut["content"][1]["text"] == text[: text.index(" " + word)]
    # As vLLM 0.32's _to_anthropic_stop_reason maps a matched stop string.
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == " " + word


def test_errors_have_anthropics_shape(sim):
    with pytest.raises(anthropic.NotFoundError) as err:
        client(sim).messages.create(model="nope", max_tokens=5, messages=MSGS)
    assert err.value.body == {
        "type": "error",
        "error": {
            "type": "NotFoundError",
            "message": "The model `nope` does not exist. Valid aliases: qwen3-8b.",
        },
    }
    with pytest.raises(anthropic.BadRequestError, match="maximum context length"):
        client(sim).messages.create(
            model="qwen3-8b", max_tokens=5, messages=[{"role": "user", "content": "word " * 5000}]
        )
    with pytest.raises(anthropic.NotFoundError):
        client(sim).messages.count_tokens(model="nope", messages=MSGS)


def test_validation_errors_keep_the_openai_shape(sim):
    """vLLM's request-validation handler answers every path in the OpenAI shape."""
    r = post(sim, messages=MSGS)  # no max_tokens
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"
    r = post(sim, max_tokens=0, messages=MSGS)
    assert r.status_code == 400 and "max_tokens must be positive" in r.json()["error"]["message"]
    r = post(sim, max_tokens=5, messages=[{"role": "user", "content": [{"type": "video"}]}])
    assert r.status_code == 400


def test_auto_tool_choice_needs_the_server_flags(module_sims):
    plain = module_sims("Qwen/Qwen3-8B", "--served-model-name", "qwen3-8b", *FAST)
    r = post(plain, max_tokens=5, messages=MSGS, tools=TOOLS)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "BadRequestError"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


def test_count_tokens_follows_vllms_conversion(sim):
    c = client(sim)
    bare = c.messages.count_tokens(model="qwen3-8b", messages=MSGS).input_tokens
    with_system = c.messages.count_tokens(
        model="qwen3-8b", system=SYSTEM, messages=MSGS
    ).input_tokens
    # Claude Code's per-request billing header is dropped (it would defeat prefix caching).
    blocks = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; id=123"},
        {"type": "text", "text": SYSTEM},
    ]
    with_header = c.messages.count_tokens(
        model="qwen3-8b", system=blocks, messages=MSGS
    ).input_tokens
    with_tools = c.messages.count_tokens(
        model="qwen3-8b", system=SYSTEM, messages=MSGS, tools=TOOLS
    ).input_tokens
    assert bare < with_system == with_header < with_tools
    r = post(sim, "/v1/messages/count_tokens", messages=MSGS).json()
    assert r == {"input_tokens": bare, "context_management": {"original_input_tokens": bare}}


def test_engine_death_mid_stream_is_an_error_event(start_sim):
    """The engine dies (SIGUSR2, as --sim-crash-after-* would) once the stream has started,
    however long the request took to get there."""
    s = start_sim(
        "m", "--served-model-name", "qwen3-8b", *FAST, "--sim-decode-tps", "20",
        "--sim-crash-grace-seconds", "1",
    )  # fmt: skip
    body = {"model": "qwen3-8b", "max_tokens": 100, "messages": MSGS, "stream": True}
    text, killed = "", False
    with httpx.stream("POST", s.url + "/v1/messages", json=body, timeout=30) as r:
        for chunk in r.iter_text():
            text += chunk
            if not killed and "event: content_block_delta" in text:
                os.kill(s.proc.pid, signal.SIGUSR2)
                killed = True
    events = sse_events(httpx.Response(200, text=text))
    assert events[0][0] == "message_start" and events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "internal_error"
    assert "message_stop" not in [n for n, _ in events]
