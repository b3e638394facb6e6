"""The gateway's view of a Responses request's prompt (gateway.responses.chat_messages) is
the engine's: its /tokenize count of those messages equals the input_tokens the engine
reports for the request itself. That is what a cut stream's prompt is billed by."""

import httpx
import pytest

from gateway.responses import chat_messages, chat_tools
from tests.gateway.conftest import Engine

TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
}
REQUESTS = [
    {"input": "Hello there."},
    {"input": "Hello there.", "instructions": "You are terse."},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Parts."}]}]},
    {
        "instructions": "Use tools.",
        "tools": [TOOL],
        "input": [
            {"role": "user", "content": "Define gateway."},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "I should look it up."}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "lookup",
                "arguments": '{"word": "gateway"}',
                "status": "completed",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "a way in"},
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "A way in.", "annotations": []}],
            },
            {"role": "user", "content": "Thanks."},
        ],
    },
    {"input": "No tools now.", "tools": [TOOL], "tool_choice": "none"},
]


@pytest.mark.parametrize("request_body", REQUESTS)
def test_the_tokenizer_counts_what_the_engine_bills(engines: dict, request_body: dict) -> None:
    engine: Engine = engines["chat"]
    body = {"model": "sim-chat", **request_body}
    answered = httpx.post(
        f"{engine.url}/v1/responses", json={**body, "max_output_tokens": 2, "store": False}
    )
    assert answered.status_code == 200, answered.text
    tokenize = {"model": "sim-chat", "messages": chat_messages(body)}
    if chat_tools(body):
        tokenize["tools"] = chat_tools(body)
    counted = httpx.post(f"{engine.url}/tokenize", json=tokenize)
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == answered.json()["usage"]["input_tokens"]
