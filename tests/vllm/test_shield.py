"""The engine shield against the real engine: a battery of hostile request bodies sent
through the gateway to vLLM (the stage's shared engine), built from families — the published
advisories' shapes (a request's own chat template that hangs or escapes, structured outputs
that crash or stall the engine, /tokenize with a template and tools), oversized and deeply
nested schemas, huge n and logprobs, lists of a million entries, bad max_tokens, JSON that
nests ten thousand deep, fields for engine internals, the engine's admin and debugging
routes — on every API.

Each one is refused with a 4xx in its API's shape that names what was wrong, or made safe
(answered 2xx with the unsafe part dropped or replaced, or bounded so the engine answers it
in well under a second): the table printed at the end says which. Meanwhile another tenant
sends ordinary requests; all must succeed, and their latency during the battery (sent
``ROUNDS`` times, four bodies at a time, so that there is a while to time) is compared with
a quiet baseline of the same run. Afterwards the engine is healthy and answers.

The embeddings and rerank bodies go to catalogue entries of those tasks served by the same
(generation) engine: a pooling engine of its own would cost this stage a second engine
start. A body the shield let through would reach that engine and be answered by its own
404 (it serves no such route), never by the shield's 400, so those cases still fail if the
shield misses them.
"""

from __future__ import annotations

import http.client
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from deployments import services as deployment_services
from deployments.choices import Task
from gateway.shield_policy import POLICY
from tenants import services as tenant_services
from tests.gateway.conftest import (  # noqa: F401
    deploy,
    gateway_url,
    redis_namespace,
    wait_until_served,
)
from tests.vllm.conftest import CONTEXT, SERVED_NAME, RealEngine, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

EMBED, RERANK = "tiny-embed", "tiny-rerank"
HELLO = [{"role": "user", "content": "Hello there."}]
LOOP = "{% for i in range(10**12) %}x{% endfor %}"
RECURSION = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
ESCAPE = "{{ cycler.__init__.__globals__.os.popen('id').read() }}"
METADATA_URL = "http://169.254.169.254/latest/meta-data/"
ROUNDS = 3
MAX_ROUNDS = 12
SAMPLES = 20  # the bystander's requests timed during the battery


@dataclass
class Case:
    """One hostile request: where it goes, and what must come of it."""

    family: str
    name: str
    api: str
    body: Any  # a dict (sent as JSON) or raw bytes
    names: str = ""  # the field the refusal must name ("" : made safe, 2xx)
    path: str = ""  # another path than the API's (the engine's own routes)
    status: int = 400
    safe: str = ""  # how it is made safe (for the table)
    result: tuple[int, str] | None = field(default=None, repr=False)


PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
    "embeddings": "/v1/embeddings",
    "rerank": "/v1/rerank",
    "score": "/v1/score",
}
BASE = {
    "chat": {"model": SERVED_NAME, "messages": HELLO, "max_tokens": 4},
    "completions": {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4},
    "responses": {"model": SERVED_NAME, "input": "Hello", "max_output_tokens": 4, "store": False},
    "messages": {"model": SERVED_NAME, "messages": HELLO, "max_tokens": 4},
    "count_tokens": {"model": SERVED_NAME, "messages": HELLO},
    "embeddings": {"model": EMBED, "input": "Hello"},
    "rerank": {"model": RERANK, "query": "q", "documents": ["a", "b"]},
    "score": {"model": RERANK, "text_1": "q", "text_2": "a"},
}


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def enum(count: int) -> dict:
    return {"enum": [f"value-{i}" for i in range(count)]}


def deep_array(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def refused(family: str, name: str, api: str, names: str, **fields: Any) -> Case:
    return Case(family, name, api, {**BASE[api], **fields}, names)


def made_safe(family: str, name: str, api: str, safe: str, **fields: Any) -> Case:
    return Case(family, name, api, {**BASE[api], **fields}, "", status=200, safe=safe)


def so(api: str, **constraint: Any) -> dict:
    """A structured-output constraint in the API's own field."""
    return {"structured_outputs": constraint}


def battery() -> list[Case]:
    cases: list[Case] = []
    add = cases.append
    # -- The advisories' shapes: a request's own chat template (hangs, recursion, escapes).
    for api in ("chat", "embeddings"):
        add(refused("template", "loop", api, "chat_template", chat_template=LOOP))
    add(refused("template", "recursion", "chat", "chat_template", chat_template=RECURSION))
    add(refused("template", "escape", "chat", "chat_template", chat_template=ESCAPE))
    for api in ("chat", "responses", "messages", "count_tokens", "rerank", "score", "embeddings"):
        add(
            refused(
                "template",
                "kwargs.chat_template",
                api,
                "chat_template_kwargs.chat_template",
                chat_template_kwargs={"chat_template": LOOP},
            )
        )
    add(
        refused(
            "template",
            "kwargs.tokenize",
            "chat",
            "chat_template_kwargs.tokenize",
            chat_template_kwargs={"tokenize": True, "return_dict": True},
        )
    )
    add(
        refused(
            "template",
            "kwargs nested value",
            "chat",
            "chat_template_kwargs.enable_thinking",
            chat_template_kwargs={"enable_thinking": {"__class__": ESCAPE}},
        )
    )
    add(refused("template", "completions", "completions", "chat_template", chat_template=LOOP))
    add(refused("template", "messages", "messages", "chat_template", chat_template=LOOP))
    add(
        refused(
            "template",
            "processor kwargs",
            "chat",
            "mm_processor_kwargs",
            mm_processor_kwargs={"num_crops": 10**9},
        )
    )
    add(
        refused(
            "template",
            "media io kwargs",
            "responses",
            "media_io_kwargs",
            media_io_kwargs={"video": {"num_frames": 10**9}},
        )
    )
    # -- Structured outputs that crash or stall a shared engine.
    for name, value in (
        ("json a list", [1, 2, 3]),
        ("json broken text", "{not json"),
        ("json a number", 42),
        ("json nested 40", nested(40)),
        ("json nested 100", nested(100)),
        ("json enum 100k", enum(100_000)),
        ("json enum 5k", enum(5_000)),
        ("json 70 KiB", {"type": "string", "description": "x" * 70_000}),
        ("json pattern 1e6", {"type": "string", "pattern": "(a{1000}){1000}"}),
        ("json anyOf 5k", {"anyOf": [{"const": i} for i in range(5_000)]}),
    ):
        add(refused("structured", name, "chat", "structured_outputs", **so("chat", json=value)))
    for name, value in (
        ("regex 1e6 copies", "(a{1000}){1000}"),
        ("regex unbalanced", "((((a"),
        ("regex 5000 chars", "a" * 5000),
        ("regex not text", ["a"]),
    ):
        add(refused("structured", name, "chat", "structured_outputs", **so("chat", regex=value)))
    for name, value in (
        ("grammar 1e6 repeats", 'root ::= "a"{1000000}'),
        ("grammar lark 1e6", 'start: "a"~1000000'),
        ("grammar 70 KiB", "root ::= " + " | ".join(f'"w{i}"' for i in range(9000))),
        ("grammar empty", "   "),
    ):
        add(refused("structured", name, "chat", "structured_outputs", **so("chat", grammar=value)))
    for name, value in (("choice empty", []), ("choice 5k", [f"c{i}" for i in range(5000)])):
        add(refused("structured", name, "chat", "structured_outputs", **so("chat", choice=value)))
    add(
        refused(
            "structured",
            "two constraints",
            "chat",
            "structured_outputs",
            **so("chat", regex="a", choice=["a"]),
        )
    )
    add(
        refused(
            "structured",
            "backend option",
            "chat",
            "structured_outputs",
            **so("chat", json={"type": "string"}, backend="outlines"),
        )
    )
    add(
        refused(
            "structured",
            "structural tag 1 MiB",
            "chat",
            "structured_outputs",
            **so("chat", structural_tag=orjson.dumps({"x": "y" * 2**20}).decode()),
        )
    )
    for api in ("chat", "completions"):
        add(
            refused(
                "structured",
                "response_format schema text",
                api,
                "response_format",
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": "object"},
                },
            )
        )
    add(
        refused(
            "structured",
            "response_format enum 100k",
            "chat",
            "response_format",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": enum(100_000)},
            },
        )
    )
    add(
        refused(
            "structured",
            "response_format unknown type",
            "chat",
            "response_format",
            response_format={"type": "grammar", "grammar": "root ::= x"},
        )
    )
    add(refused("structured", "guided_json a list", "chat", "guided_json", guided_json=[1]))
    add(
        refused(
            "structured", "guided_json deep", "completions", "guided_json", guided_json=nested(64)
        )
    )
    add(
        refused(
            "structured", "guided_regex 1e6", "chat", "guided_regex", guided_regex="(b{1000}){1000}"
        )
    )
    add(
        refused(
            "structured",
            "guided_choice 5k",
            "chat",
            "guided_choice",
            guided_choice=[str(i) for i in range(5000)],
        )
    )
    add(
        refused(
            "structured",
            "guided_grammar 1e6",
            "chat",
            "guided_grammar",
            guided_grammar='root ::= "a"{1000000}',
        )
    )
    add(
        refused(
            "structured",
            "responses text.format",
            "responses",
            "text",
            text={"format": {"type": "json_schema", "name": "x", "schema": [1]}},
        )
    )
    add(
        refused(
            "structured",
            "responses deep",
            "responses",
            "text",
            text={"format": {"type": "json_schema", "name": "x", "schema": nested(100)}},
        )
    )
    add(
        refused(
            "structured",
            "responses regex",
            "responses",
            "structured_outputs",
            **so("responses", regex="(c{999}){999}"),
        )
    )
    for api in ("messages", "count_tokens"):
        add(
            refused(
                "structured",
                "output_config schema text",
                api,
                "output_config",
                output_config={"format": {"type": "json_schema", "schema": "nope"}},
            )
        )
    add(
        refused(
            "structured",
            "output_config enum 100k",
            "messages",
            "output_config",
            output_config={"format": {"type": "json_schema", "schema": enum(100_000)}},
        )
    )
    add(
        made_safe(
            "structured",
            "regex backtracking shape",
            "chat",
            "forwarded within bounds: the engine compiles it to an automaton, no backtracking",
            **so("chat", regex="(a|aa)*b"),
        )
    )
    add(
        made_safe(
            "structured",
            "enum at the bound",
            "chat",
            "forwarded within bounds (4,096 alternatives compile in a fraction of a second)",
            **so("chat", json=enum(4096)),
        )
    )
    # -- Tools (schemas the engine renders and compiles).
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    add(refused("tools", "200 tools", "chat", "tools", tools=[tool] * 200))
    add(
        refused(
            "tools",
            "deep parameters",
            "chat",
            "tools",
            tools=[{"type": "function", "function": {"name": "f", "parameters": nested(80)}}],
            tool_choice="required",
        )
    )
    add(
        refused(
            "tools",
            "parameters a list",
            "chat",
            "tools",
            tools=[{"type": "function", "function": {"name": "f", "parameters": ["x"]}}],
        )
    )
    add(
        refused(
            "tools",
            "pattern explosion",
            "chat",
            "tools",
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "string", "pattern": "(x{500}){500}"},
                    },
                }
            ],
        )
    )
    for kind, extra in (
        ("mcp", {"server_label": "x", "server_url": METADATA_URL}),
        ("web_search", {}),
        ("code_interpreter", {"container": {"type": "auto"}}),
    ):
        add(
            refused(
                "tools", f"responses {kind}", "responses", "tools", tools=[{"type": kind, **extra}]
            )
        )
    add(
        refused(
            "tools",
            "anthropic enum 100k",
            "messages",
            "tools",
            tools=[{"name": "f", "input_schema": enum(100_000)}],
        )
    )
    add(
        refused(
            "tools",
            "anthropic 200 tools",
            "count_tokens",
            "tools",
            tools=[{"name": "f", "input_schema": {"type": "object"}}] * 200,
        )
    )
    add(
        refused(
            "tools",
            "mcp servers",
            "messages",
            "mcp_servers",
            mcp_servers=[{"type": "url", "url": METADATA_URL, "name": "x"}],
        )
    )
    # -- Huge n and logprobs.
    for value in (1000, 10**9, 0, -1, "8", 2.0):
        add(refused("n/logprobs", f"n={value!r}", "chat", "n", n=value))
    add(refused("n/logprobs", "completions n", "completions", "n", n=64))
    add(refused("n/logprobs", "best_of 100", "completions", "best_of", best_of=100))
    add(
        refused("n/logprobs", "completions logprobs 1e6", "completions", "logprobs", logprobs=10**6)
    )
    for value in (1000, -1):
        add(
            refused(
                "n/logprobs",
                f"top_logprobs {value}",
                "chat",
                "top_logprobs",
                logprobs=True,
                top_logprobs=value,
            )
        )
        add(
            refused(
                "n/logprobs",
                f"prompt_logprobs {value}",
                "chat",
                "prompt_logprobs",
                prompt_logprobs=value,
            )
        )
    add(
        refused(
            "n/logprobs", "responses top_logprobs", "responses", "top_logprobs", top_logprobs=500
        )
    )
    add(
        refused(
            "n/logprobs",
            "logprob_token_ids 10k",
            "chat",
            "logprob_token_ids",
            logprobs=True,
            logprob_token_ids=list(range(10_000)),
        )
    )
    # -- Lists of a million (or too many) entries.
    add(
        refused(
            "lists",
            "logit_bias 100k",
            "chat",
            "logit_bias",
            logit_bias={str(i): 1 for i in range(100_000)},
        )
    )
    add(refused("lists", "logit_bias 1e300", "completions", "logit_bias", logit_bias={"1": 1e300}))
    add(refused("lists", "stop 1000", "chat", "stop", stop=["x"] * 1000))
    add(
        refused(
            "lists",
            "stop_sequences 1000",
            "messages",
            "stop_sequences",
            stop_sequences=["x"] * 1000,
        )
    )
    add(
        refused(
            "lists",
            "stop_token_ids 100k",
            "completions",
            "stop_token_ids",
            stop_token_ids=list(range(100_000)),
        )
    )
    add(refused("lists", "bad_words 1000", "chat", "bad_words", bad_words=["x"] * 1000))
    add(refused("lists", "messages 20k", "chat", "messages", messages=HELLO * 20_000))
    add(refused("lists", "input items 20k", "embeddings", "input", input=["x"] * 20_000))
    add(refused("lists", "documents 20k", "rerank", "documents", documents=["d"] * 20_000))
    add(refused("lists", "score items 20k", "score", "text_2", text_2=["d"] * 20_000))
    add(
        refused(
            "lists",
            "metadata 1000 keys",
            "responses",
            "metadata",
            metadata={str(i): "v" for i in range(1000)},
        )
    )
    # -- max_tokens and its kin.
    for value in (10**12, -1, 0, "100", 1.5, True):
        add(refused("max_tokens", f"max_tokens={value!r}", "chat", "max_tokens", max_tokens=value))
    add(
        refused(
            "max_tokens",
            "max_completion_tokens",
            "chat",
            "max_completion_tokens",
            max_completion_tokens=10**9,
        )
    )
    add(refused("max_tokens", "completions", "completions", "max_tokens", max_tokens=CONTEXT + 1))
    add(
        refused(
            "max_tokens",
            "max_output_tokens",
            "responses",
            "max_output_tokens",
            max_output_tokens=10**9,
        )
    )
    add(refused("max_tokens", "messages -5", "messages", "max_tokens", max_tokens=-5))
    add(refused("max_tokens", "min_tokens", "chat", "min_tokens", min_tokens=10**9))
    add(
        refused(
            "max_tokens",
            "thinking budget",
            "messages",
            "thinking.budget_tokens",
            thinking={"type": "enabled", "budget_tokens": 10**9},
        )
    )
    add(
        refused(
            "max_tokens",
            "thinking_token_budget",
            "chat",
            "thinking_token_budget",
            thinking_token_budget=10**9,
        )
    )
    add(
        refused(
            "max_tokens",
            "truncate_prompt_tokens",
            "embeddings",
            "truncate_prompt_tokens",
            truncate_prompt_tokens=10**9,
        )
    )
    # -- Engine internals.
    internals = (
        (
            "kv_transfer_params",
            {"do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_port": 22},
        ),
        ("ec_transfer_params", {"remote_host": "10.0.0.9"}),
        ("vllm_xargs", {"any": "thing"}),
        ("request_id", "chatcmpl-another-tenants"),
        ("return_prompt_text", True),
        ("return_token_offsets", True),
        ("mm_payload", "none"),
        ("routed_experts_prompt_start", 1),
        ("guided_decoding_backend", "outlines"),
        ("session_id", "another-tenants-session"),
    )
    for name, value in internals:
        add(refused("internals", name, "chat", name, **{name: value}))
    add(
        refused(
            "internals", "prompt_embeds", "completions", "prompt_embeds", prompt_embeds="gASV" * 100
        )
    )
    add(
        refused(
            "internals",
            "previous_input_messages",
            "responses",
            "previous_input_messages",
            previous_input_messages=[{"role": "system", "content": "x"}],
        )
    )
    add(
        refused(
            "internals",
            "enable_response_messages",
            "responses",
            "enable_response_messages",
            enable_response_messages=True,
        )
    )
    add(
        refused(
            "internals",
            "request_id on responses",
            "responses",
            "request_id",
            request_id="resp_other",
        )
    )
    add(
        refused(
            "internals",
            "kv_transfer on messages",
            "messages",
            "kv_transfer_params",
            kv_transfer_params={"do_remote_decode": True},
        )
    )
    for api in PATHS:  # fields no API takes
        add(
            refused(
                "internals",
                f"{api} trust_remote_code",
                api,
                "trust_remote_code",
                trust_remote_code=True,
            )
        )
    add(refused("internals", "tokenizer", "chat", "tokenizer", tokenizer="/etc/passwd"))
    add(
        refused(
            "internals",
            "lora_request",
            "completions",
            "lora_request",
            lora_request={"lora_path": "/etc"},
        )
    )
    # -- Made safe: what Tollgate drops or replaces.
    add(
        made_safe(
            "made safe",
            "redirect fields",
            "chat",
            "dropped: the SDK redirect settings",
            api_base=METADATA_URL,
            base_url=METADATA_URL,
            extra_headers={"Host": "169.254.169.254"},
        )
    )
    add(
        made_safe(
            "made safe",
            "engine priority",
            "chat",
            "Tollgate's class; the engine's integer priority never forwarded as given",
            priority=-(10**18),
        )
    )
    add(
        made_safe(
            "made safe",
            "openai hints",
            "chat",
            "dropped: OpenAI hints the engine ignores",
            metadata={"k": "v" * 500},
            store=True,
            service_tier="priority",
            prompt_cache_key="x",
        )
    )
    add(
        made_safe(
            "made safe",
            "stream options",
            "completions",
            "replaced with Tollgate's usage options",
            stream=True,
            stream_options={"include_usage": False, "continuous_usage_stats": True},
        )
    )
    add(
        made_safe(
            "made safe",
            "anthropic hints",
            "messages",
            "dropped: Anthropic hints the engine ignores",
            service_tier="auto",
            inference_geo="eu",
            cache_control={"type": "ephemeral"},
        )
    )
    # -- JSON the parser must survive.
    for api in ("chat", "messages"):
        add(
            Case(
                "json",
                "arrays 10k deep",
                api,
                b'{"model":"' + SERVED_NAME.encode() + b'","messages":' + deep_array(10_000) + b"}",
                "JSON body",
            )
        )
    add(
        Case(
            "json",
            "arrays 300 deep (read, but not written again)",
            "chat",
            b'{"model":"'
            + SERVED_NAME.encode()
            + b'","stream":true,"messages":[],"user":'
            + deep_array(300)
            + b"}",
            "254 levels",
        )
    )
    add(
        Case(
            "json",
            "objects 100k deep",
            "responses",
            b'{"model":"x","metadata":' + b'{"a":' * 100_000 + b"1" + b"}" * 100_001,
            "JSON body",
        )
    )
    add(
        Case(
            "json",
            "NaN",
            "chat",
            b'{"model":"' + SERVED_NAME.encode() + b'","messages":[],"temperature":NaN}',
            "JSON body",
        )
    )
    add(Case("json", "not an object", "completions", b"[1,2,3]", "JSON object"))
    add(
        Case(
            "json",
            "9 MiB",
            "chat",
            orjson.dumps({**BASE["chat"], "user": "x" * (9 * 2**20)}),
            "larger than",
            status=413,
        )
    )
    add(
        Case(
            "json",
            "logit_bias 1e6",
            "completions",
            orjson.dumps({**BASE["completions"], "logit_bias": {str(i): 1 for i in range(10**6)}}),
            "larger than",
            status=413,
        )
    )
    # -- The engine's own routes: never reachable.
    probe = {
        "model": SERVED_NAME,
        "prompt": "x",
        "messages": HELLO,
        "chat_template": ESCAPE,
        "tools": [tool],
        "lora_name": "x",
        "lora_path": "/etc",
        "method": "execute_model",
        "level": 2,
    }
    for path in (
        "/tokenize",
        "/detokenize",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/reset_prefix_cache",
        "/sleep?level=2",
        "/wake_up",
        "/collective_rpc",
        "/pooling",
        "/invocations",
        "/start_profile",
        "/scale_elastic_ep",
        "/server_info",
        "/is_sleeping",
        "/v1/chat/completions/render",
        "/v1/completions/render",
        "/v2/rerank",
        "/inference/v1/generate",
        "/TOKENIZE",
        "//tokenize",
        "/v1/../tokenize",
        "/v1/%2e%2e/tokenize",
        "/v1/chat/completions/../../tokenize",
    ):
        add(Case("engine routes", path, "chat", probe, "Invalid URL", path=path, status=404))
    return cases


def send(client: httpx.Client, url: str, key: str, case: Case) -> tuple[int, str]:
    path = case.path or PATHS[case.api]
    content = case.body if isinstance(case.body, bytes) else orjson.dumps(case.body)
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    if case.api in ("messages", "count_tokens"):
        headers["anthropic-version"] = "2023-06-01"
    if case.path:
        # The request line as written (httpx would resolve the dot segments first).
        connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
        try:
            connection.request("POST", path, body=content, headers=headers)
            answer = connection.getresponse()
            return answer.status, answer.read().decode()
        finally:
            connection.close()
    answer = client.post(url + path, content=content, headers=headers)
    return answer.status_code, answer.text


def verdict(case: Case) -> str | None:
    """What is wrong with a case's answer (None: as it must be)."""
    status, text = case.result
    if status != case.status:
        return f"status {status}, not {case.status}: {text[:300]}"
    if case.status < 300:
        return None
    error = orjson.loads(text)
    if case.api in ("messages", "count_tokens") and not case.path:
        if error.get("type") != "error":
            return f"not Anthropic's error shape: {text[:300]}"
        message = error["error"]["message"]
    else:
        message, param = error["error"]["message"], error["error"].get("param")
        if case.names not in message and case.names != param:
            return f"neither the message nor param names {case.names}: {text[:300]}"
        return None
    if case.names not in message:
        return f"the message does not name {case.names}: {message[:300]}"
    return None


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


@dataclass
class Bystander:
    """Another tenant's ordinary chat requests, one after another, timed."""

    url: str
    key: str
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def one(self, client: httpx.Client, n: int) -> None:
        body = {
            "model": SERVED_NAME,
            "messages": [{"role": "user", "content": f"Count to three, run {n}."}],
            "max_tokens": 8,
            "temperature": 0,
        }
        started = time.perf_counter()
        answer = client.post(
            f"{self.url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {self.key}"},
        )
        elapsed = time.perf_counter() - started
        if answer.status_code != 200 or not answer.json()["choices"][0]["message"]["content"]:
            self.failures.append(f"{answer.status_code} {answer.text[:200]}")
        self.latencies.append(elapsed)

    def run(self, count: int | None = None) -> None:
        with httpx.Client(timeout=60) as client:
            n = 0
            while (count is None and not self.stop.is_set()) or (count is not None and n < count):
                self.one(client, n)
                n += 1


@pytest.fixture
def shielded(gateway_url: str, shared_engine: RealEngine) -> Iterator[tuple[str, str, str]]:  # noqa: F811
    """The shared engine behind the gateway: the test model, and the embedding and rerank
    entries routed to it too; the hostile tenant's key and the bystander's."""
    node = deployment_services.register_node(
        None, name="vllm-node", docker_url="unix:///x", engine_host="127.0.0.1"
    )
    for name, task in ((SERVED_NAME, Task.GENERATE), (EMBED, Task.EMBED), (RERANK, Task.SCORE)):
        model = deployment_services.create_model(
            None,
            served_name=name,
            source="tollgate-test/tiny-llama",
            params_billions="0.01",
            context_length=CONTEXT,
            task=task,
        )
        deploy(model, node, shared_engine.port, max_num_seqs=4)
    hostile = tenant_services.create_tenant(None, name="Hostile", slug="hostile")
    bystander = tenant_services.create_tenant(None, name="Bystander", slug="bystander")
    hostile_key = tenant_services.issue_api_key(None, hostile, name="h").plaintext
    bystander_key = tenant_services.issue_api_key(None, bystander, name="b").plaintext
    for key in (hostile_key, bystander_key):
        for name in (SERVED_NAME, EMBED, RERANK):
            wait_until_served(gateway_url, key, name, timeout=30)
    yield gateway_url, hostile_key, bystander_key


def test_the_policy_classifies_every_field_the_engine_accepts(shared_engine: RealEngine) -> None:
    """The engine's own OpenAPI schema lists its request classes' fields: each one has a
    written treatment (a new vLLM field fails here until it is classified)."""
    schemas = httpx.get(f"{shared_engine.url}/openapi.json", timeout=30).json()
    schemas = schemas["components"]["schemas"]
    for name, api in (
        ("ChatCompletionRequest", "chat"),
        ("CompletionRequest", "completions"),
        ("ResponsesRequest", "responses"),
        ("AnthropicMessagesRequest", "messages"),
        ("AnthropicCountTokensRequest", "count_tokens"),
    ):
        fields = set(schemas[name]["properties"])
        assert fields - set(POLICY[api]) == set(), (name, fields - set(POLICY[api]))


def test_a_battery_of_hostile_bodies_leaves_the_engine_serving_everyone(
    shielded: tuple[str, str, str], shared_engine: RealEngine
) -> None:
    url, hostile_key, bystander_key = shielded
    started = time.monotonic()
    cases = battery()
    assert len(cases) >= 100
    assert {c.api for c in cases} >= set(PATHS)
    # The engine's /tokenize is open to whoever reaches the engine (no key): the shield
    # matters. Through the gateway it is not there at all (the battery's last family).
    direct = httpx.post(
        f"{shared_engine.url}/tokenize", json={"model": SERVED_NAME, "prompt": "x"}, timeout=30
    )
    assert direct.status_code == 200 and "tokens" in direct.json()

    quiet = Bystander(url, bystander_key)
    quiet.run(count=3)  # warm the path
    quiet.latencies.clear()
    quiet.run(count=30)
    assert quiet.failures == []

    during = Bystander(url, bystander_key)
    runner = threading.Thread(target=during.run, daemon=True)
    runner.start()
    battery_started, wrong = time.monotonic(), {}
    try:
        # Four at a time, the whole battery ROUNDS times, and more (up to MAX_ROUNDS) until the
        # bystander has SAMPLES requests timed during it: a fast machine ends ROUNDS sooner.
        with httpx.Client(timeout=120) as client, ThreadPoolExecutor(4) as pool:
            round_ = -1
            while (round_ := round_ + 1) < ROUNDS or (
                len(during.latencies) < SAMPLES and round_ < MAX_ROUNDS
            ):
                results = pool.map(lambda case: send(client, url, hostile_key, case), cases)
                for case, result in zip(cases, results, strict=True):
                    case.result = result
                    if verdict(case):
                        wrong[f"{round_}/{case.family}/{case.api}/{case.name}"] = verdict(case)
    finally:
        during.stop.set()
        runner.join(timeout=120)
    battery_seconds = time.monotonic() - battery_started

    print_table(cases, battery_seconds, rounds=round_)
    assert wrong == {}
    assert during.failures == [] and len(during.latencies) >= SAMPLES

    # Afterwards the engine is healthy and answers, straight and through the gateway.
    wait_until(
        lambda: httpx.get(f"{shared_engine.url}/health", timeout=10).status_code == 200,
        30,
        "engine /health",
    )
    after = Bystander(url, bystander_key)
    after.run(count=3)
    assert after.failures == []

    ms = [
        statistics.median(quiet.latencies) * 1000,
        percentile(quiet.latencies, 0.95) * 1000,
        statistics.median(during.latencies) * 1000,
        percentile(during.latencies, 0.95) * 1000,
    ]
    print(
        f"bystander latency, quiet: p50 {ms[0]:.0f} ms, p95 {ms[1]:.0f} ms "
        f"({len(quiet.latencies)} requests); during the battery: p50 {ms[2]:.0f} ms, p95 "
        f"{ms[3]:.0f} ms ({len(during.latencies)} requests); engine healthy after: yes; "
        f"test wall time {time.monotonic() - started:.0f} s"
    )
    # Nothing hostile held the engine: no ordinary request waited out a compile.
    assert max(during.latencies) < 10.0


def print_table(cases: list[Case], seconds: float, rounds: int) -> None:
    refused = Counter(c.api for c in cases if c.status >= 400)
    safe = Counter(c.api for c in cases if c.status < 400)
    print(f"\nbattery: {len(cases)} bodies, sent {rounds} times in {seconds:.1f} s")
    print("| API | refused (4xx) | made safe (2xx) |")
    print("|---|---|---|")
    for api in PATHS:
        print(f"| {api} | {refused[api]} | {safe[api]} |")
    print("\n| family | API | case | answer | made safe how |")
    print("|---|---|---|---|---|")
    for c in cases:
        status = c.result[0] if c.result else "-"
        print(f"| {c.family} | {c.api} | {c.name} | {status} | {c.safe} |")
