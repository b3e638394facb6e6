"""/v1/responses as vLLM serves it, through the official `openai` SDK and raw HTTP: the
Response object, the typed SSE events, function calling, stored responses (only with
VLLM_ENABLE_RESPONSES_API_STORE=1, in the engine's memory), background mode and cancel."""

from __future__ import annotations

import json
import os
import signal

import httpx
import openai
import pytest

from tests.engine_sim.conftest import FAST, sse_events, tokenize, wait_until

MODEL = [
    "Qwen/Qwen3-8B",
    "--served-model-name",
    "qwen3-8b",
    "--max-model-len",
    "4k",
    "--reasoning-parser",
    "qwen3",
    "--sim-reasoning-tokens",
    "4",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
]
STORE = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
INSTRUCTIONS = "You are a terse assistant."


@pytest.fixture(scope="module")
def sim(module_sims):
    return module_sims(*MODEL, *FAST, env=STORE)


@pytest.fixture(scope="module")
def slow(module_sims):
    """Decodes at 20 tok/s, so a request is still running when the test acts on it."""
    return module_sims(*MODEL, *FAST, "--sim-decode-tps", "20", env=STORE)


def client(sim) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)


def post(sim, **body) -> httpx.Response:
    return httpx.post(sim.url + "/v1/responses", json={"model": "qwen3-8b", **body}, timeout=30)


def as_chat(instructions: str | None, items: list[dict] | str) -> list[dict]:
    """The chat messages vLLM builds from a Responses request (how a gateway counts its prompt
    with /tokenize)."""
    msgs = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    for item in items:
        if item.get("type") == "function_call":
            msgs.append(
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": item["call_id"],
                            "type": "function",
                            "function": {"name": item["name"], "arguments": item["arguments"]},
                        }
                    ],
                }
            )
        elif item.get("type") == "function_call_output":
            msgs.append(
                {"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]}
            )
        else:
            msgs.append(item)
    return msgs


def test_create_through_the_sdk(sim):
    r = client(sim).responses.create(
        model="qwen3-8b",
        input="Tell me about tokens.",
        instructions=INSTRUCTIONS,
        max_output_tokens=12,
        metadata={"ticket": "42"},
    )
    assert r.object == "response" and r.id.startswith("resp_") and len(r.id) == len("resp_") + 32
    assert (
        r.model == "qwen3-8b" and r.instructions == INSTRUCTIONS and r.metadata == {"ticket": "42"}
    )
    # 4 reasoning tokens then text, cut at 12: incomplete, as vLLM reports max_output_tokens.
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].id.startswith("rs_") and r.output[1].id.startswith("msg_")
    assert r.output[1].content[0].type == "output_text" and r.output_text
    u = r.usage
    assert u.output_tokens == 12 and u.output_tokens_details.reasoning_tokens == 4
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens == 0
    assert u.input_tokens == tokenize(sim, messages=as_chat(INSTRUCTIONS, "Tell me about tokens."))
    # vLLM echoes "none" when there are no tools to choose from.
    assert r.max_output_tokens == 12 and r.tool_choice == "none" and r.tools == []


def test_stream_events_in_order_with_sequence_numbers(sim):
    r = post(sim, input="Tell me about streams.", max_output_tokens=10, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in r.text
    events = sse_events(r)
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    names = [name for name, _ in events]
    assert names == (
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        + ["response.reasoning_text.delta"] * 4
        + [
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
        ]
        + ["response.output_text.delta"] * 6
        + [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    )
    created = events[0][1]["response"]
    assert (
        created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    )
    final = events[-1][1]["response"]
    assert final["id"] == created["id"] and final["status"] == "incomplete"
    deltas = [d for n, d in events if n.endswith(".delta")]
    # Usage is what was streamed: one delta per token.
    assert final["usage"]["output_tokens"] == len(deltas) == 10
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 4
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert text == final["output"][1]["content"][0]["text"]
    reasoning_done = next(d for n, d in events if n == "response.reasoning_text.done")
    assert reasoning_done["text"] == final["output"][0]["content"][0]["text"]
    # The message is the second output item.
    assert {d["output_index"] for n, d in events if n == "response.output_text.delta"} == {1}


def test_stream_through_the_sdk(sim):
    text = []
    with client(sim).responses.stream(
        model="qwen3-8b", input="Stream it.", instructions=INSTRUCTIONS, max_output_tokens=30
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                text.append(event.delta)
        final = stream.get_final_response()
    assert final.output_text == "".join(text) and final.status in ("completed", "incomplete")
    assert final.usage.output_tokens == len(text) + 4
    assert final.usage.input_tokens == tokenize(sim, messages=as_chat(INSTRUCTIONS, "Stream it."))


def test_function_calling_round_trip_through_the_sdk(sim):
    c = client(sim)
    first = c.responses.create(model="qwen3-8b", input="Weather in Paris?", tools=TOOLS)
    assert first.status == "completed"
    call = next(o for o in first.output if o.type == "function_call")
    assert (
        call.name == "get_weather"
        and call.id.startswith("fc_")
        and call.call_id.startswith("chatcmpl-tool-")
    )
    assert set(json.loads(call.arguments)) == {"city"}
    assert first.tools[0].name == "get_weather"
    # The agent runs the tool and sends its result back, with the conversation kept by vLLM...
    second = c.responses.create(
        model="qwen3-8b",
        previous_response_id=first.id,
        tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert second.previous_response_id == first.id
    assert [o.type for o in second.output] == ["reasoning", "message"] and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens
    # ...or with the whole history in the request (store=False, as stateless agents do).
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    third = c.responses.create(model="qwen3-8b", input=history, tools=TOOLS, store=False)
    assert "function_call" not in [o.type for o in third.output]
    chat_tools = [{"type": "function", "function": t} for t in TOOLS]
    assert third.usage.input_tokens == tokenize(
        sim, messages=as_chat(None, history), tools=chat_tools
    )


def test_streamed_function_call_events(sim):
    events = sse_events(
        post(sim, input="Weather in Rome?", tools=TOOLS, tool_choice="required", stream=True)
    )
    added = [d["item"] for n, d in events if n == "response.output_item.added"]
    assert [i["type"] for i in added] == ["reasoning", "function_call"]
    call = added[1]
    assert (
        call["arguments"] == ""
        and call["status"] == "in_progress"
        and call["call_id"].startswith("call_")
    )
    args = "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta")
    done = next(d for n, d in events if n == "response.function_call_arguments.done")
    assert done["arguments"] == args and done["name"] == "get_weather"
    assert json.loads(args)["city"]
    item_done = [d["item"] for n, d in events if n == "response.output_item.done"][-1]
    assert item_done == {**call, "arguments": args, "status": "completed"}
    final = events[-1][1]["response"]
    out = final["output"][-1]
    # vLLM rebuilds the final output from the whole text: new ids, the tool parser's call id.
    assert (
        out["arguments"] == args
        and out["id"].startswith("fc_")
        and out["call_id"].startswith("chatcmpl-tool-")
    )
    n_args = sum(1 for n, _ in events if n == "response.function_call_arguments.delta")
    assert final["usage"]["output_tokens"] == 4 + 1 + n_args  # reasoning, the name, the arguments


def test_stored_response_is_retrieved(sim):
    created = post(sim, input="Remember me.", max_output_tokens=5).json()
    got = httpx.get(f"{sim.url}/v1/responses/{created['id']}")
    assert got.status_code == 200 and got.json() == created
    via_sdk = client(sim).responses.retrieve(created["id"])
    assert (
        via_sdk.id == created["id"]
        and via_sdk.output_text == created["output"][1]["content"][0]["text"]
    )


def test_unknown_ids_are_404_with_vllms_error(sim):
    expected = {
        "error": {
            "message": "Response with id 'resp_nope' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }
    r = httpx.get(sim.url + "/v1/responses/resp_nope")
    assert r.status_code == 404 and r.json() == expected
    r = post(sim, input="x", previous_response_id="resp_nope")
    assert r.status_code == 404 and r.json() == expected
    r = httpx.post(sim.url + "/v1/responses/resp_nope/cancel")
    assert r.status_code == 404 and r.json() == expected
    with pytest.raises(openai.NotFoundError):
        client(sim).responses.retrieve("resp_nope")


def test_routes_vllm_does_not_serve(sim):
    created = post(sim, input="x", max_output_tokens=2).json()
    r = httpx.delete(f"{sim.url}/v1/responses/{created['id']}")
    assert r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"}
    r = httpx.get(f"{sim.url}/v1/responses/{created['id']}/input_items")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    assert httpx.get(sim.url + "/v1/responses").status_code == 405


def test_without_the_store_nothing_is_kept(module_sims):
    plain = module_sims(*MODEL, *FAST)
    created = post(plain, input="Forget me.", max_output_tokens=3).json()  # store defaults to true
    assert created["status"] == "incomplete"
    assert httpx.get(f"{plain.url}/v1/responses/{created['id']}").status_code == 404
    chained = post(plain, input="And now?", previous_response_id=created["id"])
    assert chained.status_code == 404 and chained.json()["error"]["param"] == "response_id"
    background = post(plain, input="Later.", background=True)
    err = background.json()["error"]
    assert background.status_code == 400 and err["param"] == "background"
    assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in err["message"]


def test_background_response_completes_and_is_retrieved(slow):
    queued = post(slow, input="In the background.", background=True, max_output_tokens=6).json()
    assert queued["status"] == "queued" and queued["output"] == [] and queued["usage"] is None
    url = f"{slow.url}/v1/responses/{queued['id']}"
    done = wait_until(
        lambda: (r := httpx.get(url).json())["status"] == "incomplete" and r, what="completion"
    )
    assert done["usage"]["output_tokens"] == 6 and done["background"] is True
    r = httpx.post(url + "/cancel")
    assert (
        r.status_code == 400
        and r.json()["error"]["message"] == "Cannot cancel a synchronous response."
    )


def test_cancel_a_background_response_aborts_it(slow):
    aborted = slow.metric("vllm:request_success_total", 'finished_reason="abort"')
    queued = client(slow).responses.create(
        model="qwen3-8b", input="A long one.", background=True, max_output_tokens=400
    )
    wait_until(lambda: slow.metric("vllm:num_requests_running") == 1, what="the request to run")
    cancelled = client(slow).responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert client(slow).responses.retrieve(queued.id).status == "cancelled"
    assert slow.metric("vllm:num_requests_running") == 0
    # An abort: vLLM counts it in no request-level metric.
    assert slow.metric("vllm:request_success_total", 'finished_reason="abort"') == aborted


def test_background_stream_can_be_replayed(slow):
    first = sse_events(
        post(slow, input="Replay me.", background=True, stream=True, max_output_tokens=8)
    )
    assert first[0][0] == "response.created" and first[-1][0] == "response.completed"
    rid = first[0][1]["response"]["id"]
    again = sse_events(
        httpx.get(f"{slow.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": 3})
    )
    assert again == first[4:]


def test_prompt_longer_than_the_context_is_400(sim):
    r = post(sim, input="word " * 5000)
    err = r.json()["error"]
    assert (
        r.status_code == 400 and err["type"] == "BadRequestError" and err["param"] == "input_tokens"
    )
    assert "maximum context length is 4000 tokens" in err["message"]


def test_max_output_tokens_beyond_the_context_is_clamped(sim):
    r = post(sim, input="Short.", max_output_tokens=100_000).json()
    assert r["max_output_tokens"] == 4000 - r["usage"]["input_tokens"]


def test_cached_tokens_are_always_reported(module_sims):
    """Responses report input_tokens_details.cached_tokens even without
    --enable-prompt-tokens-details."""
    plain = module_sims(*MODEL, *FAST)
    long = "You follow the house style guide to the letter. " * 40
    first = post(plain, input="One.", instructions=long, max_output_tokens=2).json()["usage"]
    second = post(plain, input="Two.", instructions=long, max_output_tokens=2).json()["usage"]
    assert first["input_tokens_details"]["cached_tokens"] == 0
    assert (
        0.8 * first["input_tokens"]
        < second["input_tokens_details"]["cached_tokens"]
        < second["input_tokens"]
    )


def test_bad_bodies_are_400(sim):
    assert post(sim).status_code == 400  # no input
    r = post(sim, input="x", background=True, store=False)
    assert r.status_code == 400 and "background can only be used" in r.json()["error"]["message"]
    assert post(sim, input="x", max_output_tokens=0).json()["error"]["type"] == "BadRequestError"
    assert post(sim, model="nope", input="x").status_code == 404


def test_engine_death_mid_stream_drops_the_connection(start_sim):
    """vLLM has no error event on this path: the exception ends the response mid-body. The
    engine dies (SIGUSR2, as --sim-crash-after-* would) once the stream has started."""
    s = start_sim("m", *FAST, "--sim-decode-tps", "20", "--sim-crash-grace-seconds", "1")
    names = []
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream(
            "POST", s.url + "/v1/responses", json={"input": "hi", "stream": True}, timeout=10
        ) as r:
            for line in r.iter_lines():
                if line.startswith("event: "):
                    names.append(line[7:])
                    if names[-1] == "response.output_text.delta" and names.count(names[-1]) == 1:
                        os.kill(s.proc.pid, signal.SIGUSR2)
    assert (
        names[:2] == ["response.created", "response.in_progress"]
        and "response.completed" not in names
    )
