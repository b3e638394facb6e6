"""Prefix-aware routing through the real gateway (two uvicorn workers) and two simulator
replicas of one model: each conversation's turns land on one replica, whose prefix cache
then serves the earlier turns, and the conversations spread over both replicas."""

import hashlib
import re
import urllib.request

import openai
import pytest

from deployments.models import Node, Replica
from gateway.routing import prefix_digests
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


def first_choice(messages: list[dict], replica_ids: list[int]) -> int:
    """Where the gateway places a new conversation among idle replicas: the replica that a
    hash of the prefix ranks first (gateway/route.lua), as an index into ``replica_ids``."""
    digest = prefix_digests("chat", {"messages": messages})[0]
    ranks = [hashlib.sha1(f"{digest}:{rid}".encode()).hexdigest() for rid in replica_ids]
    return ranks.index(min(ranks))


def conversations(replica_ids: list[int], each: int = 2) -> list[tuple[list[dict], int]]:
    """New conversations, ``each`` of them placed first on each replica by the tie-break
    (replica ids differ from run to run, so which agents land where is computed, not hoped)."""
    chosen: list[tuple[list[dict], int]] = []
    for session in range(200):
        messages = [
            {"role": "system", "content": f"Agent {session}. " + "Use the tools well. " * 200},
            {"role": "user", "content": "Start."},
        ]
        where = first_choice(messages, replica_ids)
        if sum(1 for _, w in chosen if w == where) < each:
            chosen.append((messages, where))
        if len(chosen) == each * len(replica_ids):
            return chosen
    raise AssertionError("200 prefixes never ranked every replica first")


def test_each_conversation_stays_on_one_replica(two_replicas: tuple[World, list[int]]) -> None:
    world, ports = two_replicas
    replica_ids = [Replica.objects.get(port=p, deployment__name="sim-routed-dep").pk for p in ports]
    for messages, expected in conversations(replica_ids):
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
        # All three turns on one replica: the one a hash of the new prefix ranked first
        # while both were idle, so new conversations spread over both replicas.
        assert served[expected] == 3 and sum(served) == 3, (served, expected)
    assert all(figures(p)[1] > 0 for p in ports)  # and each served turns from its cache
