"""The simulator answers like vLLM 0.33: the same checks through the official `openai`
SDK and through raw HTTP (httpx), so both a strict client and the wire agree."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.engine_sim.conftest import FAST

CHAT = [
    "Qwen/Qwen3-8B",
    "--served-model-name",
    "qwen3-8b",
    "alias-b",
    "--max-model-len",
    "1k",
    *FAST,
]
MSGS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tell me about tokens."},
]


@pytest.fixture(scope="module")
def sim(module_sims):
    return module_sims(*CHAT)


def sse(resp: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, in order (keep-alive comments skipped)."""
    return [line[6:] for line in resp.text.split("\n\n") if line.startswith("data: ")]


def raw_chat(sim, **body) -> httpx.Response:
    return httpx.post(
        sim.url + "/v1/chat/completions", json={"model": "qwen3-8b", "messages": MSGS, **body}
    )


def sdk(sim) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)


def chat_nonstream(kind: str, sim, **body) -> dict:
    if kind == "sdk":
        return (
            sdk(sim).chat.completions.create(model="qwen3-8b", messages=MSGS, **body).model_dump()
        )
    r = raw_chat(sim, **body)
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(kind: str, sim, **body) -> list[dict]:
    if kind == "sdk":
        stream = sdk(sim).chat.completions.create(
            model="qwen3-8b", messages=MSGS, stream=True, **body
        )
        return [c.model_dump() for c in stream]
    r = raw_chat(sim, stream=True, **body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = sse(r)
    assert frames[-1] == "[DONE]", "[DONE] must be the last frame"
    assert frames.count("[DONE]") == 1
    return [json.loads(f) for f in frames[:-1]]


both = pytest.mark.parametrize("kind", ["sdk", "http"])


@both
def test_model_list_has_one_card_per_alias(kind, sim):
    if kind == "sdk":
        cards = [m.model_dump() for m in sdk(sim).models.list()]
    else:
        body = httpx.get(sim.url + "/v1/models").json()
        assert body["object"] == "list"
        cards = body["data"]
    assert [c["id"] for c in cards] == ["qwen3-8b", "alias-b"]
    for c in cards:
        assert c["object"] == "model" and c["owned_by"] == "vllm"
        assert c["root"] == "Qwen/Qwen3-8B" and c["max_model_len"] == 1000
        assert c["permission"][0]["object"] == "model_permission"


def test_small_endpoints(sim):
    assert httpx.get(sim.url + "/health").status_code == 200
    assert httpx.get(sim.url + "/version").json() == {"version": "0.33.0"}
    assert httpx.get(sim.url + "/load").json() == {"server_load": 0}
    assert httpx.get(sim.url + "/nope").json() == {"detail": "Not Found"}


@both
def test_chat_nonstream_shape_and_usage(kind, sim):
    body = chat_nonstream(kind, sim)
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) == len("chatcmpl-") + 16
    assert body["object"] == "chat.completion" and body["model"] == "qwen3-8b"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 16 <= u["completion_tokens"] <= 128  # the default natural-length range


@both
def test_chat_stream_order_and_usage(kind, sim):
    chunks = chat_stream(kind, sim, stream_options={"include_usage": True})
    first, *middle, finish, usage = chunks
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == first["id"] for c in chunks)
    assert all(c["choices"][0]["finish_reason"] is None for c in middle)
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == []
    content = [c["choices"][0]["delta"]["content"] for c in middle]
    assert usage["usage"]["completion_tokens"] == len(content)
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + len(content)
    # Deterministic: the same prompt gives the same text as the non-streaming call.
    assert "".join(content) == chat_nonstream(kind, sim)["choices"][0]["message"]["content"]


@both
def test_stream_without_include_usage_has_no_usage(kind, sim):
    chunks = chat_stream(kind, sim)
    assert all(c["choices"] for c in chunks)
    assert all(c.get("usage") is None for c in chunks)


def test_continuous_usage_stats_count_every_token(sim):
    chunks = chat_stream(
        "http",
        sim,
        max_tokens=7,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    running = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    # The role chunk, then 7 tokens; the last carries finish_reason "length" (as vLLM does).
    assert running == [0, 1, 2, 3, 4, 5, 6, 7]
    assert chunks[-1]["usage"]["completion_tokens"] == 7


@both
def test_max_tokens_cuts_with_finish_reason_length(kind, sim):
    body = chat_nonstream(kind, sim, max_tokens=3)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


@both
def test_completions_nonstream_and_stream(kind, sim):
    if kind == "sdk":
        c = sdk(sim).completions
        full = c.create(model="alias-b", prompt="Once upon a time", max_tokens=5).model_dump()
        chunks = [
            x.model_dump()
            for x in c.create(
                model="alias-b",
                prompt="Once upon a time",
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
    else:
        url = sim.url + "/v1/completions"
        full = httpx.post(
            url, json={"model": "alias-b", "prompt": "Once upon a time", "max_tokens": 5}
        ).json()
        frames = sse(
            httpx.post(
                url,
                json={
                    "model": "alias-b",
                    "prompt": "Once upon a time",
                    "max_tokens": 5,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
        )
        assert frames[-1] == "[DONE]"
        chunks = [json.loads(f) for f in frames[:-1]]
    assert full["id"].startswith("cmpl-") and full["object"] == "text_completion"
    assert full["model"] == "alias-b" and full["usage"]["completion_tokens"] == 5
    # vLLM sends a length finish on the last token's chunk, not on a chunk of its own.
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == full["choices"][0]["text"] and len(texts) == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    u = chunks[-1]["usage"]
    assert (u["prompt_tokens"], u["total_tokens"], u["completion_tokens"]) == (
        full["usage"]["prompt_tokens"],
        full["usage"]["total_tokens"],
        5,
    )


def test_prompt_tokens_agree_with_tokenize_and_are_stable(sim):
    counted = httpx.post(sim.url + "/tokenize", json={"model": "qwen3-8b", "messages": MSGS}).json()
    assert counted["max_model_len"] == 1000 and counted["count"] == len(counted["tokens"])
    a = chat_nonstream("http", sim)["usage"]["prompt_tokens"]
    b = chat_nonstream("http", sim)["usage"]["prompt_tokens"]
    assert a == b == counted["count"]
    text = httpx.post(
        sim.url + "/detokenize",
        json={
            "tokens": httpx.post(sim.url + "/tokenize", json={"prompt": "Hello, world!"}).json()[
                "tokens"
            ]
        },
    ).json()
    assert text == {"prompt": "Hello, world!"}


def test_request_id_header_is_honoured_and_echoed(sim):
    r = httpx.post(
        sim.url + "/v1/chat/completions",
        headers={"X-Request-Id": "abc123"},
        json={"model": "qwen3-8b", "messages": MSGS, "max_tokens": 1},
    )
    assert r.json()["id"] == "chatcmpl-abc123"
    assert r.headers["x-request-id"] == "abc123"


def test_model_defaults_to_first_served_name(sim):
    r = httpx.post(sim.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "qwen3-8b"


@pytest.mark.parametrize(
    "body, status, err_type, needle",
    [
        ({"model": "nope", "messages": MSGS}, 404, "NotFoundError", "`nope` does not exist"),
        (
            {"model": "qwen3-8b", "messages": [{"role": "user", "content": "word " * 1200}]},
            400,
            "BadRequestError",
            "This model's maximum context length is 1000 tokens",
        ),
        (
            {"model": "qwen3-8b", "messages": MSGS, "max_tokens": 5000},
            400,
            "BadRequestError",
            "max_tokens=5000 cannot be greater than max_model_len=",
        ),
        (
            {"model": "qwen3-8b", "messages": MSGS, "stream_options": {"include_usage": True}},
            400,
            "BadRequestError",
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        ),
        ({"model": "qwen3-8b"}, 400, "Bad Request", "messages"),
        (
            {"model": "qwen3-8b", "messages": MSGS, "max_tokens": 0},
            400,
            "BadRequestError",
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        ),
    ],
)
def test_error_table_raw(sim, body, status, err_type, needle):
    r = httpx.post(sim.url + "/v1/chat/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] == err_type and err["code"] == status and needle in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    if status == 404:
        assert err["param"] == "model"


def test_errors_through_the_sdk(sim):
    client = sdk(sim)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(
            model="qwen3-8b", messages=[{"role": "user", "content": "x " * 1200}]
        )


def test_invalid_json_is_400(sim):
    r = httpx.post(
        sim.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"


def test_max_tokens_is_clamped_to_the_context_left(sim):
    long = [{"role": "user", "content": "word " * 900}]
    r = httpx.post(
        sim.url + "/v1/chat/completions",
        json={"model": "qwen3-8b", "messages": long, "max_tokens": 900, "ignore_eos": True},
    )
    u = r.json()["usage"]
    assert r.status_code == 200 and u["total_tokens"] == 1000


def test_embeddings_on_a_chat_model_is_404(sim):
    r = httpx.post(sim.url + "/v1/embeddings", json={"model": "qwen3-8b", "input": "x"})
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


def test_metrics_names_and_counters_move(sim):
    before = sim.metric("vllm:generation_tokens_total")
    success = sim.metric("vllm:request_success_total", 'finished_reason="length"')
    chat_nonstream("http", sim, max_tokens=4)
    text = httpx.get(sim.url + "/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:inter_token_latency_seconds_sum",
        "vllm:request_queue_time_seconds_count",
    ):
        assert f'{name}{{engine="0",model_name="qwen3-8b"' in text, name
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert sim.metric("vllm:generation_tokens_total") == before + 4
    assert sim.metric("vllm:request_success_total", 'finished_reason="length"') == success + 1


# --- servers started with other flags ---------------------------------------------------


def test_api_key_protects_v1_only(module_sims):
    s = module_sims("m", "--api-key", "sekret", *FAST)
    r = httpx.get(s.url + "/v1/models")
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert (
        httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer sekret"}).status_code
        == 200
    )
    assert httpx.get(s.url + "/health").status_code == 200
    assert httpx.get(s.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_prompt_tokens_details_report_prefix_cache_hits(module_sims):
    s = module_sims("m", "--enable-prompt-tokens-details", *FAST)
    msgs = [{"role": "user", "content": "shared prefix " * 40}]
    first = httpx.post(
        s.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}
    ).json()
    second = httpx.post(
        s.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}
    ).json()
    written = first["usage"]["prompt_tokens_details"]["created_cache_tokens"]
    assert first["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0,
        "created_cache_tokens": written,
        "multimodal_tokens": None,
    }
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"]
    # The first wrote the full blocks the second reads; the second wrote nothing new.
    assert (
        written == cached and second["usage"]["prompt_tokens_details"]["created_cache_tokens"] == 0
    )
    assert s.metric("vllm:prompt_tokens_cached_total") == cached


@both
def test_reasoning_comes_first_and_is_counted(kind, module_sims):
    s = module_sims(
        "m",
        "--served-model-name",
        "qwen3-8b",
        "--reasoning-parser",
        "qwen3",
        "--sim-reasoning-tokens",
        "5",
        *FAST,
    )
    full = chat_nonstream(kind, s)
    msg = full["choices"][0]["message"]
    assert msg["reasoning"] and msg["content"]
    assert full["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5
    chunks = chat_stream(kind, s, stream_options={"include_usage": True})
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-2]]
    kinds = ["reasoning" if d.get("reasoning") is not None else "content" for d in deltas]
    assert kinds == ["reasoning"] * 5 + ["content"] * (len(deltas) - 5)
    assert "".join(d["reasoning"] for d in deltas[:5]) == msg["reasoning"]
    assert (
        chunks[-1]["usage"]["completion_tokens"]
        == len(deltas)
        == full["usage"]["completion_tokens"]
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


@both
def test_tool_call_nonstream_and_stream(kind, module_sims):
    s = module_sims(
        "m",
        "--served-model-name",
        "qwen3-8b",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        *FAST,
    )
    full = chat_nonstream(kind, s, tools=TOOLS)
    choice = full["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city", "days"}
    chunks = chat_stream(kind, s, tools=TOOLS, stream_options={"include_usage": True})
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[1:-2]]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith(
        "chatcmpl-tool-"
    )
    assert "".join(c["function"]["arguments"] for c in calls) == call["function"]["arguments"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] == len(calls)


def test_auto_tool_choice_without_the_flag_is_400(sim):
    r = raw_chat(sim, tools=TOOLS)
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    named = raw_chat(
        sim, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert (
        named.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    )


def test_embeddings_are_deterministic_unit_vectors(module_sims):
    s = module_sims("BAAI/bge-small-en", "--runner", "pooling", "--sim-embedding-dim", "32", *FAST)
    url = s.url + "/v1/embeddings"
    body = httpx.post(
        url, json={"model": "BAAI/bge-small-en", "input": ["hello world", "other"]}
    ).json()
    a, b = (d["embedding"] for d in body["data"])
    assert body["object"] == "list" and len(a) == 32 and a != b
    assert abs(sum(x * x for x in a) - 1) < 1e-6
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 3
    again = httpx.post(url, json={"input": "hello world"}).json()["data"][0]["embedding"]
    assert again == a
    # The SDK asks for base64 and decodes it: it must land on the same numbers.
    via_sdk = (
        sdk(s).embeddings.create(model="BAAI/bge-small-en", input="hello world").data[0].embedding
    )
    assert via_sdk == pytest.approx(a, abs=1e-6)
    chat = httpx.post(s.url + "/v1/chat/completions", json={"messages": MSGS})
    assert chat.status_code == 404 and chat.json() == {"detail": "Not Found"}


def test_stop_string_ends_the_reply_before_it(sim):
    full = chat_nonstream("http", sim)["choices"][0]["message"]["content"]
    word = full.split()[3]
    cut = chat_nonstream("http", sim, stop=[" " + word])
    choice = cut["choices"][0]
    assert choice["message"]["content"] == full[: full.index(" " + word)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == " " + word
