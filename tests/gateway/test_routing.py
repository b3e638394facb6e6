"""Prefix-aware routing: a conversation's turns go to the replica that served its prefix,
within a load bound, for every endpoint; its table is shared through Redis."""

import asyncio

import pytest
from django.conf import settings

from core.keyspace import route_keys
from core.redis import get_redis
from gateway.redispipe import RedisPipe
from gateway.routing import PROMPT_CHUNK_CHARS, Router, prefix_digests
from gateway.state import Upstream

MODEL = 880201
SYSTEM = {"role": "system", "content": "You are a coding agent. " * 50}
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]


def turns(session: str, n: int) -> list[dict]:
    """A conversation after ``n`` user turns (and the answers in between)."""
    messages = [SYSTEM]
    for i in range(n):
        if i:
            messages.append({"role": "assistant", "content": f"done {session} {i}"})
        messages.append({"role": "user", "content": f"{session}: step {i}"})
    return messages


def test_the_next_turn_extends_the_prefix_of_the_last() -> None:
    first = prefix_digests("chat", {"tools": TOOLS, "messages": turns("a", 3)})
    second = prefix_digests("chat", {"tools": TOOLS, "messages": turns("a", 4)})
    assert first[0] in second  # the whole of turn 3's prompt is a prefix of turn 4's
    other = prefix_digests("chat", {"tools": TOOLS, "messages": turns("b", 4)})
    assert first[0] not in other  # another session only shares the system prompt
    no_tools = prefix_digests("chat", {"messages": turns("a", 3)})
    assert not set(no_tools) & set(first)  # tools are part of the prefix


@pytest.mark.parametrize(
    ("endpoint", "build"),
    [
        ("messages", lambda n: {"system": "sys", "tools": TOOLS, "messages": turns("m", n)[1:]}),
        ("responses", lambda n: {"instructions": "sys", "input": turns("r", n)[1:]}),
        ("completions", lambda n: {"prompt": "x" * PROMPT_CHUNK_CHARS * n + "tail"}),
    ],
)
def test_every_endpoint_has_prefixes_that_grow(endpoint: str, build: object) -> None:
    earlier, later = prefix_digests(endpoint, build(2)), prefix_digests(endpoint, build(3))
    assert earlier and earlier[0] in later and later[0] not in earlier


def test_a_short_completions_prompt_has_no_prefix_to_route_by() -> None:
    assert prefix_digests("completions", {"prompt": "short"}) == []
    assert prefix_digests("embeddings", {"input": "x"}) == []


def replicas(*loads: int) -> list[Upstream]:
    return [
        Upstream(replica_id=i + 1, deployment_id=1, base_url="", max_num_seqs=4, outstanding=n)
        for i, n in enumerate(loads)
    ]


@pytest.fixture
def router(settings: object) -> Router:
    settings.TOLLGATE_ROUTING = "prefix"
    settings.TOLLGATE_ROUTING_LOAD_FACTOR = 1.25
    get_redis().delete(*route_keys(MODEL))
    yield
    get_redis().delete(*route_keys(MODEL))


def first_choice(ups: list[Upstream], payload: dict, endpoint: str = "chat") -> int:
    async def go() -> int:
        pipe = RedisPipe.from_url(settings.REDIS_URL)
        try:
            ordered = await Router(pipe).order(MODEL, endpoint, payload, ups)
        finally:
            await pipe.aclose()
        assert sorted(u.replica_id for u in ordered) == sorted(u.replica_id for u in ups)
        return ordered[0].replica_id

    return asyncio.run(go())


def test_a_conversation_stays_on_its_replica_within_the_load_bound(router: None) -> None:
    turn = {"tools": TOOLS, "messages": turns("a", 1)}
    assert first_choice(replicas(2, 1, 3), turn) == 2  # new prefix: the least loaded
    # Turn 2 (on another gateway process, say): replica 2 is now busier than replica 1, but
    # within 1.25 × the mean load (3 ≤ ceil(1.25 × 6 / 3)), so the conversation stays where
    # its prefix is cached.
    turn = {"tools": TOOLS, "messages": turns("a", 2)}
    assert first_choice(replicas(1, 2, 2), turn) == 2
    # Turn 3: replica 2 would be overloaded (6 + 1 > ceil(1.25 × 10 / 3)): least loaded.
    turn = {"tools": TOOLS, "messages": turns("a", 3)}
    assert first_choice(replicas(1, 6, 2), turn) == 1
    # Turn 4 follows the prefix to where turn 3 went.
    turn = {"tools": TOOLS, "messages": turns("a", 4)}
    assert first_choice(replicas(1, 1, 1), turn) == 1


def test_other_policies(router: None, settings: object) -> None:
    turn = {"messages": turns("a", 1)}
    settings.TOLLGATE_ROUTING = "least_loaded"
    assert first_choice(replicas(3, 2, 1), turn) == 3
    settings.TOLLGATE_ROUTING = "round_robin"

    async def go() -> list[int]:
        pipe = RedisPipe.from_url(settings.REDIS_URL)
        r, ups = Router(pipe), replicas(0, 0, 0)
        try:
            return [(await r.order(MODEL, "chat", turn, ups))[0].replica_id for _ in range(4)]
        finally:
            await pipe.aclose()

    assert asyncio.run(go()) == [1, 2, 3, 1]
    assert not get_redis().exists(route_keys(MODEL)[0])  # neither touched the prefix table
