"""/v1/responses end to end through the official openai SDK: the real gateway in front of
simulator engines that serve /v1/responses as vLLM does. The engines run without vLLM's own
response store (VLLM_ENABLE_RESPONSES_API_STORE unset), so every chained turn that works
here works because the gateway kept the conversation."""

import json
import os
import re
import subprocess
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from core.keyspace import stored_response_key
from core.redis import get_redis
from deployments.models import Node
from gateway import response_store
from gateway.models import StoredResponse
from tests.gateway.conftest import (
    Engine,
    World,
    add_routed_model,
    deploy,
    make_model,
    start_engine,
    start_gateway,
    stop,
    wait_until_served,
)
from tests.gateway.test_openai_e2e import usage_event

pytestmark = pytest.mark.django_db(transaction=True)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather now in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def client(world: World, key: str | None = None, url: str | None = None) -> openai.OpenAI:
    base = f"{url}/v1" if url else world.v1
    return openai.OpenAI(base_url=base, api_key=key or world.key_a, max_retries=0)


def served(engine: Engine) -> int:
    """Requests the engine finished (its vllm:request_success_total)."""
    text = httpx.get(f"{engine.url}/metrics").text
    return int(
        sum(
            float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M)
        )
    )


def direct(engine: Engine, payload: dict) -> dict:
    """The same request straight to one engine (no gateway)."""
    r = httpx.post(f"{engine.url}/v1/responses", json={**payload, "store": False}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def dumped(items: list) -> list[dict]:
    return [i.model_dump(mode="json", exclude_none=True) for i in items]


@pytest.fixture
def started_pair() -> Iterator[list[tuple[Engine, subprocess.Popen]]]:
    """Two engines of one model (its two replicas), without vLLM's response store."""
    assert not os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE")
    started = [
        start_engine(("sim-pair",), "--sim-ttft-ms", "2", "--sim-decode-tps", "2000")
        for _ in range(2)
    ]
    yield started
    for _, proc in started:
        if proc.poll() is None:
            stop(proc)


@pytest.fixture
def pair(started_pair: list) -> tuple[Engine, Engine]:
    return started_pair[0][0], started_pair[1][0]


def deploy_pair(world: World, pair: tuple[Engine, Engine]) -> None:
    model = make_model("sim-pair")
    deploy(model, Node.objects.get(name="sim-node"), pair[0].port, pair[1].port)
    wait_until_served(world.url, world.key_a, "sim-pair")


@pytest.fixture
def second_gateway(gateway_url: str) -> Iterator[str]:
    """Another gateway process on the same Redis and database: another node's gateway."""
    proc, url = start_gateway(1)
    yield url
    stop(proc)


# --- Create, stream, keep ----------------------------------------------------------------------


def test_create_retrieve_list_and_delete(world: World, engines: dict) -> None:
    c = client(world)
    raw = c.responses.with_raw_response.create(
        model="sim-chat", input="Name three colours.", instructions="Be brief.", max_output_tokens=9
    )
    response = raw.parse()
    assert response.id.startswith("resp_") and response.status == "incomplete"
    assert response.instructions == "Be brief."
    expected = direct(
        engines["chat"],
        {
            "model": "sim-chat",
            "input": "Name three colours.",
            "instructions": "Be brief.",
            "max_output_tokens": 9,
        },
    )
    assert response.output_text == expected["output"][0]["content"][0]["text"]
    assert response.usage.output_tokens == 9
    assert response.usage.input_tokens == expected["usage"]["input_tokens"]
    event = usage_event(raw.headers["x-request-id"])
    assert event.endpoint == "responses" and event.status == "ok"
    assert (event.prompt_tokens, event.completion_tokens) == (response.usage.input_tokens, 9)
    assert event.cached_tokens == response.usage.input_tokens_details.cached_tokens
    again = c.responses.retrieve(response.id)
    assert again.output_text == response.output_text and again.usage == response.usage
    items = c.responses.input_items.list(response.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [
        ("message", "user", "Name three colours.")
    ]
    c.responses.delete(response.id)
    for call in (c.responses.retrieve, c.responses.delete, c.responses.input_items.list):
        with pytest.raises(openai.NotFoundError) as caught:
            call(response.id)
        assert caught.value.body["message"] == f"Response with id '{response.id}' not found."


def test_stream_passes_the_typed_events_and_bills_the_final_usage(world: World) -> None:
    c = client(world)
    with c.responses.stream(
        model="sim-chat", input="Count to five.", max_output_tokens=12
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
        request_id = stream._response.headers["x-request-id"]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 12 == final.usage.output_tokens
    assert "".join(deltas) == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    event = usage_event(request_id)
    assert (event.prompt_tokens, event.completion_tokens, event.cached_tokens) == (
        final.usage.input_tokens,
        final.usage.output_tokens,
        final.usage.input_tokens_details.cached_tokens,
    )
    # Kept as the client saw it: retrievable at once.
    assert c.responses.retrieve(final.id).output_text == final.output_text


def test_store_false_keeps_nothing_and_background_and_cancel_are_refused(world: World) -> None:
    c = client(world)
    unkept = c.responses.create(model="sim-chat", input="Hi", store=False, max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="sim-chat", input="Again", previous_response_id=unkept.id)
    with pytest.raises(openai.BadRequestError) as caught:
        c.responses.create(model="sim-chat", input="Hi", background=True)
    assert caught.value.body["param"] == "background"
    assert caught.value.body["type"] == "invalid_request_error"
    kept = c.responses.create(model="sim-chat", input="Hi", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError) as caught:
        c.responses.cancel(kept.id)
    assert "background=true" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="no-such-model", input="Hi")


def test_engine_death_mid_stream_ends_with_an_error_event_and_bills_what_was_read(
    world: World,
) -> None:
    engine, proc = start_engine(("sim-dies",), "--sim-decode-tps", "20")
    try:
        add_routed_model(world, "sim-dies", engine.port)
        body = {"model": "sim-dies", "input": "Tell a long story.", "max_output_tokens": 200}
        headers = {"Authorization": f"Bearer {world.key_a}"}
        kinds, deltas = [], 0
        with httpx.stream(
            "POST", f"{world.v1}/responses", json={**body, "stream": True}, headers=headers
        ) as r:
            request_id = r.headers["x-request-id"]
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = orjson.loads(line[5:])
                kinds.append(event["type"])
                deltas += event["type"] == "response.output_text.delta"
                if deltas == 3 and proc.poll() is None:
                    proc.kill()  # the engine dies with the answer half done
    finally:
        stop(proc)
    assert kinds[-1] == "error" and "response.completed" not in kinds
    record = usage_event(request_id, timeout=15)
    assert record.status == "error" and record.completion_tokens == deltas >= 3
    # Nobody is left to count the prompt: it is estimated, and marked so.
    assert record.prompt_tokens > 0 and record.prompt_estimated


# --- Conversations ----------------------------------------------------------------------------


def test_previous_response_id_chains_over_two_replicas_two_gateways_and_a_restart(
    world: World, started_pair: list, second_gateway: str
) -> None:
    pair = tuple(engine for engine, _ in started_pair)
    deploy_pair(world, pair)
    before = [served(e) for e in pair]
    first = client(world).responses.create(
        model="sim-pair", input="My name is Ada. Remember it.", max_output_tokens=8
    )
    after = [served(e) for e in pair]
    took = [b - a for a, b in zip(before, after, strict=True)]
    assert sorted(took) == [0, 1]
    first_engine, other = (pair[0], pair[1]) if took[0] else (pair[1], pair[0])
    # The replica that answered goes away: the next turn can only land on the other one,
    # which has never seen the first turn; and it arrives through another gateway process.
    wait_until_served(second_gateway, world.key_a, "sim-pair")
    stop(started_pair[pair.index(first_engine)][1])
    second = client(world, url=second_gateway).responses.create(
        model="sim-pair",
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
    )
    assert served(other) == after[pair.index(other)] + 1
    assert second.previous_response_id == first.id
    # Exactly what the other engine answers when given the whole conversation itself.
    expected = direct(
        other,
        {
            "model": "sim-pair",
            "input": [
                {"role": "user", "content": "My name is Ada. Remember it."},
                *dumped(first.output),
                {"role": "user", "content": "What is my name?"},
            ],
            "max_output_tokens": 8,
        },
    )
    assert second.output_text == expected["output"][0]["content"][0]["text"]
    assert second.usage.input_tokens == expected["usage"]["input_tokens"]
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # Only the turn's own input is its input; the chain is kept for the next turn.
    items = client(world).responses.input_items.list(second.id, order="asc")
    assert [i.content[0].text for i in items.data] == ["What is my name?"]
    # A gateway that starts afresh (a restart) carries the conversation on.
    proc, restarted_url = start_gateway(1)
    try:
        wait_until_served(restarted_url, world.key_a, "sim-pair")
        restarted = client(world, url=restarted_url)
        assert restarted.responses.retrieve(second.id).output_text == second.output_text
        third = restarted.responses.create(
            model="sim-pair", input="Spell it.", previous_response_id=second.id, max_output_tokens=4
        )
    finally:
        stop(proc)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_function_calling_round_trip(world: World, pair: tuple[Engine, Engine]) -> None:
    deploy_pair(world, pair)
    c = client(world)
    ask = c.responses.create(
        model="sim-pair",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
    )
    calls = [o for o in ask.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    arguments = json.loads(calls[0].arguments)
    assert isinstance(arguments, dict)
    answer = c.responses.create(
        model="sim-pair",
        previous_response_id=ask.id,
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"c": 21}'}
        ],
        tools=[WEATHER],
    )
    assert answer.output_text and not [o for o in answer.output if o.type == "function_call"]
    expected = direct(
        pair[0],
        {
            "model": "sim-pair",
            "input": [
                {"role": "user", "content": "What is the weather in Paris?"},
                *dumped(ask.output),
                {
                    "type": "function_call_output",
                    "call_id": calls[0].call_id,
                    "output": '{"c": 21}',
                },
            ],
            "tools": [WEATHER],
        },
    )
    assert answer.output_text == expected["output"][-1]["content"][0]["text"]
    assert answer.usage.input_tokens == expected["usage"]["input_tokens"]
    listed = c.responses.input_items.list(answer.id)
    assert [i.type for i in listed.data] == ["function_call_output"]
    assert listed.data[0].call_id == calls[0].call_id


def test_another_tenants_response_is_a_404_everywhere(world: World) -> None:
    mine = client(world).responses.create(model="sim-chat", input="Secret", max_output_tokens=3)
    theirs = client(world, world.key_b)
    for call in (theirs.responses.retrieve, theirs.responses.delete, theirs.responses.cancel):
        with pytest.raises(openai.NotFoundError) as caught:
            call(mine.id)
        assert caught.value.body == {
            "message": f"Response with id '{mine.id}' not found.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    with pytest.raises(openai.NotFoundError):
        theirs.responses.input_items.list(mine.id)
    with pytest.raises(openai.NotFoundError) as caught:
        theirs.responses.create(model="sim-chat", input="Hi", previous_response_id=mine.id)
    assert caught.value.body["param"] == "previous_response_id"
    # Still there for its owner.
    assert client(world).responses.retrieve(mine.id).id == mine.id


def test_kept_responses_outlive_redis_through_postgresql(world: World) -> None:
    c = client(world)
    first = c.responses.create(model="sim-chat", input="Remember: blue.", max_output_tokens=4)
    response_store.persist("test-persist", seconds=10)
    row = StoredResponse.objects.get(tenant=world.tenant_a, response_id=first.id)
    assert row.response["output"] == [o.to_dict() for o in first.output]
    assert row.input_items[0]["content"][0]["text"] == "Remember: blue."
    # Redis lost it (TTL passed, Redis rebuilt): served from PostgreSQL, and chained from.
    get_redis().delete(stored_response_key(world.tenant_a.pk, first.id))
    assert c.responses.retrieve(first.id).output_text == first.output_text
    get_redis().delete(stored_response_key(world.tenant_a.pk, first.id))
    second = c.responses.create(
        model="sim-chat", input="Which colour?", previous_response_id=first.id, max_output_tokens=4
    )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)  # the tombstone hides the row until it is deleted
    response_store.persist("test-persist", seconds=10)
    assert not StoredResponse.objects.filter(response_id=first.id).exists()
    assert StoredResponse.objects.filter(response_id=second.id, chain=[first.id]).exists()


# --- Paths ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/v1/nothing-here", 404),
        ("GET", "/v1/assistants", 404),
        ("GET", "/v1", 404),
        ("POST", "/v1/responses/resp_1/unknown", 404),
        ("GET", "/v1/files/file-1/content/extra", 404),
        ("GET", "/v1/responses", 405),
        ("PUT", "/v1/responses/resp_1", 405),
        ("GET", "/v1/responses/resp_1/cancel", 405),
        ("GET", "/v1/chat/completions", 405),
    ],
)
def test_other_v1_paths_answer_openai_json(
    world: World, method: str, path: str, status: int
) -> None:
    r = httpx.request(method, world.url + path, headers={"Authorization": f"Bearer {world.key_a}"})
    assert r.status_code == status
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if status == 404:
        assert error["message"] == f"Invalid URL ({method} {path})"


def test_sdk_raises_not_found_for_an_unknown_path(world: World) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(world).get("/nothing-here", cast_to=object)
    assert caught.value.body["message"] == "Invalid URL (GET /v1/nothing-here)"


def test_responses_without_input_are_refused_with_openai_errors(world: World) -> None:
    r = httpx.post(
        f"{world.v1}/responses",
        headers={"Authorization": f"Bearer {world.key_a}"},
        content=orjson.dumps({"model": "sim-chat"}),
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(
        f"{world.v1}/responses",
        headers={"Authorization": f"Bearer {world.key_a}"},
        content=orjson.dumps({"model": "sim-chat", "input": "x", "max_output_tokens": 0}),
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
