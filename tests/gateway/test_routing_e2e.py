"""Prefix-aware routing through the real gateway (two uvicorn workers) and two simulator
replicas of one model: each conversation's turns land on one replica, whose prefix cache
then serves the earlier turns, and the conversations spread over both replicas."""

import re
import urllib.request

import openai
import pytest

from deployments.models import Node
from tests.gateway.conftest import World, deploy, make_model, start_engine, stop, wait_until_served

pytestmark = pytest.mark.django_db(transaction=True)
SERVED = re.compile(r"^vllm:request_success_total\{[^}]*\} ([0-9.]+)$", re.M)
CACHED = re.compile(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.]+)$", re.M)


def figures(port: int) -> tuple[int, int]:
    """(requests served, prompt tokens found in the prefix cache) of one engine."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return int(sum(map(float, SERVED.findall(text)))), int(sum(map(float, CACHED.findall(text))))


@pytest.fixture
def two_replicas(world: World) -> tuple[World, list[int]]:
    started = [start_engine(("sim-routed",), "--sim-decode-tps", "0") for _ in range(2)]
    ports = [engine.port for engine, _ in started]
    deploy(make_model("sim-routed"), Node.objects.get(name="sim-node"), *ports)
    wait_until_served(world.url, world.key_a, "sim-routed")
    yield world, ports
    for _, proc in started:
        stop(proc)


def test_each_conversation_stays_on_one_replica(two_replicas: tuple[World, list[int]]) -> None:
    world, ports = two_replicas
    placed = []
    for session in range(4):
        messages = [
            {"role": "system", "content": f"Agent {session}. " + "Use the tools well. " * 200},
            {"role": "user", "content": "Start."},
        ]
        before = [figures(p)[0] for p in ports]
        for turn in range(3):
            # A new client each turn: new connections, so turns meet both gateway workers.
            client = openai.OpenAI(base_url=world.v1, api_key=world.key_a, max_retries=0)
            answer = client.chat.completions.create(
                model="sim-routed", messages=messages, max_tokens=5
            )
            messages += [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": f"Turn {turn + 1}."},
            ]
        served = [figures(p)[0] - b for p, b in zip(ports, before, strict=True)]
        assert sorted(served) == [0, 3], served  # all three turns on one replica
        placed.append(served.index(3))
    # Between conversations both replicas are idle: a hash of the new prefix breaks the tie,
    # so new conversations spread over both instead of all going to the first one.
    assert set(placed) == {0, 1}
    assert all(figures(p)[1] > 0 for p in ports)  # and each served turns from its cache
