"""The engine shield's policy: per API, every request field Tollgate forwards to an engine,
and how (gateway/shield.py enforces it; docs/admins/engine-shield.md shows it, rendered by
``markdown_table`` and compared with it by a test).

Read off vLLM 0.32's request classes (``vllm/entrypoints/*/protocol.py``) and the openai and
anthropic SDKs' parameters. A field an API does not list is refused, as OpenAI and Anthropic
answer a parameter they do not know (vLLM would ignore it). Treatments:

- ``forward``: passed as given; the engine checks its type.
- ``whole``: a whole number within bounds (``high`` names a ``Bounds`` attribute, or is a
  number); ``items``: at most that many items (a list, or an object's keys).
- the structured-output kinds (``schema``, ``response_format``, ``structured``, ``text``,
  ``output_config``, ``tools``, ``regex``, ``grammar``, ``choice``): bounded in size, depth,
  counted repetitions and patterns before the engine compiles them into a grammar.
- ``template_kwargs``: the keys every model accepts, plus those the model allows.
- ``guarded``: refused unless an admin allows the field for the model
  (``CatalogModel.allowed_request_fields``, core/request_fields.py).
- ``refused``, ``dropped`` (removed before forwarding), ``tollgate`` (Tollgate's own field).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.request_fields import SAFE_TEMPLATE_KWARGS


@dataclass(frozen=True, slots=True)
class Rule:
    """How one request field is treated."""

    kind: str
    low: int = 0
    high: int | str = 0  # a number, or the name of a Bounds attribute
    note: str = ""  # why (refused, dropped, Tollgate's own)


FORWARD = Rule("forward")
GUARDED = Rule("guarded")
TEMPLATE_KWARGS = Rule("template_kwargs")
TOOLS = Rule("tools")
STOP = Rule("items", high=16)
METADATA = Rule("items", high=16)
LOGIT_BIAS = Rule("logit_bias", high=1024)


def whole(low: int, high: int | str) -> Rule:
    return Rule("whole", low, high)


def items(high: int | str) -> Rule:
    return Rule("items", high=high)


def refused(why: str) -> Rule:
    return Rule("refused", note=why)


def dropped(why: str) -> Rule:
    return Rule("dropped", note=why)


def tollgate(what: str) -> Rule:
    return Rule("tollgate", note=what)


CONTEXT = whole(1, "context")
MODEL = tollgate("the served name of a catalogue model, which Tollgate routes")
PRIORITY = tollgate(
    "the request's priority class (P0–P2, or 0–2), which can only lower the key's; never "
    "forwarded as given"
)
STREAM_OPTIONS = tollgate(
    "replaced before forwarding; the client still gets the usage it asked for"
)
REDIRECT = dropped("an SDK's or proxy's redirect setting, never honoured")
HINT = dropped("OpenAI's hint, which the engine does not use")
ANTHROPIC_HINT = dropped("Anthropic's hint, which the engine does not use")
REQUEST_ID = refused("Tollgate names every request itself (its X-Request-Id header carries the id)")
TRANSFER = refused("disaggregated-serving internals (they tell the engine where KV cache goes)")
RENDER_ONLY = refused("output of the engine's debugging and render endpoints")
ENGINE_BACKEND = refused("the engine's structured-output backend is the administrator's choice")

# Fields any API that takes them treats alike.
COMMON = {
    "model": MODEL,
    "priority": PRIORITY,
    "user": FORWARD,
    "request_id": REQUEST_ID,
    "kv_transfer_params": TRANSFER,
    "ec_transfer_params": TRANSFER,
    "mm_payload": RENDER_ONLY,
    "return_mm_kwargs": RENDER_ONLY,
    "cache_salt": FORWARD,
    "vllm_xargs": GUARDED,
    "session_id": GUARDED,
    "mm_processor_kwargs": GUARDED,
    "chat_template_kwargs": TEMPLATE_KWARGS,
    **dict.fromkeys(
        (
            "api_base",
            "base_url",
            "api_key",
            "api_version",
            "custom_llm_provider",
            "extra_headers",
            "headers",
            "user_api_key",
        ),
        REDIRECT,
    ),
}
# vLLM's sampling extensions (chat, completions; the Responses API takes some of them).
SAMPLING = {
    "top_k": FORWARD,
    "min_p": FORWARD,
    "repetition_penalty": FORWARD,
    "length_penalty": FORWARD,
    "use_beam_search": FORWARD,
    "watermarking": FORWARD,
    "stop_token_ids": items(1024),
    "include_stop_str_in_output": FORWARD,
    "ignore_eos": FORWARD,
    "min_tokens": whole(0, "context"),
    "skip_special_tokens": FORWARD,
    "spaces_between_special_tokens": FORWARD,
    "truncate_prompt_tokens": whole(-1, "context"),
    "truncation_side": FORWARD,
    "prompt_logprobs": whole(0, "logprobs"),
    "logprob_token_ids": items("logprobs"),
    "allowed_token_ids": items("items"),
    "bad_words": items(128),
    "add_special_tokens": FORWARD,
    "return_tokens_as_token_ids": FORWARD,
    "return_token_ids": FORWARD,
    "return_prompt_text": RENDER_ONLY,
    "return_token_offsets": RENDER_ONLY,
    "routed_experts_prompt_start": RENDER_ONLY,
    "repetition_detection": FORWARD,
    "thinking_token_budget": whole(0, "context"),
    "stream_interval": FORWARD,
    "structured_outputs": Rule("structured"),
    "response_format": Rule("response_format"),
    # Structured outputs as older engines took them (vLLM 0.32 ignores these names).
    "guided_json": Rule("schema"),
    "guided_regex": Rule("regex"),
    "guided_choice": Rule("choice"),
    "guided_grammar": Rule("grammar"),
    "guided_whitespace_pattern": Rule("regex"),
    "guided_decoding_backend": ENGINE_BACKEND,
}
# The OpenAI parameters of chat and completions.
OPENAI_SAMPLING = {
    "frequency_penalty": FORWARD,
    "presence_penalty": FORWARD,
    "logit_bias": LOGIT_BIAS,
    "max_tokens": CONTEXT,
    "n": whole(1, "n"),
    "seed": FORWARD,
    "stop": STOP,
    "stream": FORWARD,
    "stream_options": STREAM_OPTIONS,
    "temperature": FORWARD,
    "top_p": FORWARD,
}
# Chat-template switches of the APIs that render a conversation.
TEMPLATE = {
    "echo": FORWARD,
    "add_generation_prompt": FORWARD,
    "continue_final_message": FORWARD,
    "documents": items("items"),
    "chat_template": GUARDED,
    "media_io_kwargs": GUARDED,
}

CHAT = {
    **COMMON,
    **SAMPLING,
    **OPENAI_SAMPLING,
    **TEMPLATE,
    "messages": items("items"),
    "logprobs": FORWARD,
    "top_logprobs": whole(0, "logprobs"),
    "max_completion_tokens": CONTEXT,
    "tools": TOOLS,
    "tool_choice": FORWARD,
    "parallel_tool_calls": FORWARD,
    "reasoning_effort": FORWARD,
    "include_reasoning": FORWARD,
    **dict.fromkeys(
        (
            "metadata",
            "store",
            "service_tier",
            "prompt_cache_key",
            "prompt_cache_options",
            "prompt_cache_retention",
            "safety_identifier",
            "verbosity",
            "prediction",
            "modalities",
        ),
        HINT,
    ),
    "audio": refused("the engines answer in text only"),
    "functions": refused("use `tools` (the engines do not implement `functions`)"),
    "function_call": refused("use `tool_choice` (the engines do not implement `function_call`)"),
    "web_search_options": refused("the engines do not search the web"),
    "moderation": refused("the engines do not moderate"),
}

COMPLETIONS = {
    **COMMON,
    **SAMPLING,
    **OPENAI_SAMPLING,
    "prompt": FORWARD,
    "suffix": FORWARD,
    "echo": FORWARD,
    "best_of": whole(1, "n"),
    "logprobs": whole(0, "logprobs"),
    "prompt_embeds": refused(
        "raw tensors the engine would deserialise (the shape of CVE-2025-62164)"
    ),
}

RESPONSES = {
    **COMMON,
    "input": items("items"),
    "instructions": FORWARD,
    "max_output_tokens": CONTEXT,
    "max_tool_calls": whole(0, "tools"),
    "metadata": METADATA,
    "logit_bias": LOGIT_BIAS,
    "parallel_tool_calls": FORWARD,
    "reasoning": FORWARD,
    "include_reasoning": FORWARD,
    "include": items(16),
    "text": Rule("text"),
    "tool_choice": FORWARD,
    "tools": Rule("function_tools"),
    "top_logprobs": whole(0, "logprobs"),
    "truncation": FORWARD,
    "stream": FORWARD,
    "temperature": FORWARD,
    "top_p": FORWARD,
    "top_k": FORWARD,
    "min_p": FORWARD,
    "repetition_penalty": FORWARD,
    "presence_penalty": FORWARD,
    "frequency_penalty": FORWARD,
    "seed": FORWARD,
    "stop": STOP,
    "stop_token_ids": items(1024),
    "ignore_eos": FORWARD,
    "skip_special_tokens": FORWARD,
    "include_stop_str_in_output": FORWARD,
    "prompt_cache_key": FORWARD,
    "watermarking": FORWARD,
    "media_io_kwargs": GUARDED,
    "structured_outputs": Rule("structured"),
    "store": tollgate("whether Tollgate keeps the response (the engine never does)"),
    "background": tollgate("refused when true: the engines cannot run responses in the background"),
    "previous_response_id": tollgate("expanded by Tollgate from the responses it keeps"),
    "stream_options": dropped("OpenAI's stream option, which the engine does not use"),
    "enable_response_messages": RENDER_ONLY,
    "previous_input_messages": refused("the engine's internal conversation format"),
    "prompt": refused("stored prompt templates are not offered"),
    "conversation": refused(
        "conversations are not offered: chain turns with `previous_response_id`"
    ),
    "context_management": refused("the engines do not compact conversations"),
    "moderation": refused("the engines do not moderate"),
    "background_options": refused("responses do not run in the background here"),
    "image": refused("the engines generate no images"),
    "access_programs": refused("OpenAI's access programs are not offered"),
    **dict.fromkeys(
        (
            "service_tier",
            "safety_identifier",
            "prompt_cache_options",
            "prompt_cache_retention",
        ),
        HINT,
    ),
}

ANTHROPIC_COMMON = {
    **{k: v for k, v in COMMON.items() if k not in ("user", "session_id", "mm_processor_kwargs")},
    "messages": items("items"),
    "system": FORWARD,
    "tools": TOOLS,
    "tool_choice": FORWARD,
    "thinking": Rule("thinking"),
    "output_config": Rule("output_config"),
    **dict.fromkeys(("cache_control", "speed", "user_profile_id", "workspace_id"), ANTHROPIC_HINT),
    "mcp_servers": refused("the engines do not call MCP servers"),
    "context_management": refused("the engines do not compact conversations"),
}

MESSAGES = {
    **ANTHROPIC_COMMON,
    "max_tokens": CONTEXT,
    "metadata": METADATA,
    "stop_sequences": STOP,
    "stream": FORWARD,
    "temperature": FORWARD,
    "top_k": FORWARD,
    "top_p": FORWARD,
    "watermarking": FORWARD,
    **dict.fromkeys(
        (
            "service_tier",
            "inference_geo",
            "diagnostics",
        ),
        ANTHROPIC_HINT,
    ),
    "container": refused("the engines run no code containers"),
}

COUNT_TOKENS = {
    k: v
    for k, v in ANTHROPIC_COMMON.items()
    if k not in ("cache_salt", "vllm_xargs", "kv_transfer_params", "ec_transfer_params")
    and k not in ("mm_payload", "return_mm_kwargs")
}

POOLING = {
    **COMMON,
    "truncate_prompt_tokens": whole(-1, "context"),
    "truncation_side": FORWARD,
    "use_activation": FORWARD,
}

EMBEDDINGS = {
    **POOLING,
    **TEMPLATE,
    "input": items("items"),
    "messages": items("items"),
    "dimensions": whole(1, 65536),
    "encoding_format": FORWARD,
    "embed_dtype": FORWARD,
    "endianness": FORWARD,
    "padding": FORWARD,
    "add_special_tokens": FORWARD,
}

SCORING = {
    **POOLING,
    "max_tokens_per_query": whole(0, "context"),
    "max_tokens_per_doc": whole(0, "context"),
    "instruction": FORWARD,
}

RERANK = {
    **SCORING,
    "query": FORWARD,
    "documents": items("items"),
    "top_n": whole(0, "items"),
    "return_documents": dropped("the engine always returns the documents"),
}

SCORE = {
    **SCORING,
    **dict.fromkeys(
        ("text_1", "text_2", "queries", "documents", "items", "data_1", "data_2"),
        items("items"),
    ),
}

POLICY: dict[str, dict[str, Rule]] = {
    "chat": CHAT,
    "completions": COMPLETIONS,
    "responses": RESPONSES,
    "messages": MESSAGES,
    "count_tokens": COUNT_TOKENS,
    "embeddings": EMBEDDINGS,
    "rerank": RERANK,
    "score": SCORE,
}
# The engine's own routes besides the APIs above (vLLM 0.32): its admin, debugging and
# render endpoints. The gateway forwards only to its APIs' fixed paths (gateway/exchange.py
# UPSTREAM_PATHS), so none of these is ever reachable; these, outside /v1, it also answers
# itself, with OpenAI's 404, instead of letting the console answer them.
ENGINE_PATHS = frozenset(
    (
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/invocations",
        "/generative_scoring",
        "/ping",
        "/health",
        "/load",
        "/version",
        "/server_info",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/pause",
        "/resume",
        "/is_paused",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/release_kv_cache_memory",
        "/start_profile",
        "/stop_profile",
        "/scale_elastic_ep",
        "/is_scaling_elastic_ep",
        "/abort_requests",
        "/kv_event_sources",
        "/update_weights",
        "/update_weight_version",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/finish_weight_update",
        "/start_draft_weight_update",
        "/shutdown_weight_transfer_engine",
        "/get_world_size",
        "/weight_checker",
        "/weight_info",
        "/ready",
        "/readyz",
        "/docs",
        "/openapi.json",
        "/redoc",
    )
)
ENGINE_PREFIXES = ("/v2/", "/inference/", "/fault_tolerance/")
# Engine routes under /v1 (the gateway's): answered 404 like any path it does not serve.
ENGINE_V1_PATHS = (
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/v1/chat/completions/render",
    "/v1/chat/completions/derender",
    "/v1/chat/completions/batch",
    "/v1/completions/render",
    "/v1/completions/derender",
    "/v1/messages/render",
    "/v1/responses/render",
    "/v1/realtime",
    "/v1/systemone",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
)

# --- The docs' tables --------------------------------------------------------------------

HIGHS = {
    "context": "the model's context length",
    "n": "`TOLLGATE_MAX_N`",
    "logprobs": "`TOLLGATE_SHIELD_MAX_LOGPROBS`",
    "items": "`TOLLGATE_SHIELD_MAX_ITEMS`",
    "tools": "`TOLLGATE_SHIELD_MAX_TOOLS`",
}
BOUNDED = "bounded as a structured output (see below)"
KIND_TEXT = {
    "forward": "forwarded",
    "schema": "a JSON schema (object, or JSON text of one), " + BOUNDED,
    "regex": "a regular expression, " + BOUNDED,
    "grammar": "a grammar, " + BOUNDED,
    "choice": "a list of strings, " + BOUNDED,
    "structured": "exactly one constraint, " + BOUNDED,
    "response_format": "`text`, `json_object` or `json_schema` (its `schema` an object), "
    + BOUNDED,
    "text": "its `format`'s `schema` an object, " + BOUNDED,
    "output_config": "its `format`'s `schema` an object, " + BOUNDED,
    "tools": "at most `TOLLGATE_SHIELD_MAX_TOOLS` tools; each one's schema "
    + BOUNDED
    + ", all of them at most 4 × `TOLLGATE_SHIELD_MAX_SCHEMA_BYTES`",
    "function_tools": "function tools only (the engines call no servers of their own: no MCP, web "
    "search, code interpreter …), otherwise as `tools` in chat",
    "thinking": "`budget_tokens` at most the model's context length",
    "template_kwargs": "forwarded for the keys "
    + ", ".join(f"`{k}`" for k in sorted(SAFE_TEMPLATE_KWARGS))
    + " (scalar values) and the keys the model allows; any other key refused",
    "guarded": "refused unless the model allows it",
}


def treatment(rule: Rule) -> str:
    """One rule as the docs' table says it."""
    if rule.kind == "whole":
        high = HIGHS.get(rule.high, str(rule.high))
        return f"a whole number from {rule.low} to {high}"
    if rule.kind in ("items", "logit_bias"):
        high = HIGHS.get(rule.high, str(rule.high))
        extra = ", each from -100 to 100" if rule.kind == "logit_bias" else ""
        return f"at most {high} items{extra}"
    if rule.kind in ("refused", "dropped"):
        return f"{rule.kind}: {rule.note}"
    if rule.kind == "tollgate":
        return f"Tollgate's own: {rule.note}"
    return KIND_TEXT[rule.kind]


def markdown_table(api: str) -> str:
    """The policy of one API as the docs' table (fields sorted by name)."""
    lines = ["| field | treatment |", "|---|---|"]
    for name, rule in sorted(POLICY[api].items()):
        if rule.kind == "forward":
            continue  # listed together below the table
        lines.append(f"| `{name}` | {treatment(rule)} |")
    forwarded = sorted(name for name, rule in POLICY[api].items() if rule.kind == "forward")
    lines.append("")
    lines.append("Forwarded as given: " + ", ".join(f"`{name}`" for name in forwarded) + ".")
    return "\n".join(lines)


def render_doc(text: str) -> str:
    """A page with each ``<!-- shield:<api> -->`` … ``<!-- /shield:<api> -->`` block holding
    that API's table as rendered now."""
    for api in POLICY:
        opening, closing = f"<!-- shield:{api} -->", f"<!-- /shield:{api} -->"
        before, found, rest = text.partition(opening)
        if not found:
            continue
        _, _, after = rest.partition(closing)
        text = f"{before}{opening}\n{markdown_table(api)}\n{closing}{after}"
    return text


if __name__ == "__main__":
    # python -m gateway.shield_policy docs/admins/engine-shield.md: write the tables in.
    import sys
    from pathlib import Path

    page = Path(sys.argv[1])
    page.write_text(render_doc(page.read_text()))
