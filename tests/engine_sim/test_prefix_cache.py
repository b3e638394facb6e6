"""The prefix cache model (issue 18): a prefix an engine has already prefilled costs it no
prefill time again (another engine still pays it), usage and /metrics report the hits with
vLLM's names, and the cache holds only what the KV cache has room for (LRU by block)."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.engine_sim.conftest import tokenize, wait_until

# 0.25 ms per uncached prompt token: a ~2,400-token prefix takes ~0.6 s to prefill.
TIMED = [
    "m",
    "--sim-load-seconds",
    "0",
    "--sim-ttft-ms",
    "0",
    "--sim-ttft-per-token-ms",
    "0.25",
    "--sim-decode-tps",
    "0",
    "--enable-prompt-tokens-details",
]
PREFIX = [{"role": "system", "content": "Follow the house style and answer carefully. " * 300}]


def first_token(sim, question: str) -> tuple[float, dict]:
    """Seconds to the first content chunk of a streamed chat request, and its final usage."""
    body = {
        "messages": PREFIX + [{"role": "user", "content": question}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    ttft = None
    usage = None
    with httpx.stream("POST", sim.url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and ttft is None:
                ttft = time.monotonic() - start
            usage = chunk.get("usage") or usage
    return ttft, usage


def test_a_cached_prefix_skips_its_prefill_on_that_engine_only(start_sim):
    a = start_sim(*TIMED)
    b = start_sim(*TIMED)
    cold, cold_usage = first_token(a, "First question?")
    warm, warm_usage = first_token(a, "Second question?")
    other, other_usage = first_token(b, "Second question?")
    prompt = warm_usage["prompt_tokens"]
    assert prompt > 2400
    # Prefill is a sleep of 0.25 ms per uncached token: a lower bound however loaded the box is.
    assert cold >= 0.25e-3 * prompt * 0.95 and other >= 0.25e-3 * prompt * 0.95
    assert warm < 0.5 * min(cold, other)
    assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert other_usage["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm_usage["prompt_tokens_details"]["cached_tokens"]
    assert 0.95 * prompt < cached < prompt and cached % 16 == 0  # whole blocks of the shared prefix

    # /metrics with vLLM's names.
    total = cold_usage["prompt_tokens"] + prompt
    assert a.metric("vllm:prefix_cache_queries_total") == total
    assert a.metric("vllm:prefix_cache_hits_total") == cached
    assert a.metric("vllm:prompt_tokens_cached_total") == cached
    assert a.metric("vllm:prompt_tokens_by_source_total", 'source="local_cache_hit"') == cached
    assert (
        a.metric("vllm:prompt_tokens_by_source_total", 'source="local_compute"') == total - cached
    )
    assert a.metric("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"') == 0
    assert a.metric("vllm:request_prefill_kv_computed_tokens_sum") == total - cached
    assert a.metric("vllm:external_prefix_cache_queries_total") == 0
    assert a.metric("vllm:external_prefix_cache_hits_total") == 0
    assert b.metric("vllm:prefix_cache_hits_total") == 0


def test_cache_config_info_tells_the_kv_capacity(start_sim):
    sim = start_sim(
        "m", "--sim-load-seconds", "0", "--block-size", "32", "--sim-kv-cache-tokens", "65536"
    )
    line = next(
        x
        for x in httpx.get(sim.url + "/metrics").text.splitlines()
        if x.startswith("vllm:cache_config_info{")
    )
    assert 'block_size="32"' in line and 'num_gpu_blocks="2048"' in line and 'engine="0"' in line
    assert 'enable_prefix_caching="True"' in line and line.endswith(" 1.0")


def chat_usage(sim, text: str) -> dict:
    r = httpx.post(
        sim.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": text}], "max_tokens": 1},
        timeout=30,
    )
    return r.json()["usage"]


def test_the_cache_holds_what_the_kv_cache_has_room_for(start_sim):
    """50 blocks of 16 tokens; two ~30-block prompts do not both fit, so the first loses the
    tail of its prefix (vLLM evicts a request's blocks tail first) and keeps its head."""
    sim = start_sim(
        "m",
        "--sim-load-seconds",
        "0",
        "--sim-ttft-ms",
        "0",
        "--sim-ttft-per-token-ms",
        "0",
        "--sim-decode-tps",
        "0",
        "--enable-prompt-tokens-details",
        "--sim-kv-cache-tokens",
        "800",
    )
    one, two = "alpha beta gamma delta " * 115, "one two three four " * 115
    n = tokenize(sim, messages=[{"role": "user", "content": one}])
    assert 460 < n < 500
    assert chat_usage(sim, one)["prompt_tokens_details"]["cached_tokens"] == 0
    full = chat_usage(sim, one)["prompt_tokens_details"]["cached_tokens"]
    assert full == (n - 1) // 16 * 16  # everything but the last partial block
    chat_usage(sim, two)
    after = chat_usage(sim, one)["prompt_tokens_details"]["cached_tokens"]
    assert 0 < after < full
    # With room for both, nothing is lost.
    roomy = start_sim(
        "m",
        "--sim-load-seconds",
        "0",
        "--sim-ttft-ms",
        "0",
        "--sim-ttft-per-token-ms",
        "0",
        "--sim-decode-tps",
        "0",
        "--enable-prompt-tokens-details",
        "--sim-kv-cache-tokens",
        "4000",
    )
    for text in (one, two):
        chat_usage(roomy, text)
    assert chat_usage(roomy, one)["prompt_tokens_details"]["cached_tokens"] == full


def test_twin_prompts_in_flight_do_not_share_uncomputed_blocks(start_sim):
    """A prompt is cached once its prefill is done, not when it arrives: a twin scheduled
    while the first is still prefilling (2.4 s here) computes the prefix again."""
    sim = start_sim(*[x if x != "0.25" else "1" for x in TIMED])
    usages: list[dict] = []
    first = threading.Thread(target=lambda: usages.append(first_token(sim, "Twin one?")[1]))
    first.start()
    wait_until(
        lambda: sim.metric("vllm:num_requests_running") == 1, what="the first to be prefilling"
    )
    twin = first_token(sim, "Twin two?")[1]
    first.join()
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert twin["prompt_tokens_details"]["cached_tokens"] == 0
