"""The Anthropic Messages API through the gateway, driven by the official ``anthropic`` SDK
against a simulator engine (vLLM's own /v1/messages): answers, streams, token counting,
tool use, thinking, stop sequences, errors in Anthropic's shape, and usage events."""

import csv
import io
import time
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from core.changes import publish_change
from core.keyspace import usage_stream
from core.redis import get_redis
from deployments.models import Deployment, Replica
from metering import export, ingest
from tenants import services as tenant_services
from tests.gateway.conftest import (
    Engine,
    World,
    add_routed_model,
    start_engine,
    stop,
    wait_until_served,
)
from tests.gateway.test_openai_e2e import usage_event

pytestmark = pytest.mark.django_db(transaction=True)
MODEL = "sim-agent"
SYSTEM = "You are a careful coding agent."
HELLO = [{"role": "user", "content": "Explain tokens in one paragraph."}]
TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the repository",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    }
]


@pytest.fixture(scope="module")
def agent_engine() -> Iterator[Engine]:
    """A reasoning, tool-calling engine (vLLM with --reasoning-parser and auto tool choice)."""
    engine, proc = start_engine(
        (MODEL,),
        "--sim-ttft-ms",
        "2",
        "--sim-decode-tps",
        "2000",
        "--reasoning-parser",
        "qwen3",
        "--sim-reasoning-tokens",
        "3",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--max-model-len",
        "65536",
    )
    yield engine
    stop(proc)


@pytest.fixture
def agent(world: World, agent_engine: Engine) -> World:
    add_routed_model(world, MODEL, agent_engine.port)
    return world


def claude(world: World, key: str | None = None) -> anthropic.Anthropic:
    # The SDK appends /v1/messages itself: its base_url is the appliance's root.
    return anthropic.Anthropic(base_url=world.url, api_key=key or world.key_a, max_retries=0)


def direct(engine: Engine, path: str = "/v1/messages", **body: object) -> dict:
    return httpx.post(f"{engine.url}{path}", json={"model": MODEL, **body}, timeout=30).json()


def test_create_answers_as_the_engine_and_bills_its_usage(
    agent: World, agent_engine: Engine
) -> None:
    raw = claude(agent).messages.with_raw_response.create(
        model=MODEL, max_tokens=12, system=SYSTEM, messages=HELLO
    )
    message = raw.parse()
    expected = direct(agent_engine, max_tokens=12, system=SYSTEM, messages=HELLO)
    assert [b.type for b in message.content] == ["thinking", "text"]  # thinking comes first
    assert message.content[1].text == expected["content"][1]["text"]
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 12
    assert message.usage.input_tokens == expected["usage"]["input_tokens"]
    event = usage_event(raw.headers["x-request-id"])
    assert (event.endpoint, event.status, event.tenant_id) == ("messages", "ok", agent.tenant_a.pk)
    assert (event.prompt_tokens, event.completion_tokens) == (message.usage.input_tokens, 12)
    assert not event.prompt_estimated


def test_stream_with_get_final_message(agent: World) -> None:
    with claude(agent).messages.stream(
        model=MODEL,
        max_tokens=40,
        system=[{"type": "text", "text": SYSTEM}],
        messages=HELLO,
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        request_id = stream.response.headers["x-request-id"]
    assert final.content[0].type == "thinking" and final.content[0].thinking
    assert final.content[-1].text == text and text
    event = usage_event(request_id)
    assert event.prompt_tokens == final.usage.input_tokens > 0
    assert event.completion_tokens == final.usage.output_tokens > 0
    assert event.endpoint == "messages" and event.status == "ok"


def test_count_tokens_is_the_engines_count(agent: World, agent_engine: Engine) -> None:
    counted = claude(agent).messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=HELLO, tools=TOOLS
    )
    expected = direct(
        agent_engine, "/v1/messages/count_tokens", system=SYSTEM, messages=HELLO, tools=TOOLS
    )
    assert counted.input_tokens == expected["input_tokens"] > 0


def test_tool_use_round_trip(agent: World) -> None:
    client = claude(agent)
    first = client.messages.create(
        model=MODEL, max_tokens=200, system=SYSTEM, messages=HELLO, tools=TOOLS
    )
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.name == "read_file" and isinstance(call.input["path"], str)
    second = client.messages.create(
        model=MODEL,
        max_tokens=200,
        system=SYSTEM,
        tools=TOOLS,
        messages=[
            *HELLO,
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "print('hi')"}
                ],
            },
        ],
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.content[-1].type == "text" and second.content[-1].text
    assert second.usage.input_tokens > first.usage.input_tokens  # the history grew


def test_stop_sequences_end_the_text_before_them(agent: World) -> None:
    client = claude(agent)
    full = client.messages.create(model=MODEL, max_tokens=30, messages=HELLO).content[-1].text
    stop_at = full.split()[3]
    cut = client.messages.create(
        model=MODEL, max_tokens=30, messages=HELLO, stop_sequences=[stop_at]
    )
    assert cut.content[-1].text == full[: full.index(stop_at)]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop_at


def test_bearer_auth_works_too(agent: World) -> None:
    client = anthropic.Anthropic(base_url=agent.url, auth_token=agent.key_a, max_retries=0)
    reply = client.messages.create(model=MODEL, max_tokens=3, messages=HELLO)
    assert reply.usage.output_tokens == 3


def test_a_bad_key_is_an_authentication_error(agent: World) -> None:
    with pytest.raises(anthropic.AuthenticationError) as caught:
        claude(agent, "tg-nope-" + "x" * 40).messages.create(
            model=MODEL, max_tokens=3, messages=HELLO
        )
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "authentication_error"


def test_an_unknown_or_foreign_model_is_not_found(agent: World) -> None:
    for model, key in (("no-such-model", agent.key_a), ("acme-private", agent.key_b)):
        with pytest.raises(anthropic.NotFoundError) as caught:
            claude(agent, key).messages.create(model=model, max_tokens=3, messages=HELLO)
        assert caught.value.body["error"]["type"] == "not_found_error"
        assert model in caught.value.body["error"]["message"]


def test_an_embedding_model_is_an_invalid_request(agent: World) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude(agent).messages.create(model="sim-embed", max_tokens=3, messages=HELLO)
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_the_engines_validation_errors_reach_the_client_in_anthropic_shape(agent: World) -> None:
    answer = httpx.post(
        f"{agent.url}/v1/messages",
        headers={"x-api-key": agent.key_a, "anthropic-version": "2023-06-01"},
        json={"model": MODEL, "messages": HELLO},  # no max_tokens
        timeout=30,
    )
    assert answer.status_code == 400
    assert answer.json()["type"] == "error"
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_a_rate_limit_is_a_rate_limit_error_with_retry_after(agent: World) -> None:
    issued = tenant_services.issue_api_key(None, agent.tenant_a, name="rpm1", requests_per_minute=1)
    wait_until_served(agent.url, issued.plaintext, MODEL)
    client = claude(agent, issued.plaintext)
    client.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    with pytest.raises(anthropic.RateLimitError) as caught:
        client.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert int(caught.value.response.headers["retry-after"]) > 0
    assert caught.value.body["error"]["type"] == "rate_limit_error"


def test_no_engine_ready_is_overloaded_with_retry_after(agent: World) -> None:
    deployment = Deployment.objects.get(model__served_name=MODEL)
    Replica.objects.filter(deployment=deployment).update(healthy=False)
    publish_change("deployment", deployment.pk)
    client = claude(agent)
    deadline = time.monotonic() + 10
    with pytest.raises(anthropic.OverloadedError) as caught:
        while time.monotonic() < deadline:  # until a gateway worker reloaded its routes
            client.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert caught.value.status_code == 529
    assert isinstance(caught.value, anthropic.InternalServerError)
    assert caught.value.body["error"]["type"] == "overloaded_error"
    assert int(caught.value.response.headers["retry-after"]) > 0


def test_an_agent_session_is_billed_to_the_token_of_what_the_client_was_told(
    agent: World,
) -> None:
    """A Claude-Code-shaped session: a long system prompt (over 10k tokens) and tool
    definitions on every turn, the model calling tools three times (each result sent back),
    then answering; every turn streamed. The showback CSV for the session's tenant and model
    equals the sum of the usage the client received, to the token."""
    get_redis().delete(usage_stream())  # earlier tests' events belong to flushed tenants
    system = " ".join(
        f"Rule {i}: keep the repository's tests green and explain each change." for i in range(900)
    )
    client = claude(agent)
    assert (
        client.messages.count_tokens(model=MODEL, system=system, messages=HELLO).input_tokens
        >= 10_000
    )
    history: list = [{"role": "user", "content": "Fix the failing test in tests/test_app.py."}]
    told = {"input": 0, "output": 0, "requests": 1}  # count_tokens: a request, no tokens
    for turn in range(4):
        choice = {"type": "any"} if turn < 3 else {"type": "auto"}
        with client.messages.stream(
            model=MODEL,
            max_tokens=300,
            system=system,
            tools=TOOLS,
            tool_choice=choice,
            messages=history,
        ) as stream:
            final = stream.get_final_message()
        told["input"] += final.usage.input_tokens
        told["output"] += final.usage.output_tokens
        told["requests"] += 1
        history.append({"role": "assistant", "content": final.content})
        calls = [b for b in final.content if b.type == "tool_use"]
        if turn < 3:
            assert final.stop_reason == "tool_use" and calls
            history.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": c.id, "content": f"file {turn}"}
                        for c in calls
                    ],
                }
            )
        else:
            assert final.stop_reason in ("end_turn", "max_tokens") and not calls
    deadline = time.monotonic() + 10
    while len(get_redis().xrange(usage_stream())) < told["requests"]:
        assert time.monotonic() < deadline, "the gateway did not record every turn"
        time.sleep(0.05)
    ingest.drain("agent-session-test", seconds=30)
    query = export.parse_query({"tenant": "acme", "model": MODEL, "granularity": "month"}, None)
    lines = list(csv.DictReader(io.StringIO("".join(export.csv_lines(query)))))
    billed = {
        "input": sum(int(r["prompt_tokens"]) for r in lines),
        "output": sum(int(r["completion_tokens"]) for r in lines),
        "requests": sum(int(r["requests"]) for r in lines),
    }
    assert billed == told
    assert sum(int(r["estimated_prompt_tokens"]) for r in lines) == 0
