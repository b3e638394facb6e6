"""Prefix-aware routing on two real vLLM replicas with prefix caching: multi-turn
conversations routed by Tollgate's default policy find their earlier turns in the replica's
prefix cache far more often than the same traffic sent round robin, as the engines' own
``vllm:prefix_cache_hits_total`` counters show."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from deployments import services as deployment_services
from tenants import services as tenant_services
from tests.gateway.conftest import (  # noqa: F401
    deploy,
    gateway_url,
    redis_namespace,
    start_gateway,
    stop,
    wait_until_served,
)
from tests.vllm.conftest import SERVED_NAME, RealEngine, start_vllm, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

# An odd number of conversations, so round robin sends each one's turns to the replicas in
# turn (with an even number every conversation would stay on one replica by accident).
CONVERSATIONS = 5
TURNS = 3


@pytest.fixture(scope="module")
def two_engines() -> Iterator[list[RealEngine]]:
    """Two replicas started side by side (each waits for its own health)."""
    engines = [start_vllm("--max-num-seqs", "4", wait=False) for _ in range(2)]
    try:
        for engine in engines:
            wait_until(engine.healthy, 600, f"vLLM on port {engine.port}")
        yield engines
    finally:
        for engine in engines:
            engine.stop()


def route_to(engines: list[RealEngine]) -> None:
    """Both engines as ready replicas of one deployment (the test's own containers)."""
    model = deployment_services.create_model(
        None,
        served_name=SERVED_NAME,
        source="tollgate-test/tiny-llama",
        params_billions="0.01",
        context_length=2048,
    )
    node = deployment_services.register_node(
        None, name="vllm-node", docker_url="unix:///x", engine_host="127.0.0.1"
    )
    deploy(model, node, *(engine.port for engine in engines), max_num_seqs=4)


def hits(engines: list[RealEngine]) -> float:
    return sum(engine.metric("vllm:prefix_cache_hits_total") for engine in engines)


def converse(base_url: str, key: str, tag: str) -> None:
    """Multi-turn conversations, each with a long system prompt of its own (several KV
    blocks of 128 tokens), turns interleaved across conversations as agents do."""
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    histories = [
        [
            {"role": "system", "content": f"{tag} agent {n}. " + f"Rule {n}: be precise. " * 90},
            {"role": "user", "content": "Start."},
        ]
        for n in range(CONVERSATIONS)
    ]
    for turn in range(TURNS):
        for messages in histories:
            answer = client.chat.completions.create(
                model=SERVED_NAME, messages=messages, max_tokens=4, temperature=0
            )
            messages += [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": f"Turn {turn + 1}."},
            ]


def test_prefix_routing_finds_the_cache_round_robin_misses(
    gateway_url: str,  # noqa: F811
    two_engines: list[RealEngine],
) -> None:
    route_to(two_engines)
    tenant = tenant_services.create_tenant(None, name="Agents", slug="agents")
    key = tenant_services.issue_api_key(None, tenant, name="agents").plaintext
    wait_until_served(gateway_url, key, SERVED_NAME, timeout=30)
    round_robin, rr_url = start_gateway(1, {"TOLLGATE_ROUTING": "round_robin"})
    try:
        wait_until_served(rr_url, key, SERVED_NAME, timeout=30)
        before = hits(two_engines)
        converse(f"{rr_url}/v1", key, "Round robin")
        by_round_robin = hits(two_engines) - before
    finally:
        stop(round_robin)
    before = hits(two_engines)
    converse(f"{gateway_url}/v1", key, "Prefix")
    by_prefix = hits(two_engines) - before
    print(f"prefix cache hits: prefix-aware {by_prefix:.0f}, round robin {by_round_robin:.0f}")
    # Each later turn repeats its conversation's whole history. Prefix-aware: every later
    # turn finds it on the replica that served the turn before. Round robin: turn 2 lands
    # on the replica that never saw the conversation, only turn 3 finds turn 1's prefix.
    assert by_prefix > 1.5 * by_round_robin
