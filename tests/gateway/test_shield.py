"""The engine shield (gateway/shield.py, gateway/shield_policy.py): every rule on every API,
the per-model allowance, the engine's own paths, and no false positives for what the openai
and anthropic SDKs send.

The rules are checked on the checker itself (fast); the end-to-end tests send requests
through the real gateway (gunicorn) to the simulator engine, or to a canary that records
every request reaching it (tests/gateway/conftest.py)."""

from __future__ import annotations

import copy
import http.server
import socket
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import orjson
import pytest
from anthropic.types import message_count_tokens_params, message_create_params
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from core.keyspace import usage_stream
from core.redis import get_redis
from deployments import services as deployment_services
from deployments.models import Node
from gateway import shield
from gateway.app import Gateway
from gateway.shield_policy import ENGINE_PATHS, ENGINE_V1_PATHS, POLICY, render_doc
from gateway.state import ModelInfo
from tests.gateway.conftest import (
    METRICS_TOKEN,
    World,
    add_routed_model,
    deploy,
    free_port,
    make_model,
    wait_until_served,
)

ROOT = Path(__file__).resolve().parents[2]
BOUNDS = shield.Bounds(
    n=8,
    logprobs=20,
    items=10_000,
    tools=128,
    schema_bytes=64 * 1024,
    schema_depth=32,
    choices=4096,
    repeat=10_000,
)
MODEL = ModelInfo(1, "qwen3-8b", "generate", 32768, 0)
HELLO = [{"role": "user", "content": "Hello"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 200, "pattern": "^[A-Z][a-z]+$"},
        "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather.", "parameters": SCHEMA},
}


def check(api: str, body: dict, model: ModelInfo = MODEL) -> tuple[tuple | None, bool]:
    return shield.check(body, api, model, BOUNDS)


def refusal(api: str, body: dict, model: ModelInfo = MODEL) -> dict:
    problem, _ = check(api, body, model)
    assert problem is not None, f"{body} passed"
    status, raw = problem
    assert status == 400
    error = orjson.loads(raw)["error"]
    assert error["type"] == "invalid_request_error"
    return error


# --- What ordinary clients send passes unchanged ---------------------------------------------

ORDINARY = [
    (
        "chat",
        {
            "model": "qwen3-8b",
            "messages": HELLO,
            "tools": [CHAT_TOOL],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True},
            },
            "logprobs": True,
            "top_logprobs": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 2,
            "seed": 7,
            "stop": ["\n\n", "END"],
            "user": "u-42",
            "temperature": 0.2,
            "top_p": 0.9,
            "max_completion_tokens": 512,
            "presence_penalty": 0.1,
            "frequency_penalty": 0.1,
            "logit_bias": {"50256": -100},
            "reasoning_effort": "low",
        },
    ),
    (
        "chat",
        {
            "model": "qwen3-8b",
            "messages": HELLO,
            "max_tokens": 64,
            "top_k": 40,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "stop_token_ids": [2],
            "ignore_eos": False,
            "min_tokens": 1,
            "skip_special_tokens": True,
            "include_stop_str_in_output": False,
            "chat_template_kwargs": {"enable_thinking": False},
            "structured_outputs": {"json": SCHEMA},
            "priority": "P2",
            "return_token_ids": True,
            "prompt_logprobs": 1,
            "truncate_prompt_tokens": -1,
            "cache_salt": "tenant-salt",
        },
    ),
    ("chat", {"model": "qwen3-8b", "messages": HELLO, "structured_outputs": {"regex": r"\d{3}"}}),
    ("chat", {"model": "qwen3-8b", "messages": HELLO, "structured_outputs": {"choice": ["y"]}}),
    (
        "chat",
        {"model": "qwen3-8b", "messages": HELLO, "guided_json": orjson.dumps(SCHEMA).decode()},
    ),
    (
        "completions",
        {
            "model": "qwen3-8b",
            "prompt": ["Once", "upon"],
            "max_tokens": 16,
            "logprobs": 5,
            "echo": True,
            "suffix": ".",
            "best_of": 2,
            "n": 2,
            "stop": "\n",
            "stream": False,
            "temperature": 0,
            "response_format": {"type": "json_object"},
        },
    ),
    (
        "responses",
        {
            "model": "qwen3-8b",
            "input": [{"role": "user", "content": "Weather in Oslo?"}],
            "instructions": "Be brief.",
            "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
            "tool_choice": "auto",
            "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}},
            "reasoning": {"effort": "low"},
            "max_output_tokens": 256,
            "store": True,
            "previous_response_id": "resp_0123",
            "metadata": {"run": "7"},
            "truncation": "disabled",
            "top_logprobs": 2,
            "include": ["reasoning.encrypted_content"],
            "stream": True,
        },
    ),
    (
        "messages",
        {
            "model": "qwen3-8b",
            "max_tokens": 2048,
            "system": [{"type": "text", "text": "You are terse."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "tools": [{"name": "get_weather", "input_schema": SCHEMA}],
            "tool_choice": {"type": "auto"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "stop_sequences": ["###"],
            "metadata": {"user_id": "u-42"},
            "temperature": 0.5,
            "top_k": 20,
            "top_p": 0.9,
            "stream": True,
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        },
    ),
    (
        "count_tokens",
        {
            "model": "qwen3-8b",
            "messages": [{"role": "user", "content": "Hi"}],
            "system": "Terse.",
            "tools": [{"name": "get_weather", "input_schema": SCHEMA}],
        },
    ),
    (
        "embeddings",
        {
            "model": "qwen3-8b",
            "input": ["one", "two"],
            "dimensions": 256,
            "encoding_format": "base64",
            "user": "u",
        },
    ),
    ("rerank", {"model": "qwen3-8b", "query": "q", "documents": ["a", "b"], "top_n": 1}),
    ("score", {"model": "qwen3-8b", "text_1": "q", "text_2": ["a", "b"]}),
]


@pytest.mark.parametrize(
    ("api", "body"), ORDINARY, ids=[f"{a}-{i}" for i, (a, _) in enumerate(ORDINARY)]
)
def test_ordinary_requests_of_every_api_pass_unchanged(api: str, body: dict) -> None:
    given = copy.deepcopy(body)
    assert check(api, given) == (None, False)
    assert given == body


@pytest.mark.parametrize(
    ("api", "params"),
    [
        ("chat", chat_create_params.CompletionCreateParamsStreaming),
        ("completions", completion_create_params.CompletionCreateParamsStreaming),
        ("embeddings", embedding_create_params.EmbeddingCreateParams),
        ("responses", response_create_params.ResponseCreateParamsStreaming),
        ("messages", message_create_params.MessageCreateParamsStreaming),
        ("count_tokens", message_count_tokens_params.MessageCountTokensParams),
    ],
)
def test_every_parameter_the_sdks_can_send_has_a_written_treatment(api: str, params: type) -> None:
    """No SDK parameter meets "Unrecognized request argument": each is forwarded, dropped or
    refused with its own reason (the installed openai and anthropic packages' own lists)."""
    assert set(params.__annotations__) - set(POLICY[api]) == set()


# --- Bounds ------------------------------------------------------------------------------------


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


REFUSED = [
    # (api, fields added to an ordinary body, param, words the message must hold, code)
    ("chat", {"n": 9}, "n", "`n` must be a whole number from 1 to 8", "invalid_value"),
    ("chat", {"n": "2"}, "n", "whole number", "invalid_value"),
    ("completions", {"best_of": 50}, "best_of", "from 1 to 8", "invalid_value"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0 to 20", "invalid_value"),
    ("chat", {"top_logprobs": -1}, "top_logprobs", "0 to 20", "invalid_value"),
    ("chat", {"prompt_logprobs": -1}, "prompt_logprobs", "0 to 20", "invalid_value"),
    ("completions", {"logprobs": 100}, "logprobs", "0 to 20", "invalid_value"),
    ("chat", {"max_tokens": 32769}, "max_tokens", "context length", "invalid_value"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens", "1 to 32768", "invalid_value"),
    ("chat", {"max_tokens": True}, "max_tokens", "whole number", "invalid_value"),
    ("chat", {"min_tokens": 10**9}, "min_tokens", "context length", "invalid_value"),
    ("responses", {"max_output_tokens": -5}, "max_output_tokens", "1 to 32768", "invalid_value"),
    ("messages", {"max_tokens": 10**7}, "max_tokens", "context length", "invalid_value"),
    ("chat", {"stop": ["x"] * 17}, "stop", "at most 16 items", "invalid_value"),
    (
        "chat",
        {"logit_bias": {str(i): 1 for i in range(1025)}},
        "logit_bias",
        "1024",
        "invalid_value",
    ),
    ("chat", {"logit_bias": {"1": 1e9}}, "logit_bias", "-100 to 100", "invalid_value"),
    ("chat", {"messages": HELLO * 10_001}, "messages", "10000 items", "invalid_value"),
    ("embeddings", {"input": ["x"] * 10_001}, "input", "10000 items", "invalid_value"),
    ("rerank", {"documents": ["d"] * 10_001}, "documents", "10000 items", "invalid_value"),
    ("chat", {"tools": [CHAT_TOOL] * 129}, "tools", "at most 128 tools", "invalid_value"),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
        "response_format",
        "must be a JSON schema",
        "invalid_value",
    ),
    (
        "chat",
        {"structured_outputs": {"json": nested_schema(40)}},
        "structured_outputs",
        "nested more than 32 levels",
        "invalid_value",
    ),
    (
        "chat",
        {"structured_outputs": {"json": {"enum": [f"v{i}" for i in range(5000)]}}},
        "structured_outputs",
        "5000 alternatives: at most 4096",
        "invalid_value",
    ),
    (
        "chat",
        {"guided_json": {"description": "x" * 70_000}},
        "guided_json",
        "bytes: at most 65536",
        "invalid_value",
    ),
    ("chat", {"guided_json": "{not json"}, "guided_json", "JSON schema", "invalid_value"),
    (
        "chat",
        {"structured_outputs": {"regex": "(a{1000}){1000}"}},
        "structured_outputs",
        "multiply to 1000000",
        "invalid_value",
    ),
    ("chat", {"guided_regex": "(unbalanced"}, "guided_regex", "parentheses", "invalid_value"),
    (
        "chat",
        {"structured_outputs": {"grammar": 'root ::= "a"{100000}'}},
        "structured_outputs",
        "100000 times",
        "invalid_value",
    ),
    (
        "chat",
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
        "exactly one of",
        "invalid_value",
    ),
    (
        "chat",
        {"structured_outputs": {"json": SCHEMA, "backend": "outlines"}},
        "structured_outputs",
        "not a structured-output option",
        "invalid_value",
    ),
    (
        "chat",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"p": {"type": "string", "pattern": "(x{200}){200}"}},
                        },
                    },
                }
            ]
        },
        "tools",
        "multiply to 40000",
        "invalid_value",
    ),
    (
        "messages",
        {"tools": [{"name": "f", "input_schema": {"description": "x" * 70_000}}]},
        "tools",
        "`tools[0].input_schema` is 70018 bytes: at most 65536",
        "invalid_value",
    ),
    (
        "responses",
        {"tools": [{"type": "function", "name": "f", "parameters": "not a schema"}]},
        "tools",
        "`tools[0].parameters` must be a JSON schema",
        "invalid_value",
    ),
    (
        "responses",
        {"tools": [{"type": "mcp", "server_url": "http://169.254.169.254/", "server_label": "x"}]},
        "tools",
        "is a `mcp` tool: only function tools",
        "invalid_value",
    ),
    (
        "messages",
        {"thinking": {"type": "enabled", "budget_tokens": 10**8}},
        "thinking.budget_tokens",
        "`thinking.budget_tokens` must be a whole number from 1 to 32768",
        "invalid_value",
    ),
    (
        "messages",
        {"output_config": {"format": {"type": "json_schema", "schema": "nope"}}},
        "output_config",
        "must be a JSON schema",
        "invalid_value",
    ),
    (
        "responses",
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": nested_schema(33)}}},
        "text",
        "nested more than 32 levels",
        "invalid_value",
    ),
    # Refused on purpose.
    (
        "chat",
        {"chat_template": "{{ 7 * 7 }}"},
        "chat_template",
        "ask your administrator",
        "unsupported_parameter",
    ),
    (
        "embeddings",
        {"chat_template": "{{ x }}"},
        "chat_template",
        "ask your administrator",
        "unsupported_parameter",
    ),
    (
        "messages",
        {"chat_template_kwargs": {"chat_template": "{{ x }}"}},
        "chat_template_kwargs",
        "`chat_template_kwargs.chat_template` is not accepted",
        "unsupported_parameter",
    ),
    (
        "chat",
        {"chat_template_kwargs": {"tokenize": True}},
        "chat_template_kwargs",
        "every model takes enable_thinking",
        "unsupported_parameter",
    ),
    (
        "chat",
        {"chat_template_kwargs": {"enable_thinking": {"x": 1}}},
        "chat_template_kwargs",
        "must be true, false, a number",
        "invalid_value",
    ),
    (
        "chat",
        {"mm_processor_kwargs": {"num_crops": 10**6}},
        "mm_processor_kwargs",
        "ask your administrator",
        "unsupported_parameter",
    ),
    (
        "responses",
        {"media_io_kwargs": {"video": {"num_frames": 10**6}}},
        "media_io_kwargs",
        "ask your administrator",
        "unsupported_parameter",
    ),
    (
        "chat",
        {"vllm_xargs": {"a": 1}},
        "vllm_xargs",
        "ask your administrator",
        "unsupported_parameter",
    ),
    (
        "chat",
        {"kv_transfer_params": {"remote_host": "10.0.0.1"}},
        "kv_transfer_params",
        "disaggregated-serving",
        "unsupported_parameter",
    ),
    (
        "messages",
        {"ec_transfer_params": {}},
        "ec_transfer_params",
        "disaggregated-serving",
        "unsupported_parameter",
    ),
    (
        "chat",
        {"request_id": "another-tenants-id"},
        "request_id",
        "X-Request-Id",
        "unsupported_parameter",
    ),
    ("responses", {"request_id": "resp_x"}, "request_id", "X-Request-Id", "unsupported_parameter"),
    (
        "chat",
        {"return_prompt_text": True},
        "return_prompt_text",
        "debugging",
        "unsupported_parameter",
    ),
    (
        "completions",
        {"prompt_embeds": "AAAA"},
        "prompt_embeds",
        "CVE-2025-62164",
        "unsupported_parameter",
    ),
    (
        "chat",
        {"guided_decoding_backend": "outlines"},
        "guided_decoding_backend",
        "administrator's choice",
        "unsupported_parameter",
    ),
    ("chat", {"functions": [{"name": "f"}]}, "functions", "use `tools`", "unsupported_parameter"),
    (
        "responses",
        {"conversation": "conv_1"},
        "conversation",
        "previous_response_id",
        "unsupported_parameter",
    ),
    (
        "messages",
        {"mcp_servers": [{"url": "http://x"}]},
        "mcp_servers",
        "MCP",
        "unsupported_parameter",
    ),
    (
        "responses",
        {"previous_input_messages": []},
        "previous_input_messages",
        "internal",
        "unsupported_parameter",
    ),
    # Unknown: refused as OpenAI and Anthropic refuse them.
    (
        "chat",
        {"tokenizer": "gpt2"},
        "tokenizer",
        "Unrecognized request argument supplied: tokenizer",
        "unknown_parameter",
    ),
    ("messages", {"n": 2}, "n", "Unrecognized request argument supplied: n", "unknown_parameter"),
    ("embeddings", {"max_tokens": 5}, "max_tokens", "Unrecognized", "unknown_parameter"),
    ("rerank", {"chat_template": "x"}, "chat_template", "Unrecognized", "unknown_parameter"),
    ("count_tokens", {"max_tokens": 5}, "max_tokens", "Unrecognized", "unknown_parameter"),
]
BASE = {
    "chat": {"model": "qwen3-8b", "messages": HELLO},
    "completions": {"model": "qwen3-8b", "prompt": "Hi"},
    "responses": {"model": "qwen3-8b", "input": "Hi"},
    "messages": {"model": "qwen3-8b", "messages": HELLO, "max_tokens": 64},
    "count_tokens": {"model": "qwen3-8b", "messages": HELLO},
    "embeddings": {"model": "qwen3-8b", "input": "Hi"},
    "rerank": {"model": "qwen3-8b", "query": "q", "documents": ["d"]},
    "score": {"model": "qwen3-8b", "text_1": "q", "text_2": "d"},
}


@pytest.mark.parametrize(("api", "fields", "param", "words", "code"), REFUSED)
def test_each_rule_refuses_naming_the_field_and_its_bound(
    api: str, fields: dict, param: str, words: str, code: str
) -> None:
    error = refusal(api, {**BASE[api], **fields})
    assert error["param"] == param
    assert words in error["message"], error["message"]
    assert error["code"] == code


def test_every_api_has_an_ordinary_body_and_a_refusal_here() -> None:
    assert {api for api, _ in ORDINARY} == set(POLICY)
    assert {api for api, *_ in REFUSED} >= set(POLICY) - {"score"}


@pytest.mark.parametrize(
    ("api", "field", "value"),
    [
        ("chat", "api_base", "http://169.254.169.254/"),
        ("chat", "extra_headers", {"Host": "internal"}),
        ("chat", "metadata", {"k": "v"}),
        ("chat", "store", True),
        ("chat", "service_tier", "flex"),
        ("responses", "stream_options", {"include_obfuscation": False}),
        ("messages", "service_tier", "auto"),
        ("messages", "cache_control", {"type": "ephemeral"}),
        ("rerank", "return_documents", True),
        ("embeddings", "base_url", "http://x"),
    ],
)
def test_hints_and_redirect_settings_are_dropped_and_the_rest_kept(
    api: str, field: str, value: object
) -> None:
    body = {**BASE[api], field: value}
    assert check(api, body) == (None, True)
    assert body == BASE[api]


def test_null_fields_count_as_not_given() -> None:
    body = {**BASE["chat"], "n": None, "chat_template": None, "response_format": None}
    assert check("chat", body) == (None, False)


# --- The per-model allowance ---------------------------------------------------------------


def allowing(*fields: str) -> ModelInfo:
    return ModelInfo(1, "qwen3-8b", "generate", 32768, 0, allowed_fields=frozenset(fields))


def test_an_allowed_field_passes_for_that_model_only() -> None:
    body = {**BASE["chat"], "chat_template": "{{ messages }}", "mm_processor_kwargs": {"a": 1}}
    assert check("chat", dict(body), allowing("chat_template", "mm_processor_kwargs")) == (
        None,
        False,
    )
    error = refusal("chat", dict(body), allowing("chat_template"))
    assert error["param"] == "mm_processor_kwargs"
    assert "`qwen3-8b`" in error["message"]


def test_template_kwargs_keys_are_allowed_one_by_one_or_all() -> None:
    body = {**BASE["chat"], "chat_template_kwargs": {"documents_mode": ["rag"], "thinking": True}}
    assert refusal("chat", dict(body))["message"].startswith(
        "`chat_template_kwargs.documents_mode` is not accepted for the model `qwen3-8b`"
    )
    assert check("chat", dict(body), allowing("chat_template_kwargs.documents_mode"))[0] is None
    assert check("chat", dict(body), allowing("chat_template_kwargs"))[0] is None
    assert refusal("chat", dict(body), allowing("chat_template_kwargs.other"))


# --- Pieces --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "copies"),
    [
        (r"\d{3}-\d{4}", 4),
        (r"(a{10}){20}", 200),
        (r"((ab){3}c){5}|x{7}", 15),
        (r"[({]{2}\{{9}", 9),  # braces and parentheses inside a class or escaped count nothing
        (r"a{5,}", 5),
        (r"(?:x|y){2,50}(z{3}){4}", 50),
        (r"\(", 1),
        (r"(a", None),
        (r"a)", None),
    ],
)
def test_regex_copies_multiplies_nested_counted_repetitions(pattern: str, copies: int) -> None:
    assert shield.regex_copies(pattern) == copies


def test_a_body_deeper_than_the_gateway_can_write_again_is_found() -> None:
    deep = b'{"model":"m","user":' + b"[" * 300 + b"]" * 300 + b"}"
    assert shield.too_deep(deep, orjson.loads(deep))
    shallow = b'{"model":"m","messages":' + orjson.dumps(HELLO * 400) + b"}"
    assert not shield.too_deep(shallow, orjson.loads(shallow))  # many brackets, none deep


def test_the_docs_tables_are_the_policy() -> None:
    page = ROOT / "docs/admins/engine-shield.md"
    text = page.read_text()
    for api in POLICY:
        assert f"<!-- shield:{api} -->" in text, f"the page has no table for {api}"
    assert render_doc(text) == text, (
        "docs/admins/engine-shield.md does not match gateway/shield_policy.py: run "
        "`python -m gateway.shield_policy docs/admins/engine-shield.md`"
    )


TRICKS = [
    "/TOKENIZE",
    "//tokenize",
    "/tokenize/",
    "/./tokenize",
    "/v1/../tokenize",
    "/x/../sleep",
    "/v2/rerank",
    "/inference/v1/generate",
    "//v1/chat/completions",
    "/V1/chat/completions",
]


@pytest.mark.parametrize("path", sorted(ENGINE_PATHS) + list(ENGINE_V1_PATHS) + TRICKS)
def test_the_gateway_answers_every_engine_path_itself(path: str) -> None:
    assert Gateway.handles(path)


@pytest.mark.parametrize(
    "path", ["/", "/models/", "/models/3/edit", "/api/v1/models/", "/healthz", "/v1/files"]
)
def test_the_consoles_paths_stay_the_consoles(path: str) -> None:
    assert not Gateway.handles(path)


# --- Through the gateway -------------------------------------------------------------------

pytestmark_e2e = pytest.mark.django_db(transaction=True)


def usage_count() -> int:
    return get_redis().xlen(usage_stream())


def rejections(url: str, tenant: str, reason: str) -> float:
    text = httpx.get(
        f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10
    ).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("tollgate_rejections_total{") and f'reason="{reason}"' in line:
            if f'tenant="{tenant}"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytestmark_e2e
def test_sdk_requests_with_tools_schemas_and_logprobs_pass_through(world: World) -> None:
    client = openai.OpenAI(base_url=world.v1, api_key=world.key_a, max_retries=0)
    chat = client.chat.completions.create(
        model="sim-chat",
        messages=HELLO,
        tools=[CHAT_TOOL],
        tool_choice="none",  # the simulator runs without a tool-call parser
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True},
        },
        logprobs=True,
        top_logprobs=3,
        max_tokens=8,
        seed=1,
        stop=["\n\n"],
        user="u-1",
        metadata={"run": "shield"},  # an OpenAI hint: dropped, not refused
        extra_body={"top_k": 20, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert chat.choices[0].finish_reason in ("stop", "length", "tool_calls")
    stream = client.chat.completions.create(
        model="sim-chat",
        messages=HELLO,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    completion = client.completions.create(
        model="sim-chat", prompt="Hi", max_tokens=4, logprobs=2, echo=False
    )
    assert completion.choices[0].text
    embedding = client.embeddings.create(model="sim-embed", input=["a", "b"])
    assert len(embedding.data) == 2
    claude = anthropic.Anthropic(base_url=world.url, api_key=world.key_a, max_retries=0)
    message = claude.messages.create(
        model="sim-chat",
        max_tokens=16,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hi"}],
        tools=[{"name": "get_weather", "input_schema": SCHEMA}],
        tool_choice={"type": "none"},
        stop_sequences=["###"],
        metadata={"user_id": "u-1"},
    )
    assert message.usage.output_tokens > 0
    counted = claude.messages.count_tokens(
        model="sim-chat", messages=[{"role": "user", "content": "Hi"}]
    )
    assert counted.input_tokens > 0


@pytestmark_e2e
def test_refusals_come_in_each_apis_shape_bill_nothing_and_are_counted(world: World) -> None:
    before_usage = usage_count()
    before = rejections(world.url, "acme", "engine_shield")
    headers = {"Authorization": f"Bearer {world.key_a}"}
    openai_style = httpx.post(
        f"{world.v1}/chat/completions",
        json={"model": "sim-chat", "messages": HELLO, "n": 1000},
        headers=headers,
        timeout=30,
    )
    assert openai_style.status_code == 400
    assert openai_style.json()["error"] == {
        "message": "`n` must be a whole number from 1 to 8 on this appliance.",
        "type": "invalid_request_error",
        "param": "n",
        "code": "invalid_value",
    }
    claude = anthropic.Anthropic(base_url=world.url, api_key=world.key_a, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model="sim-chat",
            max_tokens=16,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={
                "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}{% endfor %}"}
            },
        )
    body = caught.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(
        "`chat_template_kwargs.chat_template` is not accepted for the model `sim-chat`: ask your "
        "administrator"
    )
    client = openai.OpenAI(base_url=world.v1, api_key=world.key_a, max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model="sim-chat",
            input="Hi",
            tools=[{"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:1/"}],
        )
    assert refused.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.embeddings.create(model="sim-embed", input="x", extra_body={"tokenizer": "x"})
    assert unknown.value.body["code"] == "unknown_parameter"

    def counted() -> bool:
        return rejections(world.url, "acme", "engine_shield") - before >= 4

    deadline = time.monotonic() + 10
    while not counted() and time.monotonic() < deadline:
        time.sleep(0.2)  # the gateway's metrics flush at most a second later
    assert counted()
    assert usage_count() == before_usage  # nothing was billed


@pytestmark_e2e
def test_json_nested_too_deep_is_a_400_not_a_server_error(world: World) -> None:
    """orjson reads 1,024 levels and writes 254: a stream is written again for the engine, so
    300 levels used to end in a 500 there."""
    for nesting in (300, 10_000):
        body = (
            b'{"model":"sim-chat","stream":true,"messages":[{"role":"user","content":"x"}],'
            b'"user":' + b"[" * nesting + b"]" * nesting + b"}"
        )
        answer = httpx.post(
            f"{world.v1}/chat/completions",
            content=body,
            headers={"Authorization": f"Bearer {world.key_a}"},
            timeout=30,
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["type"] == "invalid_request_error"


class Canary(http.server.BaseHTTPRequestHandler):
    """An "engine" that records every request reaching it."""

    hits: list[str] = []

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._answer()

    def _answer(self) -> None:
        Canary.hits.append(f"{self.command} {self.path}")
        # With its usage: the gateway asks no tokenizer of its own to count the prompt.
        body = (
            b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"y",'
            b'"finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
            b'"total_tokens":2}}'
        )
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def raw_request(
    url: str, method: str, target: str, headers: dict[str, str], body: bytes
) -> tuple[int, bytes]:
    """A request line sent byte for byte (clients normalise paths; attackers do not)."""
    host, port = url.removeprefix("http://").split(":")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}:{port}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall("\r\n".join(lines).encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        rest = dechunked(rest)
    return int(head.split()[1]), rest


def dechunked(data: bytes) -> bytes:
    body = b""
    while data:
        size, _, data = data.partition(b"\r\n")
        length = int(size, 16)
        if not length:
            break
        body, data = body + data[:length], data[length + 2 :]
    return body


@pytestmark_e2e
def test_the_engines_own_endpoints_answer_404_and_never_reach_it(world: World) -> None:
    canary = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Canary)
    threading.Thread(target=canary.serve_forever, daemon=True).start()
    Canary.hits = []
    try:
        add_routed_model(world, "canary", canary.server_address[1])
        headers = {"Authorization": f"Bearer {world.key_a}", "Content-Type": "application/json"}
        body = orjson.dumps(
            {
                "model": "canary",
                "prompt": "x",
                "messages": HELLO,
                "chat_template": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
                "tools": [CHAT_TOOL],
                "lora_name": "x",
                "lora_path": "/etc",
            }
        )
        targets = (
            sorted(ENGINE_PATHS)
            + list(ENGINE_V1_PATHS)
            + TRICKS
            + [
                "/v1/%2e%2e/tokenize",
                "/v1/chat/completions/../../tokenize",
                "/v1/chat/completions/%2e%2e/%2e%2e/tokenize",
                "/v1/completions/..%2f..%2ftokenize",
            ]
        )
        for target in targets:
            status, answer = raw_request(world.url, "POST", target, headers, body)
            error = orjson.loads(answer)["error"]
            assert error["type"] == "invalid_request_error"
            if target.startswith("/v1/responses/"):
                # The kept-responses route: /v1/responses/{id} takes GET and DELETE only.
                assert (status, error["message"]) == (
                    405,
                    f"Method POST is not allowed on {target}.",
                )
                continue
            assert status == 404, (target, status, answer[:200])
            assert error["message"].startswith("Invalid URL (POST "), error
        status, _ = raw_request(world.url, "GET", "/tokenize", headers, b"")
        assert status == 404
        assert Canary.hits == []
        # The canary is reachable: a completion for its model arrives at the fixed path.
        status, _ = raw_request(
            world.url,
            "POST",
            "/v1/completions",
            headers,
            orjson.dumps({"model": "canary", "prompt": "x", "max_tokens": 1}),
        )
        assert Canary.hits == ["POST /v1/completions"]
    finally:
        canary.shutdown()


@pytestmark_e2e
def test_an_admins_allowance_reaches_the_gateway_and_can_be_taken_back(world: World) -> None:
    body = {
        "model": "sim-chat",
        "messages": HELLO,
        "max_tokens": 4,
        "chat_template_kwargs": {"documents_mode": "inline"},
    }
    headers = {"Authorization": f"Bearer {world.key_a}"}

    def status() -> int:
        return httpx.post(
            f"{world.v1}/chat/completions", json=body, headers=headers, timeout=30
        ).status_code

    def becomes(expected: int) -> None:
        deadline, streak = time.monotonic() + 30, 0
        while streak < 6 and time.monotonic() < deadline:  # both workers have reloaded
            streak = streak + 1 if status() == expected else 0
            time.sleep(0.05)
        assert streak >= 6, f"still not {expected}"

    assert status() == 400
    deployment_services.update_model(
        None, world.chat, allowed_request_fields=["chat_template_kwargs.documents_mode"]
    )
    becomes(200)
    deployment_services.update_model(None, world.chat, allowed_request_fields=[])
    becomes(400)


@pytestmark_e2e
def test_an_allowance_is_the_models_own_not_its_engines(world: World, engines: dict) -> None:
    """A field allowed for one catalogue model stays refused for another model served by the
    very same engine."""
    other = make_model("sim-other")
    deploy(other, Node.objects.get(name="sim-node"), engines["chat"].port)
    wait_until_served(world.url, world.key_a, "sim-other")
    deployment_services.update_model(None, world.chat, allowed_request_fields=["vllm_xargs"])
    headers = {"Authorization": f"Bearer {world.key_a}"}
    body = {"messages": HELLO, "max_tokens": 4, "vllm_xargs": {"k": 1}}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        allowed = httpx.post(
            f"{world.v1}/chat/completions",
            json={**body, "model": "sim-chat"},
            headers=headers,
            timeout=30,
        )
        if allowed.status_code == 200:
            break
        time.sleep(0.1)
    assert allowed.status_code == 200
    other_answer = httpx.post(
        f"{world.v1}/chat/completions",
        json={**body, "model": "sim-other"},
        headers=headers,
        timeout=30,
    )
    assert other_answer.status_code == 400
    assert other_answer.json()["error"]["param"] == "vllm_xargs"
