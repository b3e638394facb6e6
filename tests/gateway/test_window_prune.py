"""Rate windows after a burst: limiter.lua prunes a bounded number of expired entries per
call, and what it has not pruned yet never counts."""

import asyncio

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from core.keyspace import pool_keys, rate_keys
from core.redis import get_redis
from gateway.limiter import Limiter, SlotRequest
from gateway.state import KeyInfo, Limits, TenantInfo

KEY_ID, TENANT_ID, MODEL = 880101, 880102, 880103
NOW = 1_800_000_000.0  # seconds; the clock is passed in
PRUNE_MAX = 256  # limiter.lua


def key_info(rpm: int, tpm: int) -> KeyInfo:
    return KeyInfo(
        id=KEY_ID,
        prefix="prunetst",
        secret_hash="x",
        tenant_id=TENANT_ID,
        expires_at=0,
        limits=Limits(rpm=rpm, tpm=tpm),
        model_ids=frozenset(),
    )


TENANT = TenantInfo(
    id=TENANT_ID,
    slug="prune",
    priority="P1",
    boost_until=0,
    weight=1,
    limits=Limits(),
    quota_period="monthly",
    quota_tokens=0,
    quota_money_nano=0,
    currency="USD",
    model_ids=frozenset(),
)


@pytest.fixture(autouse=True)
def clean() -> None:
    def wipe() -> None:
        client = get_redis()
        client.delete(*rate_keys(KEY_ID, TENANT_ID), *pool_keys(MODEL))

    wipe()
    yield
    wipe()


def seed(expired: int, live: int, tokens_each: int, live_tokens: int) -> None:
    """A window as a burst leaves it: ``expired`` entries older than the minute (admitted
    61-70 s ago), ``live`` ones within it."""
    zset, hash_ = rate_keys(KEY_ID, TENANT_ID)[:2]
    now_ms = NOW * 1000
    client = get_redis()
    pipe = client.pipeline(transaction=False)
    for start in range(0, expired, 5000):
        batch = range(start, min(start + 5000, expired))
        pipe.zadd(zset, {f"old{i}": now_ms - 70_000 + i * 9_000 / expired for i in batch})
        pipe.hset(hash_, mapping={f"old{i}": tokens_each for i in batch})
    if live:
        pipe.zadd(zset, {f"new{i}": now_ms - 1000 + i for i in range(live)})
        pipe.hset(hash_, mapping={f"new{i}": live_tokens for i in range(live)})
    pipe.hset(hash_, "_sum", expired * tokens_each + live * live_tokens)
    pipe.execute()


def admit(request_id: str, key: KeyInfo, tokens: int, at: float) -> object:
    async def go() -> object:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        limiter = Limiter(client)
        slot = SlotRequest(
            pool=pool_keys(MODEL),
            priority_index=1,
            weight=1,
            budget=1000,
            p2_open=True,
            give_up_ms=10_000,
            lease_ms=60_000,
        )
        try:
            return await limiter.admit(request_id, key, TENANT, tokens, 0, slot, {}, at)
        finally:
            await limiter.aclose()
            await client.aclose()

    return asyncio.run(go())


def window_size() -> int:
    return get_redis().zcard(rate_keys(KEY_ID, TENANT_ID)[0])


def test_a_call_prunes_a_bounded_number_of_expired_entries_and_counts_none_of_them() -> None:
    seed(expired=20_000, live=3, tokens_each=10, live_tokens=10)
    decision = admit("r1", key_info(rpm=10, tpm=0), 10, NOW)
    assert decision.admitted
    assert decision.remaining_requests == 10 - 3 - 1  # the unpruned tail does not count
    assert window_size() == 20_000 + 3 + 1 - PRUNE_MAX
    decision = admit("r2", key_info(rpm=10, tpm=0), 10, NOW + 0.001)
    assert decision.remaining_requests == 10 - 4 - 1
    assert window_size() == 20_000 + 3 + 2 - 2 * PRUNE_MAX


def test_a_request_refused_for_requests_waits_for_the_oldest_live_entry() -> None:
    seed(expired=5_000, live=10, tokens_each=1, live_tokens=1)
    decision = admit("r1", key_info(rpm=10, tpm=0), 1, NOW)
    assert not decision.admitted and decision.reason == "requests"
    assert decision.retry_ms == 59_000  # new0 entered 1 s ago: it leaves in 59 s


def test_tokens_are_exact_when_the_limit_binds() -> None:
    """The unpruned tail's tokens make the running total too high; when that would refuse
    a request, the call prunes more first and decides on the real total."""
    seed(expired=3_000, live=5, tokens_each=10, live_tokens=100)
    decision = admit("r1", key_info(rpm=0, tpm=1000), 400, NOW)
    assert decision.admitted
    assert decision.remaining_tokens == 1000 - 500 - 400
    assert window_size() == 5 + 1
    decision = admit("r2", key_info(rpm=0, tpm=1000), 200, NOW + 0.001)
    assert not decision.admitted and decision.reason == "tokens"
    assert decision.retry_ms == 58_999  # new0 entered 1.001 s ago


def test_a_tail_too_long_to_read_at_once_is_pruned_over_a_few_calls() -> None:
    """More than 4,352 expired entries behind a binding token limit: each call prunes at most
    that many and asks the client to come back in 100 ms, until the tail is gone."""
    seed(expired=10_000, live=0, tokens_each=10, live_tokens=0)
    key = key_info(rpm=0, tpm=1000)
    first = admit("r1", key, 400, NOW)
    assert (first.admitted, first.reason, first.retry_ms) == (False, "tokens", 100)
    assert window_size() == 10_000 - PRUNE_MAX - 4096
    second = admit("r2", key, 400, NOW + 0.1)
    assert (second.admitted, second.retry_ms) == (False, 100)
    third = admit("r3", key, 400, NOW + 0.2)
    assert third.admitted and third.remaining_tokens == 600
    assert window_size() == 1
