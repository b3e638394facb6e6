"""Tollgate's answers through the official SDKs against the engine's own answers.

Each check sends one request through the gateway with the ``openai`` or ``anthropic`` SDK
and the same request straight to the replica (``Direct``), at temperature 0, and asserts the
same text and the same usage. The tiny test model has random weights, so its text is
gibberish, but it is the same gibberish every time: any token the gateway loses, adds or
reorders shows.
"""

from __future__ import annotations

import anthropic
import openai

from tests.vllm.conftest import SERVED_NAME
from tests.vllm.stack import Direct

CHAT = [{"role": "user", "content": "Tell me a short story about a toll gate."}]
PROMPT = "The toll gate on the old road"
MAX_TOKENS = 24


def chat_body(**more: object) -> dict:
    return {
        "model": SERVED_NAME,
        "messages": CHAT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **more,
    }


def usage_pair(usage: dict) -> tuple[int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"]


def check_chat(gw: openai.OpenAI, direct: Direct) -> int:
    """Chat, whole and streamed, equals the engine's; returns the requests sent."""
    want = direct.post("/v1/chat/completions", chat_body())
    text, usage = want["choices"][0]["message"]["content"], usage_pair(want["usage"])
    got = gw.chat.completions.create(**chat_body())
    assert got.choices[0].message.content == text
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == usage
    assert got.choices[0].finish_reason == want["choices"][0]["finish_reason"]
    streamed, last, with_usage = "", None, 0
    options = {"include_usage": True}
    for chunk in gw.chat.completions.create(**chat_body(), stream=True, stream_options=options):
        streamed += "".join(c.delta.content or "" for c in chunk.choices)
        with_usage += chunk.usage is not None
        last = chunk
    assert streamed == text
    # Only the final chunk carries usage: the running usage Tollgate asked the engine for
    # (continuous_usage_stats) is stripped, as the client did not ask for it.
    assert with_usage == 1 and (last.usage.prompt_tokens, last.usage.completion_tokens) == usage
    plain = list(gw.chat.completions.create(**chat_body(), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in plain if c.choices) == text
    assert all(c.usage is None for c in plain)  # no usage asked for, none given
    return 3


def check_completions(gw: openai.OpenAI, direct: Direct) -> int:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    want = direct.post("/v1/completions", body)
    text, usage = want["choices"][0]["text"], usage_pair(want["usage"])
    got = gw.completions.create(**body)
    assert (got.choices[0].text, got.usage.prompt_tokens, got.usage.completion_tokens) == (
        text,
        *usage,
    )
    streamed, final = "", None
    for chunk in gw.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        streamed += "".join(c.text for c in chunk.choices)
        final = chunk.usage or final
    assert streamed == text and (final.prompt_tokens, final.completion_tokens) == usage
    return 2


def response_text(answer: dict) -> str:
    return "".join(
        part.get("text", "")
        for item in answer["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def check_responses(gw: openai.OpenAI, direct: Direct) -> int:
    """A two-turn conversation through ``previous_response_id`` equals the engine's answer
    to the whole conversation sent at once."""
    first_input, second_input = "Hello there, what is a toll gate?", "And who pays at one?"
    limits = {"model": SERVED_NAME, "max_output_tokens": MAX_TOKENS, "temperature": 0}
    want1 = direct.post("/v1/responses", {**limits, "input": first_input, "store": False})
    first = gw.responses.create(**limits, input=first_input)
    assert first.output_text == response_text(want1)
    assert (first.usage.input_tokens, first.usage.output_tokens) == (
        want1["usage"]["input_tokens"],
        want1["usage"]["output_tokens"],
    )
    history = [{"role": "user", "content": first_input}, *want1["output"]]
    history.append({"role": "user", "content": second_input})
    want2 = direct.post("/v1/responses", {**limits, "input": history, "store": False})
    second = gw.responses.create(**limits, input=second_input, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.output_text == response_text(want2)
    assert (second.usage.input_tokens, second.usage.output_tokens) == (
        want2["usage"]["input_tokens"],
        want2["usage"]["output_tokens"],
    )
    return 2


def check_messages(ac: anthropic.Anthropic, direct: Direct) -> int:
    """Anthropic Messages, whole and streamed, and count_tokens, equal the engine's."""
    body = chat_body()
    want = direct.post("/v1/messages", body)
    # This anthropic SDK has no ``temperature`` argument any more; the API still takes it.
    sdk = {name: value for name, value in body.items() if name != "temperature"}
    sdk["extra_body"] = {"temperature": 0}
    text = "".join(block.get("text", "") for block in want["content"])
    usage = want["usage"]["input_tokens"], want["usage"]["output_tokens"]
    got = ac.messages.create(**sdk)
    assert "".join(b.text for b in got.content if b.type == "text") == text
    assert (got.usage.input_tokens, got.usage.output_tokens) == usage
    assert got.stop_reason == want["stop_reason"]
    with ac.messages.stream(**sdk) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and (final.usage.input_tokens, final.usage.output_tokens) == usage
    counted = ac.messages.count_tokens(model=SERVED_NAME, messages=CHAT)
    want_count = direct.count("/v1/messages/count_tokens", {"model": SERVED_NAME, "messages": CHAT})
    assert counted.input_tokens == want_count["input_tokens"] == usage[0]
    return 3
