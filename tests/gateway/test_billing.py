"""The billing rules of gateway/billing.py and the token counting of the relays, on their
own: which outcomes are billed, how a prompt the engine never reported is counted (by a
real simulator engine's tokenizer; by the estimate, marked, when no engine answers), and
which stream chunks are tokens."""

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from gateway import billing, messages
from gateway.relay import StreamState, carries_tokens
from gateway.state import Upstream
from gateway.upstream import make_client
from gateway.usage import Outcome
from tests.gateway.conftest import Engine, free_port, start_engine, stop

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Count my prompt, please."},
]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
    }
]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    started, proc = start_engine(
        ("sim-count",), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
    )
    yield started
    stop(proc)


def upstream(port: int) -> Upstream:
    return Upstream(1, 1, f"http://127.0.0.1:{port}", 8)


def counted(endpoint: str, payload: dict, *ports: int) -> Outcome:
    async def run() -> Outcome:
        session, outcome = make_client("tollgate"), Outcome()
        ups = [upstream(p) for p in ports]
        try:
            await billing.count_prompt(session, endpoint, payload, outcome, ups[0], ups)
        finally:
            await session.close()
        return outcome

    return asyncio.run(run())


def engine_prompt(engine: Engine, path: str, body: dict) -> int:
    usage = httpx.post(engine.url + path, json=body, timeout=30).json()["usage"]
    return usage.get("prompt_tokens", usage.get("input_tokens"))


@pytest.mark.parametrize(
    ("endpoint", "path", "payload"),
    [
        ("chat", "/v1/chat/completions", {"messages": CHAT}),
        ("chat", "/v1/chat/completions", {"messages": CHAT, "tools": TOOLS}),
        ("completions", "/v1/completions", {"prompt": "Count my prompt, please."}),
        ("completions", "/v1/completions", {"prompt": ["One prompt in a list."]}),
        ("messages", "/v1/messages", {"system": "You are terse.", "messages": CHAT[1:]}),
        (
            "responses",
            "/v1/responses",
            {"instructions": "You are terse.", "input": "Count my prompt.", "store": False},
        ),
    ],
)
def test_an_unreported_prompt_is_counted_by_the_engines_tokenizer(
    engine: Engine, endpoint: str, path: str, payload: dict
) -> None:
    """The count equals the prompt tokens the engine reports when it answers in full (a
    dead replica first in line is skipped)."""
    payload = {"model": "sim-count", **payload}
    limit = "max_output_tokens" if endpoint == "responses" else "max_tokens"
    expected = engine_prompt(engine, path, {**payload, limit: 1})
    outcome = counted(endpoint, payload, free_port(), engine.port)
    assert (outcome.prompt_tokens, outcome.prompt_known, outcome.prompt_estimated) == (
        expected,
        True,
        False,
    )


def test_token_id_prompts_count_as_given() -> None:
    outcome = counted("completions", {"model": "m", "prompt": [5, 6, 7, 8]}, free_port())
    assert (outcome.prompt_tokens, outcome.prompt_estimated) == (4, False)


def test_with_no_engine_to_ask_the_prompt_is_estimated_and_marked() -> None:
    payload = {"model": "m", "messages": [{"role": "user", "content": "x" * 4000}]}
    outcome = counted("chat", payload, free_port())
    assert outcome.prompt_estimated and not outcome.prompt_known
    assert 1000 <= outcome.prompt_tokens <= 1100  # ~4 bytes a token of the prompt's text


@pytest.mark.parametrize(
    ("status", "http_status", "forwarded", "completion", "billed"),
    [
        ("ok", 200, True, 0, True),
        ("client_closed", 200, True, 0, True),  # cut before the first token: prompt billed
        ("client_closed", 0, True, 0, True),  # cut during prefill, before any answer
        ("client_closed", 0, False, 0, False),  # cut while queued: no engine took it
        ("error", 200, True, 0, False),  # the engine failed before delivering anything
        ("error", 200, True, 3, True),  # …or after delivering three tokens
        ("error", 400, True, 0, False),  # the engine refused it
    ],
)
def test_what_is_billed(
    status: str, http_status: int, forwarded: bool, completion: int, billed: bool
) -> None:
    outcome = Outcome(
        status=status,
        http_status=http_status,
        forwarded=forwarded,
        completion_tokens=completion,
    )
    assert billing.billable("chat", outcome) is billed
    # Endpoints that generate nothing bill what the engine reported, nothing more.
    assert billing.billable("embeddings", outcome) is (status == "ok" or completion > 0)


@pytest.mark.parametrize(
    ("chunk", "tokens"),
    [
        (b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}', False),
        (b'{"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}', False),
        (b'{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}', False),
        (b'{"choices":[{"index":0,"delta":{"content":null,"tool_calls":[]}}]}', False),
        (b'{"choices":[{"index":0,"text":"","finish_reason":"length"}]}', False),
        (b'{"choices":[{"index":0,"delta":{"content":"Hi"}}]}', True),
        (b'{"choices":[{"index":0,"delta":{"content":"\\"\\""}}]}', True),  # text: ""
        (b'{"choices":[{"index":0,"delta":{"reasoning":"Let"}}]}', True),
        (b'{"choices":[{"index":0,"delta":{"content":"","reasoning_content":"Let"}}]}', True),
        (
            b'{"choices":[{"index":0,"delta":{"content":null,"tool_calls":[{"index":0,'
            b'"function":{"arguments":"{\\""}}]}}]}',
            True,
        ),
        (b'{"choices":[{"index":0,"text":" world"}]}', True),
    ],
)
def test_only_chunks_with_generated_text_are_tokens(chunk: bytes, tokens: bool) -> None:
    assert carries_tokens(chunk) is tokens


def stream_state() -> StreamState:
    return StreamState(wants_usage=False, wants_continuous=False, started_at=0.0, outcome=Outcome())


def test_messages_events_count_deltas_and_read_usage() -> None:
    st = stream_state()
    events = [
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
        b'{"input_tokens":40,"cache_read_input_tokens":16,"output_tokens":0}}}',
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"thinking","thinking":""}}',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"thinking_delta","thinking":"Hm"}}',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"signature_delta","signature":"abc"}}',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
        b'"delta":{"type":"text_delta","text":""}}',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
        b'"delta":{"type":"text_delta","text":"Hi"}}',
        b'event: content_block_start\ndata: {"type":"content_block_start","index":2,'
        b'"content_block":{"type":"tool_use","id":"t","name":"f","input":{}}}',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":2,'
        b'"delta":{"type":"input_json_delta","partial_json":"{}"}}',
    ]
    shown = [messages.transform_event(e, st) for e in events]
    assert shown == [e + b"\n\n" for e in events]  # passed on unchanged
    assert st.content_frames == 4 and not st.saw_usage  # thinking, text, tool name, args
    out = st.outcome
    assert (out.prompt_tokens, out.cached_tokens, out.prompt_known) == (56, 16, True)
    delta = b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":9}}'
    messages.transform_event(delta, st)
    assert st.saw_usage and st.pending_completion == 9


def test_an_engine_error_event_ends_the_stream_in_anthropic_shape() -> None:
    st = stream_state()
    st.outcome.status = "ok"
    frame = b'event: error\ndata: {"type":"error","error":{"type":"internal_error","message":"x"}}'
    shown = messages.transform_event(frame, st)
    assert st.outcome.status == "error"
    assert (
        shown
        == b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"x"}}\n\n'
    )
