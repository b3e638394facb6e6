"""A request whose gateway process died is billed for what it delivered, exactly once."""

import asyncio
import time
from datetime import UTC, datetime

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from core.keyspace import open_keys, pool_keys, quota_key, usage_stream
from core.redis import get_redis
from core.usage import UsageRecord
from gateway.billing import estimate_prompt
from gateway.limiter import Limiter, SlotRequest
from gateway.orphans import reap
from gateway.state import KeyInfo, Limits, TenantInfo
from gateway.usage import checkpoint_value
from metering.periods import period_id

KEY = KeyInfo(
    id=7001,
    prefix="abcdefgh",
    secret_hash="x",
    tenant_id=7002,
    expires_at=0,
    limits=Limits(rpm=100, tpm=100_000),
    model_ids=frozenset(),
)
TENANT = TenantInfo(
    id=7002,
    slug="t",
    priority="P1",
    boost_until=0,
    weight=1,
    limits=Limits(rpm=1000, tpm=1_000_000, concurrent=10),
    quota_period="monthly",
    quota_tokens=0,
    quota_money_nano=10**12,
    currency="USD",
    model_ids=frozenset(),
)
MODEL = 7003


def admit(request_id: str, now: float, prompt: dict | None = None, budget: int = 4) -> object:
    async def go() -> object:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            slot = SlotRequest(
                pool=pool_keys(MODEL),
                priority_index=1,
                weight=1,
                budget=budget,
                p2_open=True,
                give_up_ms=10_000,
                lease_ms=2000,
            )
            record = {
                "event": {
                    "request_id": request_id,
                    "occurred_at": now,
                    "tenant_id": TENANT.id,
                    "api_key_id": KEY.id,
                    "model_id": MODEL,
                    "deployment_id": None,
                    "endpoint": "chat",
                    "priority": "P1",
                    "price_id": 5,
                },
                "price": [1_000_000_000, 500_000_000, 2_000_000_000],
            }
            if prompt is not None:
                record["prompt"] = prompt
            return await Limiter(client).admit(
                request_id, KEY, TENANT, 500, 1_000_000, slot, record, now
            )
        finally:
            await client.aclose()

    return asyncio.run(go())


def events(request_id: str) -> list[UsageRecord]:
    every = [UsageRecord.decode(f[b"e"]) for _, f in get_redis().xrange(usage_stream())]
    return [e for e in every if e.request_id == request_id]


def test_a_dead_gateways_stream_is_billed_its_checkpoint_once_and_released() -> None:
    now = time.time()
    decision = admit("req_orphan_1", now)
    assert decision.admitted and decision.slot
    client = get_redis()
    client.hset(open_keys()[2], "req_orphan_1", checkpoint_value(40, 25, 0, 0))
    assert reap(now) == 0  # the lease still runs: the gateway may be alive
    assert reap(now + 3) == 1
    (event,) = events("req_orphan_1")
    assert (event.prompt_tokens, event.completion_tokens) == (40, 25)
    assert event.status == "error"
    quota = client.hgetall(
        quota_key(TENANT.id, period_id("monthly", datetime.fromtimestamp(now, UTC)))
    )
    assert int(quota[b"tokens_reserved"]) == 0 and int(quota[b"tokens_used"]) == 65
    assert int(quota[b"money_used"]) == (40 * 1000 + 25 * 2000)
    assert client.zcard(pool_keys(MODEL)[0]) == 0  # the engine slot is free again
    assert client.zcard(open_keys()[0]) == 0 and not client.hexists(open_keys()[1], "req_orphan_1")
    assert reap(now + 60) == 0 and len(events("req_orphan_1")) == 1


def test_an_orphan_that_delivered_nothing_is_not_billed() -> None:
    now = time.time()
    assert admit("req_orphan_2", now).admitted
    assert reap(now + 3) == 1
    (event,) = events("req_orphan_2")
    assert (event.prompt_tokens, event.completion_tokens) == (0, 0)


def test_an_orphan_an_engine_took_pays_its_prompt_by_estimate_when_no_engine_can_count(
    db: None,
) -> None:
    """Taken (it got a slot), no usage yet, and the model has no ready engine: the counting
    calls were kept but nobody answers them, so the estimate made from them, marked."""
    now = time.time()
    messages = [{"role": "user", "content": "x" * 400}]
    calls = [["/tokenize", {"model": "m", "messages": messages}, "count"]]
    assert admit("req_orphan_3", now, {"calls": calls, "known": 3}).slot
    assert reap(now + 3) == 1
    (event,) = events("req_orphan_3")
    expected = 3 + estimate_prompt({"messages": messages})
    assert (event.prompt_tokens, event.completion_tokens) == (expected, 0)
    assert event.prompt_estimated


def test_an_orphan_still_queued_for_a_slot_pays_nothing(db: None) -> None:
    now = time.time()
    assert admit("req_orphan_4", now, {"estimate": 50}, budget=1).slot
    queued = admit("req_orphan_5", now, {"estimate": 70}, budget=1)
    assert queued.admitted and not queued.slot
    assert reap(now + 3) == 2
    assert events("req_orphan_4")[0].prompt_tokens == 50
    (event,) = events("req_orphan_5")
    assert (event.prompt_tokens, event.prompt_estimated) == (0, False)


@pytest.fixture(autouse=True)
def _clean() -> None:
    client = get_redis()
    client.delete(quota_key(TENANT.id, period_id("monthly", datetime.now(UTC))))
    yield
    client.delete(
        *pool_keys(MODEL),
        *open_keys(),
        quota_key(TENANT.id, period_id("monthly", datetime.now(UTC))),
    )
