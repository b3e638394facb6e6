"""What a gateway bills from: /tokenize agrees with the prompt tokens every API reports, the
usage of a stream is exactly the tokens streamed (no content-less chunk is a token), and the
knobs that make the simulator an engine without running usage (or without any usage in
streams) for the cut-stream billing tests."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.engine_sim.conftest import FAST, sse_events, tokenize, wait_until

MODEL = [
    "Qwen/Qwen3-8B",
    "--served-model-name",
    "qwen3-8b",
    "--reasoning-parser",
    "qwen3",
    "--sim-reasoning-tokens",
    "3",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
]
SYSTEM = "You are a coding agent. Follow the repository's conventions."
TOOL = {
    "name": "read_file",
    "description": "Read a file",
    "parameters": {
        "type": "object",
        "properties": {"path": {"type": "string"}},
        "required": ["path"],
    },
}
CHAT_TOOLS = [{"type": "function", "function": TOOL}]
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Open the README."},
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "README.md"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "# Tollgate\nA gateway."},
    {"role": "user", "content": [{"type": "text", "text": "Summarise it."}]},
]
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def sim(module_sims):
    return module_sims(*MODEL, *FAST)


def post(sim, path: str, **body) -> httpx.Response:
    r = httpx.post(sim.url + path, json={"model": "qwen3-8b", **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def chunks(r: httpx.Response) -> list[dict]:
    frames = [f[6:] for f in r.text.split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def test_tokenize_counts_the_prompt_every_api_reports(sim):
    chat = post(sim, "/v1/chat/completions", messages=CHAT, tools=CHAT_TOOLS, max_tokens=2).json()
    assert chat["usage"]["prompt_tokens"] == tokenize(sim, messages=CHAT, tools=CHAT_TOOLS)
    completion = post(
        sim, "/v1/completions", prompt="def main():\n    return 42\n", max_tokens=2
    ).json()
    assert completion["usage"]["prompt_tokens"] == tokenize(
        sim, prompt="def main():\n    return 42\n"
    )
    # Responses: instructions are a system message, function_call items assistant tool calls,
    # function_call_output items tool messages, tools {"type": "function", "function": tool}.
    items = [
        {"role": "user", "content": "Open the README."},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "read_file",
            "arguments": '{"path": "README.md"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "# Tollgate\nA gateway."},
        {"role": "user", "content": [{"type": "input_text", "text": "Summarise it."}]},
    ]
    resp = post(
        sim,
        "/v1/responses",
        instructions=SYSTEM,
        input=items,
        tools=[{"type": "function", **TOOL}],
        max_output_tokens=2,
    ).json()
    as_chat = [
        CHAT[0],
        CHAT[1],
        CHAT[2],
        CHAT[3],
        {"role": "user", "content": [{"type": "input_text", "text": "Summarise it."}]},
    ]
    assert resp["usage"]["input_tokens"] == tokenize(
        sim,
        messages=as_chat,
        tools=[{"type": "function", "function": {"type": "function", **TOOL}}],
    )
    # Messages: /v1/messages/count_tokens is the engine's exact count.
    body = {
        "system": SYSTEM,
        "tools": [
            {"name": "read_file", "description": "Read a file", "input_schema": TOOL["parameters"]}
        ],
        "messages": [
            {"role": "user", "content": "Open the README."},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "call_1",
                        "name": "read_file",
                        "input": {"path": "README.md"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "call_1",
                        "content": "# Tollgate\nA gateway.",
                    },
                    {"type": "text", "text": "Summarise it."},
                ],
            },
        ],
    }
    msg = post(sim, "/v1/messages", max_tokens=2, **body).json()
    counted = post(sim, "/v1/messages/count_tokens", **body).json()["input_tokens"]
    assert msg["usage"]["input_tokens"] == counted
    assert counted == tokenize(
        sim,
        messages=CHAT,
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "read_file",
                    "description": "Read a file",
                    "parameters": TOOL["parameters"],
                },
            }
        ],
    )


def test_running_usage_counts_only_chunks_with_content(sim):
    """Role chunk and finish chunk carry no token; every other chunk carries exactly one."""
    for kwargs in ({}, {"tools": CHAT_TOOLS, "tool_choice": "required"}):
        cs = chunks(
            post(
                sim,
                "/v1/chat/completions",
                messages=CHAT[:2],
                stream=True,
                stream_options=CONTINUOUS,
                **kwargs,
            )
        )
        seen = 0
        for c in cs[:-1]:
            delta = c["choices"][0]["delta"]
            if delta.get("content") or delta.get("reasoning") or delta.get("tool_calls"):
                seen += 1
            assert c["usage"]["completion_tokens"] == seen
        assert cs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert cs[-1]["usage"]["completion_tokens"] == seen > 3


def test_a_stop_string_leaves_no_empty_token(sim):
    full = post(sim, "/v1/chat/completions", messages=CHAT[:2]).json()["choices"][0]["message"][
        "content"
    ]
    stop = " " + full.split()[4]  # a whole token: the reply ends right before it
    cs = chunks(
        post(
            sim,
            "/v1/chat/completions",
            messages=CHAT[:2],
            stop=[stop],
            stream=True,
            stream_options=CONTINUOUS,
        )
    )
    content = [c["choices"][0]["delta"].get("content") for c in cs[1:-2]]
    reasoning = [c for c in cs[1:-2] if c["choices"][0]["delta"].get("reasoning")]
    assert (
        all(content[len(reasoning) :])
        and "".join(content[len(reasoning) :]) == full[: full.index(stop)]
    )
    assert (
        cs[-1]["usage"]["completion_tokens"] == len(cs) - 3
    )  # all but role, finish and usage chunks


def test_stream_usage_is_what_was_streamed_on_every_api(sim):
    completion = chunks(
        post(
            sim,
            "/v1/completions",
            prompt="Once",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c for c in completion[:-1] if c["choices"][0]["text"]]
    assert completion[-1]["usage"]["completion_tokens"] == len(texts)
    events = sse_events(post(sim, "/v1/responses", input="Once", stream=True))
    deltas = [d for n, d in events if n.endswith(".delta")]
    assert events[-1][1]["response"]["usage"]["output_tokens"] == len(deltas)
    events = sse_events(
        post(
            sim,
            "/v1/messages",
            max_tokens=500,
            messages=[{"role": "user", "content": "Once"}],
            stream=True,
        )
    )
    deltas = [
        d
        for n, d in events
        if n == "content_block_delta" and d["delta"]["type"] != "signature_delta"
    ]
    assert events[-2][1]["usage"]["output_tokens"] == len(deltas)


def test_no_continuous_usage_knob(module_sims):
    s = module_sims(*MODEL, *FAST, "--sim-no-continuous-usage")
    cs = chunks(
        post(s, "/v1/chat/completions", messages=CHAT[:2], stream=True, stream_options=CONTINUOUS)
    )
    assert all("usage" not in c for c in cs[:-1])
    assert cs[-1]["choices"] == [] and cs[-1]["usage"]["completion_tokens"] == len(cs) - 3
    cs = chunks(post(s, "/v1/completions", prompt="Once", stream=True, stream_options=CONTINUOUS))
    assert (
        all("usage" not in c for c in cs[:-1])
        and cs[-1]["usage"]["completion_tokens"] == len(cs) - 2
    )
    # vLLM's Messages stream reads input_tokens from the first chat chunk's running usage.
    events = sse_events(post(s, "/v1/messages", max_tokens=20, messages=CHAT[1:2], stream=True))
    assert events[0][1]["message"]["usage"] == {"input_tokens": 0, "output_tokens": 0}
    assert events[-2][0] == "message_delta" and events[-2][1]["usage"]["output_tokens"] == 20


def test_no_include_usage_knob(module_sims):
    s = module_sims(*MODEL, *FAST, "--sim-no-include-usage", "--enable-force-include-usage")
    cs = chunks(
        post(s, "/v1/chat/completions", messages=CHAT[:2], stream=True, stream_options=CONTINUOUS)
    )
    assert all("usage" not in c for c in cs) and cs[-1]["choices"][0]["finish_reason"] == "stop"
    # Non-streaming answers still carry usage, as on any engine.
    assert (
        post(s, "/v1/chat/completions", messages=CHAT[:2]).json()["usage"]["completion_tokens"] > 0
    )
    events = sse_events(post(s, "/v1/messages", max_tokens=20, messages=CHAT[1:2], stream=True))
    names = [n for n, _ in events]
    assert "message_delta" not in names and names[-1] == "message_stop"


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/responses", {"input": "Count slowly.", "stream": True, "max_output_tokens": 500}),
        (
            "/v1/messages",
            {
                "messages": [{"role": "user", "content": "Count slowly."}],
                "max_tokens": 500,
                "stream": True,
            },
        ),
    ],
)
def test_client_disconnect_aborts(module_sims, path, body):
    s = module_sims(*MODEL, *FAST, "--sim-decode-tps", "20")
    aborted = s.metric("vllm:request_success_total", 'finished_reason="abort"')
    data = json.dumps({"model": "qwen3-8b", **body}).encode()
    conn = socket.create_connection(("127.0.0.1", s.port))
    conn.sendall(
        b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
        b"%d\r\n\r\n%b" % (path.encode(), len(data), data)
    )
    got = b""
    while b"delta" not in got:  # a token has been streamed
        more = conn.recv(65536)
        assert more, f"the stream ended before a token: {got!r}"
        got += more
    conn.close()
    wait_until(lambda: s.metric("vllm:num_requests_running") == 0, what="the request to be aborted")
    # vLLM counts an aborted request in no request-level metric.
    assert s.metric("vllm:request_success_total", 'finished_reason="abort"') == aborted


def test_continue_final_message_continues_the_assistant_message(sim):
    """vLLM's continue_final_message: the last (assistant) message stays open, so the engine
    continues it; its text counts as prompt. With add_generation_prompt too it is a 400."""
    messages = [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon a time"},
    ]
    reply = post(
        sim,
        "/v1/chat/completions",
        messages=messages,
        continue_final_message=True,
        add_generation_prompt=False,
        max_tokens=2,
    ).json()
    open_ended = (
        "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\nOnce upon a time"
    )
    assert reply["usage"]["prompt_tokens"] == tokenize(sim, prompt=open_ended)
    assert reply["usage"]["prompt_tokens"] == tokenize(
        sim, messages=messages, continue_final_message=True, add_generation_prompt=False
    )
    closed = post(sim, "/v1/chat/completions", messages=messages, max_tokens=2).json()
    assert closed["usage"]["prompt_tokens"] > reply["usage"]["prompt_tokens"]
    both = httpx.post(
        sim.url + "/v1/chat/completions",
        json={"model": "qwen3-8b", "messages": messages, "continue_final_message": True},
        timeout=30,
    )
    assert both.status_code == 400 and "continue_final_message" in both.text
